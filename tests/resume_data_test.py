"""A resume trains on the data its run started on (`tfdp.data.fingerprint`), or is refused.

Extending a run with `data_dir` pointing at a copy of Fashion-MNIST whose train
labels were shifted, or after switching `$TFDS_DATA_DIR`, must be refused: the
accountant would otherwise compose steps on two datasets under one ε.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tfdp import data
from tfdp.data import fashion_mnist
from tfdp.data import fingerprint
from tfdp.training import record_variables

from tests.data.fashion_mnist_test import _write_source_dir

NUM_TRAIN, NUM_TEST = 64, 16
PARAMS = ["TARGET_EPSILON = None", "NOISE_MULTIPLIER = 1.0", f"NUM_EXAMPLES = {NUM_TRAIN}"]


def _data_dir(path):
    return f"tfdp.DataConfig.data_dir = '{path}'"


def _prepare(tmp_path_factory, name, shift_labels=0):
    """A TFDS data_dir of a tiny fashion_mnist (the same images for every `name`)."""
    source = tmp_path_factory.mktemp(f"idx_{name}")
    arrays = _write_source_dir(source, np.random.default_rng(0), NUM_TRAIN, NUM_TEST)
    if shift_labels:  # the same images, the train labels shifted by one class
        from tests.data.fashion_mnist_test import _write_idx  # pylint: disable=g-import-not-at-top

        _write_idx(source / "train-labels-idx1-ubyte.gz", 0x00000801,
                   (arrays["train"][1] + shift_labels) % 10)
    return fashion_mnist.prepare_fashion_mnist(source_dir=source,
                                               data_dir=tmp_path_factory.mktemp(f"tfds_{name}"))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    original = _prepare(tmp_path_factory, "original")
    moved = tmp_path_factory.mktemp("moved") / "tfds"
    shutil.copytree(original, moved)
    return {"original": original, "moved": moved,
            "shifted": _prepare(tmp_path_factory, "shifted", shift_labels=1)}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, dirs, run_smoke_module):
    """A 2-step run on the original data (of a planned 2; NUM_STEPS = 4 extends it)."""
    workdir = tmp_path_factory.mktemp("stopped") / "wd"
    run_smoke_module(workdir, ["fashion_mnist.gin"],
                     [*PARAMS, _data_dir(dirs['original'])], mock=False)
    return workdir


def _tree(workdir):
    return sorted((os.path.relpath(os.path.join(root, name), workdir),
                   os.stat(os.path.join(root, name)).st_mtime_ns)
                  for root, _, files in os.walk(workdir) for name in files)


def test_a_resume_on_other_labels_is_refused_naming_the_split(stopped, dirs, run_smoke,
                                                             tmp_path):
    workdir = tmp_path / "wd"
    shutil.copytree(stopped, workdir)
    before = _tree(workdir)
    with pytest.raises(ValueError) as refused:
        run_smoke(workdir, ["fashion_mnist.gin"],
                  [*PARAMS, _data_dir(dirs['shifted']), "NUM_STEPS = 4"], mock=False)
    message = str(refused.value)
    assert "trained on other data than this command reads" in message, message
    assert "train split: sha256" in message and "every byte of the split's shard" in message
    assert "test split" not in message  # the test split is the same
    assert "Nothing was changed" in message
    assert _tree(workdir) == before


@pytest.mark.slow
def test_the_same_files_moved_elsewhere_resume(stopped, dirs, run_smoke, tmp_path):
    workdir = tmp_path / "wd"
    shutil.copytree(stopped, workdir)
    report = run_smoke(workdir, ["fashion_mnist.gin"],
                       [*PARAMS, _data_dir(dirs['moved']), "NUM_STEPS = 4"], mock=False)
    assert report["steps"] == 4


def test_a_checkpoint_without_a_data_record_is_not_resumed(stopped, dirs, run_smoke, tmp_path,
                                                           monkeypatch):
    # A checkpoint of a tfdp before the fingerprints: its data cannot be compared.
    workdir = tmp_path / "wd"
    shutil.copytree(stopped, workdir)
    monkeypatch.setattr(record_variables, "saved_data_fingerprint", lambda path: None)
    with pytest.raises(ValueError, match=r"does not record which data it was trained on"):
        run_smoke(workdir, ["fashion_mnist.gin"],
                  [*PARAMS, _data_dir(dirs['original']), "NUM_STEPS = 4"], mock=False)


# Two CLI processes (14 s in the suite): under -m slow. The default suite checks the refusal
# in process with the data_dir binding switched (test_a_resume_on_other_labels_is_refused_
# naming_the_split), not $TFDS_DATA_DIR (read once per process by TFDS): the fingerprint is
# of the files' contents, whichever way their folder was named. tests/main_test.py checks that
# a CLI error exits 2 in one line without a traceback.
@pytest.mark.slow
def test_switching_tfds_data_dir_is_refused_through_the_cli(dirs, tmp_path):
    # Before: no binding changed, so nothing was even logged.
    workdir = tmp_path / "wd"

    def run(data_dir, steps):
        command = [sys.executable, "-m", "tfdp.main", f"--workdir={workdir}",
                   "--gin_file=fashion_mnist.gin", "--gin_file=smoke.gin",
                   *[f"--gin_param={p}" for p in (*PARAMS, "BATCH_SIZE = 16",
                                                  f"NUM_STEPS = {steps}")]]
        return subprocess.run(command, env={**os.environ, "TFDS_DATA_DIR": str(data_dir)},
                              capture_output=True, text=True, timeout=600)

    first = run(dirs["original"], 2)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run(dirs["shifted"], 4)
    assert second.returncode == 2, second.stderr[-3000:]
    assert "trained on other data than this command reads" in second.stderr
    assert "Traceback" not in second.stderr
    assert json.loads((workdir / "privacy_report.json").read_text())["steps"] == 2


# -- The fingerprints themselves: what each covers -----------------------------------------


def test_array_fingerprints_see_one_changed_label_or_pixel():
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (20, 4, 4, 1), dtype=np.uint8)
    labels = rng.integers(0, 10, 20)
    base = fingerprint.split_fingerprint(data.ArraySource(images, labels, 10))
    assert base == fingerprint.split_fingerprint(data.ArraySource(images.copy(), labels, 10))
    other_label, other_pixel = labels.copy(), images.copy()
    other_label[7] = (other_label[7] + 1) % 10
    other_pixel[3, 1, 2, 0] ^= 1
    for changed in (data.ArraySource(images, other_label, 10),
                    data.ArraySource(other_pixel, labels, 10)):
        lines = fingerprint.differences({"train": base},
                                        {"train": fingerprint.split_fingerprint(changed)})
        assert len(lines) == 1 and lines[0].startswith("train split: sha256"), lines


def test_a_large_split_is_fingerprinted_by_sampled_blocks_and_says_so(dirs, tmp_path,
                                                                      monkeypatch):
    copy = tmp_path / "tfds"
    shutil.copytree(dirs["original"], copy)
    monkeypatch.setattr(fingerprint, "FULL_DIGEST_MAX_BYTES", 0)
    monkeypatch.setattr(fingerprint, "BLOCK_BYTES", 1024)
    monkeypatch.setattr(fingerprint, "SAMPLE_BUDGET_BYTES", 4096)
    before = fingerprint.split_fingerprint(data.TFDSSource("fashion_mnist", "train",
                                                           data_dir=str(copy)))
    assert "blocks of" in before["covers"]
    shard = next(copy.rglob("*train.array_record*"))
    content = bytearray(shard.read_bytes())
    content[0] ^= 0xFF  # inside the first sampled block
    shard.write_bytes(bytes(content))
    after = fingerprint.split_fingerprint(data.TFDSSource("fashion_mnist", "train",
                                                          data_dir=str(copy)))
    assert after["sha256"] != before["sha256"]


def test_a_split_slice_is_part_of_the_fingerprint(dirs):
    def of(split):
        return fingerprint.split_fingerprint(
            data.TFDSSource("fashion_mnist", split, data_dir=str(dirs["original"])))

    assert of("train[:32]")["sha256"] != of("train[32:]")["sha256"]
    assert fingerprint.differences({"train": of("train")}, {"train": of("train")}) == []


def test_other_digest_defaults_in_a_newer_tfdp_still_recognize_the_same_data(dirs,
                                                                             monkeypatch):
    # The digest's parameters are recorded with it; a resume recomputes with those.
    source = data.TFDSSource("fashion_mnist", "train", data_dir=str(dirs["original"]))
    saved = {"train": fingerprint.split_fingerprint(source)}
    monkeypatch.setattr(fingerprint, "FULL_DIGEST_MAX_BYTES", 0)  # now: sampled blocks
    monkeypatch.setattr(fingerprint, "BLOCK_BYTES", 1024)
    assert fingerprint.split_fingerprint(source)["sha256"] != saved["train"]["sha256"]
    assert fingerprint.compare(saved, {"train": source}) == []
    shifted = data.TFDSSource("fashion_mnist", "train", data_dir=str(dirs["shifted"]))
    assert fingerprint.compare(saved, {"train": shifted})[0].startswith("train split: sha256")


def test_a_resume_reads_the_split_once_when_the_method_is_the_same(dirs, monkeypatch):
    source = data.TFDSSource("fashion_mnist", "train", data_dir=str(dirs["original"]))
    current = {"train": fingerprint.split_fingerprint(source)}
    reads = []
    monkeypatch.setattr(fingerprint, "_tfds_digest",
                        lambda *args: reads.append(args) or {})
    assert fingerprint.compare(current, {"train": source}, current) == []
    assert reads == []  # the fingerprint computed at start is reused
