"""The settings as config objects (`tfdp.configs`): their checks, old bindings, migration."""

import ast
import dataclasses
import os
import re
import subprocess
import sys

import gin
import pytest

from tfdp import configs
from tfdp import main
from tfdp import resume_rule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _old_style(text):
    """`text` with every setting bound as an argument of the trainer, as older tfdp did."""
    return re.sub(r"^tfdp\.(\w+Config)\.(\w+)(?=\s*=)", lambda m: (
        f"tfdp.train_and_evaluate.{m.group(2)}" if m.group(1) in {
            c.__name__ for c in configs.CONFIGS} else m.group(0)), text, flags=re.MULTILINE)


@pytest.mark.parametrize("config", sorted(main.shipped_gin_configs()))
def test_migrating_an_old_style_config_gives_the_shipped_one(config):
    text = open(main.shipped_gin_configs()[config]).read()
    old = _old_style(text)
    if "Config." in text:
        assert old != text and configs.old_bindings(old)
    assert configs.migrate(old) == text
    assert configs.old_bindings(text) == []


def test_every_old_setting_has_one_home():
    homes = [f"tfdp.{c.__name__}.{f.name}" for c in configs.CONFIGS for f in dataclasses.fields(c)]
    assert sorted(configs.MOVED.values()) == sorted(homes)
    assert len(set(configs.MOVED)) == len(homes)  # no name in two groups
    assert not {"model_fn", "privacy", "audit", "workdir"} & set(configs.MOVED)


@pytest.mark.parametrize("where", ["file", "param"])
def test_an_old_binding_is_refused_naming_its_new_home(tmp_path, where):
    path = tmp_path / "mine.gin"
    text = _old_style(open(main.shipped_gin_configs()["fashion_mnist.gin"]).read())
    if where == "file":
        path.write_text(text)
        files, params = [str(path)], []
    else:
        files, params = ["fashion_mnist.gin"], ["tfdp.train_and_evaluate.batch_size = 256"]
    gin.clear_config()
    try:
        with pytest.raises(main.ConfigError) as error:
            main.parse_config(files, params)
    finally:
        gin.clear_config()
    message = str(error.value)
    assert "tfdp.train_and_evaluate.batch_size is now tfdp.OptimizationConfig.batch_size" in (
        message), message
    assert "tools/migrate_config.py" in message and (str(path) if where == "file" else
                                                       "--gin_param") in message


def test_an_old_binding_in_an_included_file_is_named(tmp_path):
    (tmp_path / "base.gin").write_text(
        _old_style(open(main.shipped_gin_configs()["fashion_mnist.gin"]).read()))
    (tmp_path / "top.gin").write_text(f"include '{tmp_path / 'base.gin'}'\n")
    gin.clear_config()
    try:
        with pytest.raises(main.ConfigError, match=r"is now tfdp\.\w+Config\.\w+"):
            main.parse_config([str(tmp_path / "top.gin")], [])
    finally:
        gin.clear_config()


# Three processes that start TensorFlow (11 s): under -m slow. The default suite checks the
# rewrite itself on every shipped config (test_migrating_an_old_style_config_gives_the_shipped_one).
@pytest.mark.slow
def test_the_migration_tool_rewrites_a_file_and_the_result_parses(tmp_path):
    path = tmp_path / "mine.gin"
    shipped = open(main.shipped_gin_configs()["fashion_mnist_scatternet_linear.gin"]).read()
    path.write_text(_old_style(shipped))
    dry = subprocess.run([sys.executable, "tools/migrate_config.py", "--dry_run", str(path)],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    assert "tfdp.train_and_evaluate.num_examples -> tfdp.DataConfig.num_examples" in dry.stdout
    assert path.read_text() == _old_style(shipped)  # a dry run changes nothing
    subprocess.run([sys.executable, "tools/migrate_config.py", str(path)], cwd=ROOT,
                   capture_output=True, text=True, check=True)
    assert path.read_text() == shipped
    missing = subprocess.run([sys.executable, "tools/migrate_config.py", str(tmp_path / "no.gin")],
                             cwd=ROOT, capture_output=True, text=True)
    assert missing.returncode == 1 and missing.stderr.startswith("error: cannot read")


def test_an_older_checkpoints_settings_compare_under_their_new_homes():
    text = "NUM_STEPS = 4\ntfdp.OptimizationConfig.num_steps = %NUM_STEPS\n" \
           "tfdp.OptimizationConfig.batch_size = 16\ntfdp.DataConfig.dataset = 'fashion_mnist'\n"
    gin.clear_config()
    try:
        main.parse_config(["fashion_mnist.gin"], [])  # registers the configurables
        assert resume_rule.changed_settings(_old_style(text), text) == []
        changed = resume_rule.changed_settings(_old_style(text), text.replace("16", "32"))
        assert [c.name for c in changed] == ["tfdp.OptimizationConfig.batch_size"]
        assert not changed[0].resumable
        more = resume_rule.changed_settings(_old_style(text), text.replace("= 4", "= 8"))
        assert [(c.name, c.resumable) for c in more] == [
            ("tfdp.OptimizationConfig.num_steps", True)]
    finally:
        gin.clear_config()


@pytest.mark.parametrize("cls, kwargs, message", [
    (configs.DataConfig, dict(dataset="d", num_examples=0), "num_examples must be a positive"),
    (configs.DataConfig, dict(dataset="d", num_examples=5, features="pixels"),
     "Unknown features 'pixels'"),
    (configs.AugmentationConfig, dict(augtest=True), "augtest needs an augmentation"),
    (configs.AugmentationConfig, dict(augmult=-1), "augmult must be an int >= 0"),
    (configs.AugmentationConfig, dict(augmentation_kwargs={"padding": 2}),
     "no augmentation reads them"),
    (configs.AugmentationConfig, dict(augmentation="mnist_crop", augmult=2,
                                      augmentation_kwargs={"no_such_keyword": 1}), "keyword"),
    (configs.PrivacyConfig, dict(target_delta=1e-5), "needs l2_clip_norm: set "
                                                     "tfdp.PrivacyConfig.l2_clip_norm"),
    (configs.PrivacyConfig, dict(l2_clip_norm=1.0, target_delta=1e-5, clipping="fast"),
     "clipping must be one of"),
    (configs.OptimizationConfig, dict(optimizer_fn=None, batch_size=2, num_steps=2,
                                      sampling="uniform"), "Unknown sampling scheme"),
    (configs.OptimizationConfig, dict(optimizer_fn=None, batch_size=2, num_steps=2,
                                      accumulation_steps=0), "accumulation_steps must be"),
    (configs.EvaluationConfig, dict(eval_every_steps=0), "eval_every_steps must be >= 1"),
    (configs.EvaluationConfig, dict(eval_examples=True), "eval_examples must be None"),
    (configs.RuntimeConfig, dict(jit_compile="yes"), "jit_compile must be True or False"),
    (configs.RuntimeConfig, dict(static_batch_size=2.5), "static_batch_size must be None"),
])
def test_each_group_checks_itself(cls, kwargs, message):
    gin.clear_config()
    with pytest.raises(ValueError, match=re.escape(message) if "." in message else message):
        cls(**kwargs)


def test_each_group_is_frozen():
    config = configs.EvaluationConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.eval_every_steps = 3


def test_the_config_layer_does_not_import_the_keras_model():
    """configs.py imports no training module: the settings check without the DPModel."""
    tree = ast.parse(open(os.path.join(ROOT, "tfdp", "configs.py")).read())
    imported = [f"{node.module}.{alias.name}" for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) for alias in node.names]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names]
    assert not [name for name in imported if name.startswith("tfdp.training")], imported
    assert "ghost" in configs.CLIPPING_PATHS


def test_the_trainer_has_no_branch_on_the_privacy_mode():
    """train_and_evaluate asks its mode object, never which mode it is (tfdp.modes)."""
    source = open(os.path.join(ROOT, "tfdp", "experiment.py")).read()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp)):
            test = ast.unparse(node.test)
            assert not re.search(r"privacy|private|NonPrivate|DPMechanism", test), test
    assert len(source.splitlines()) < 400
    function = next(n for n in tree.body if getattr(n, "name", "") == "train_and_evaluate")
    body = function.body[1:]  # after the docstring
    assert body[-1].end_lineno - body[0].lineno + 1 <= 40


def test_no_function_in_the_package_is_over_120_lines():
    long = []
    for folder, _, files in os.walk(os.path.join(ROOT, "tfdp")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        lines = node.end_lineno - node.lineno + 1
                        if lines > 120:
                            long.append(f"{os.path.relpath(path, ROOT)}:{node.name} {lines}")
    assert not long, long


def test_a_commented_out_old_binding_is_not_named():
    text = "# tfdp.train_and_evaluate.batch_size = 256\ntfdp.OptimizationConfig.num_steps = 3\n"
    assert configs.old_bindings(text) == []
    assert configs.old_bindings("tfdp.train_and_evaluate.num_steps = 3  # was 4") == [
        ("tfdp.train_and_evaluate.num_steps", "tfdp.OptimizationConfig.num_steps")]


@pytest.mark.parametrize("make, match", [
    (lambda: configs.PrivacyConfig(l2_clip_norm=1.0, target_delta=1e-5, sampling_seed=2**70),
     r"tfdp.PrivacyConfig.sampling_seed=1180591620717411303424: a seed must be an int"),
    (lambda: configs.PrivacyConfig(l2_clip_norm=1.0, target_delta=1e-5, noise_seed=-1),
     r"tfdp.PrivacyConfig.noise_seed=-1: a seed"),
    (lambda: configs.RuntimeConfig(seed=-1), r"tfdp.RuntimeConfig.seed=-1: a seed must be an "
                                             r"int from 0 to 4294967295"),
    (lambda: configs.DataConfig(dataset=None, num_examples=10), r"tfdp.DataConfig.dataset=None"),
    (lambda: configs.PrivacyConfig(l2_clip_norm=1.0, target_delta=1e-5, study_dir="gs://b/s"),
     "study ledger is a local"),
])
def test_a_setting_out_of_range_is_refused_naming_it(make, match):
    with pytest.raises(ValueError, match=match):
        make()
