"""The settings as config objects (`tfdp.configs`): their checks, and old bindings refused."""

import ast
import dataclasses
import os
import re

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
    moved = re.search(r"tfdp\.train_and_evaluate\.(\w+) is now (tfdp\.\w+Config)\.(\w+)\.",
                      message)
    assert moved and moved.group(1) == moved.group(3), message
    assert configs.MOVED[moved.group(1)] == f"{moved.group(2)}.{moved.group(1)}"
    if where == "file":  # gin names the file and line of the first old binding
        assert f'In file "{path}", line' in message, message
    else:
        assert moved.group(1) == "batch_size" and "--gin_param" in message, message


def test_an_old_binding_in_an_included_file_is_named(tmp_path):
    """Gin's location names the included file and the include."""
    (tmp_path / "base.gin").write_text(
        _old_style(open(main.shipped_gin_configs()["fashion_mnist.gin"]).read()))
    (tmp_path / "top.gin").write_text(f"include '{tmp_path / 'base.gin'}'\n")
    gin.clear_config()
    try:
        with pytest.raises(main.ConfigError, match=r"is now tfdp\.\w+Config\.\w+") as error:
            main.parse_config([str(tmp_path / "top.gin")], [])
    finally:
        gin.clear_config()
    assert f'In file "{tmp_path / "base.gin"}"' in str(error.value)
    assert f'In file "{tmp_path / "top.gin"}"' in str(error.value)


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
