"""README's `make_private` example runs as written, and trains privately."""

import json
import os
import re

import numpy as np
import pytest

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def _example():
    text = open(README, encoding="utf-8").read()
    section = text.split("## Your own model and data", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_trains_to_the_target_and_exports(tmp_path, monkeypatch, capsys):
    code = _example()
    assert len(code.strip().splitlines()) <= 20
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)  # pylint: disable=exec-used
    printed = float(capsys.readouterr().out.strip().splitlines()[-1])
    private = scope["private"]
    assert printed == pytest.approx(private.epsilon()[0]) and 2.5 < printed <= 3.0
    assert private.steps == 30  # 3 epochs of 2,000 at an expected 200
    assert private.model.clipping_path == "ghost"  # a user's Sequential model: ghost norms
    accuracy = private.evaluate((scope["images"], scope["labels"]))["accuracy"]
    assert accuracy > 0.9
    report = json.loads((tmp_path / "my_private_model" / "assets" /
                         "privacy_report.json").read_text())
    assert report["epsilon"] == pytest.approx(printed)
    assert report["sampling"]["scheme"] == "poisson"


def test_make_private_refuses_what_would_be_wrong():
    import keras  # pylint: disable=g-import-not-at-top

    import tfdp  # pylint: disable=g-import-not-at-top

    images = np.zeros((100, 8, 8, 1), np.uint8)
    labels = np.arange(100) % 3
    plain = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(2)])
    privacy = tfdp.PrivacyConfig(target_epsilon=3.0, target_delta=1e-5, l2_clip_norm=1.0)
    common = tfdp.PrivateTrainingConfig(privacy=privacy, optimization=tfdp.OptimizationConfig(
        optimizer_fn=keras.optimizers.SGD, batch_size=10,
        num_steps=tfdp.num_steps_for_epochs(1, num_examples=100, batch_size=10)))
    with pytest.raises(ValueError, match=r"labels must be in \[0, 2\)"):
        tfdp.make_private(plain, (images, labels), common)
    with pytest.raises(ValueError, match="images must be uint8"):
        tfdp.make_private(plain, (images.astype(np.float32), labels % 2), common)
    batchnorm = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.BatchNormalization(),
                                  keras.layers.Flatten(), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="BatchNorm"):
        tfdp.make_private(batchnorm, (images, labels % 2), common)
    with pytest.raises(ValueError, match="clipping must be one of"):
        tfdp.PrivacyConfig(target_epsilon=3.0, target_delta=1e-5, l2_clip_norm=1.0,
                           clipping="fast")
    private = tfdp.make_private(plain, (images, labels % 2), common)
    with pytest.raises(ValueError, match="fixed-size shuffled batches"):
        private.model.fit(images, labels % 2, batch_size=10)


def test_a_tf_data_dataset_of_pairs_is_accepted():
    import keras  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    import tfdp  # pylint: disable=g-import-not-at-top

    images = np.zeros((50, 8, 8, 1), np.uint8)
    labels = np.arange(50) % 2
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(2)])
    dataset = tf.data.Dataset.from_tensor_slices((images, labels))
    config = tfdp.PrivateTrainingConfig(
        privacy=tfdp.PrivacyConfig(noise_multiplier=1.0, target_delta=1e-5, l2_clip_norm=1.0),
        optimization=tfdp.OptimizationConfig(optimizer_fn=keras.optimizers.SGD, batch_size=10,
                                             num_steps=2))
    private = tfdp.make_private(model, dataset, config)
    assert private.source.num_examples == 50 and private.mechanism.sampling_prob == 0.2
    with pytest.raises(ValueError, match="single .* pairs, not batches"):
        tfdp.make_private(model, dataset.batch(5), config)


# The docs: README is the entry, each topic's detail is a page under docs/ linked from it.

ROOT = os.path.join(os.path.dirname(__file__), "..")
DOCS = os.path.join(ROOT, "docs")


def _pages():
    return sorted(name for name in os.listdir(DOCS) if name.endswith(".md"))


DESIGN = os.path.join(DOCS, "design")


def _design_pages():
    """The design pages (docs/design/), each a path; README.md there is their index."""
    return [os.path.join(DESIGN, name) for name in sorted(os.listdir(DESIGN))
            if name.endswith(".md")]


def _read(path):
    return open(path, encoding="utf-8").read()


def _prose(text):
    """The text outside fenced code blocks."""
    return re.sub(r"^ *```.*?^ *```", "", text, flags=re.S | re.M)


def _anchors(text):
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    seen, anchors = {}, set()
    for heading in re.findall(r"^#{1,6} (.+)$", _prose(text), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(text):
    return re.findall(r"\]\(([^)\s]+)\)", _prose(text))


def test_readme_is_the_entry_and_links_every_page():
    text = _read(README)
    assert len(text.splitlines()) <= 220, "README is the entry: move detail into a docs/ page"
    linked = {os.path.normpath(link.split("#")[0]) for link in _links(text)}
    for page in _pages():
        assert os.path.join("docs", page) in linked, f"README does not link docs/{page}"


def test_every_relative_link_in_the_docs_resolves():
    files = ([README, os.path.join(ROOT, "CHANGELOG.md")] + [os.path.join(DOCS, p) for p in _pages()]
             + _design_pages())
    for path in files:
        for link in _links(_read(path)):
            if re.match(r"[a-z]+:", link):
                continue  # https:, mailto:
            target, _, anchor = link.partition("#")
            target = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target \
                else path
            assert os.path.exists(target), f"{os.path.basename(path)}: {link} is missing"
            if anchor and target.endswith(".md"):
                assert anchor in _anchors(_read(target)), \
                    f"{os.path.basename(path)}: {link}: no such heading"


def test_user_docs_name_no_issue_numbers():
    for path in [README] + [os.path.join(DOCS, p) for p in _pages()] + _design_pages():
        text = re.sub(r"\]\([^)]*\)", "]", _read(path))  # a link's address may name one
        found = re.findall(r".{0,30}\bissues? \d+.{0,30}", text, flags=re.I)
        assert not found, f"{os.path.basename(path)}: {found}"


def test_each_page_says_what_it_covers_and_links_back():
    for page in _pages():
        lines = _read(os.path.join(DOCS, page)).splitlines()
        assert lines[0].startswith("# "), page
        first_paragraph = " ".join(lines[2:lines.index("", 2)])
        assert "](../README.md)" in first_paragraph, page


def test_the_design_pages_are_indexed_and_link_back():
    index = os.path.join(DESIGN, "README.md")
    linked = {os.path.normpath(link.split("#")[0]) for link in _links(_read(index))}
    assert "../../README.md" in linked and "../../CHANGELOG.md" in linked
    for path in _design_pages():
        lines = _read(path).splitlines()
        assert lines[0].startswith("# "), path
        first_paragraph = " ".join(lines[2:lines.index("", 2)])
        if path != index:
            assert os.path.basename(path) in linked, f"docs/design/README.md does not link {path}"
            assert "](README.md)" in first_paragraph, path
        assert "](../../README.md)" in first_paragraph, path


def test_readme_keeps_the_two_commands_and_ci_runs_command_2():
    text = _read(README)
    section = text.split("## Two commands for a fresh machine", 1)[1].split("\n## ", 1)[0]
    command_1, command_2 = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    assert "python -m tfdp.main --gin_file=fashion_mnist.gin" in command_1
    ci = _read(os.path.join(ROOT, ".ci", "run")).splitlines()
    assert command_2 in ci, "`.ci/run` runs README's command 2 verbatim"
