"""A bound argument that the run's branch does not read is refused.

Gin passes every bound argument to its function, and a function reads some
only in one branch: `build_optimizer`'s `beta_1` only for Adam, `momentum`
only for "momentum" ("sgd" is DP-SGD without momentum), `make_strategy`'s
`tpu` only under the TPU strategy, `augmentation_kwargs` only with an
augmentation. Such a binding trained without its value, said nothing, and
was written to operative_config.gin as if it had been used.
"""

import logging
import subprocess
import sys

import gin
import pytest

from tfdp import data
from tfdp import experiment
from tfdp import main

_MOCK_CLI = r'''
import sys
from tfdp import data
with data.mock_data(num_examples=64):
    from tfdp import main
    sys.argv = ["tfdp.main"] + sys.argv[1:]
    main.run()
'''


def _parse(files, params):
    gin.clear_config()
    try:
        main.parse_config(files, params)
    finally:
        gin.clear_config()


def test_cli_refuses_every_unread_argument_by_name_before_the_workdir(tmp_path):
    # Before: trained its 2 steps on sgd, the default strategy and no augmentation, exit 0,
    # with all five values dropped (and listed in operative_config.gin).
    wrapper = tmp_path / "run_tfdp.py"
    wrapper.write_text(_MOCK_CLI)
    proc = subprocess.run(
        [sys.executable, str(wrapper), f"--workdir={tmp_path / 'wd'}",
         "--gin_file=fashion_mnist.gin", "--gin_file=smoke.gin",
         *[f"--gin_param={p}" for p in (
             "NUM_EXAMPLES = 64", "BATCH_SIZE = 16",
             "tfdp.training.build_optimizer.name = 'sgd'",
             "tfdp.training.build_optimizer.momentum = 0.5",
             "tfdp.training.build_optimizer.beta_1 = 0.5",
             "tfdp.training.make_strategy.tpu = 'my-tpu'",
             "tfdp.training.make_strategy.devices = ['/cpu:0']",
             "tfdp.AugmentationConfig.augmentation_kwargs = {'padding': 4}")]],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    error = [line for line in proc.stderr.splitlines() if line.startswith("tfdp: error:")]
    assert len(error) == 1, proc.stderr[-3000:]
    for expected in (
            "tfdp.training.build_optimizer.momentum = 0.5: momentum is read only by the "
            "optimizer 'momentum', and this run's optimizer is 'sgd' "
            "(tfdp.training.build_optimizer.name)",
            "tfdp.training.build_optimizer.beta_1 = 0.5: beta_1 is read only by the optimizer "
            "'adam' or 'adamw'",
            "tfdp.training.make_strategy.tpu = 'my-tpu': tpu is read only by the strategy "
            "'tpu', and this run's strategy is 'default' (tfdp.RuntimeConfig.strategy, "
            "not bound: its default)",
            "tfdp.training.make_strategy.devices = ['/cpu:0']: devices is read only by the "
            "strategy 'mirrored'",
            "tfdp.AugmentationConfig.augmentation_kwargs = {'padding': 4}: augmentation_kwargs "
            "is read only by the augmentation "):
        assert expected in error[0], error[0]
    assert not (tmp_path / "wd").exists()


@pytest.mark.parametrize("files, param, expected", [
    # Before: each was accepted, and the run trained without it.
    (["fashion_mnist.gin"], "tfdp.training.build_optimizer.beta_1 = 0.5",
     "tfdp.training.build_optimizer.beta_1 = 0.5: beta_1 is read only by the optimizer 'adam' "
     "or 'adamw', and this run's optimizer is 'momentum' (tfdp.training.build_optimizer.name); "
     "remove the binding, or set tfdp.training.build_optimizer.name to 'adam' or 'adamw'"),
    (["cifar10_wrn16_4_eps1.gin"], "tfdp.training.build_optimizer.momentum = 0.5",
     "momentum is read only by the optimizer 'momentum', and this run's optimizer is 'sgd'"),
    (["fashion_mnist.gin"], "build_optimizer.epsilon = 1e-3",  # a short name, too
     "tfdp.training.build_optimizer.epsilon = 0.001: epsilon is read only by the optimizer "
     "'adam' or 'adamw'"),
    (["fashion_mnist.gin"], "tfdp.training.make_strategy.tpu = 'local'",  # its own default
     "tpu is read only by the strategy 'tpu', and this run's strategy is 'default'"),
    (["fashion_mnist.gin"], "tfdp.training.make_strategy.devices = ['/gpu:0']",
     "devices is read only by the strategy 'mirrored', and this run's strategy is 'default'"),
    (["fashion_mnist.gin"], "tfdp.training.make_strategy.worker_timeout_s = 60",
     "worker_timeout_s is read only by the strategy 'multi_worker_mirrored'"),
    (["fashion_mnist.gin"], "tfdp.AugmentationConfig.augmentation_kwargs = {'padding': 4}",
     "augmentation_kwargs is read only by the augmentation 'cifar_crop_flip', "),
])
def test_an_argument_the_branch_does_not_read_is_refused(files, param, expected):
    with pytest.raises(main.ConfigError) as error:
        _parse(files, [param])
    message = str(error.value)
    assert message.startswith("Gin binding(s) of an argument this run would not read"), message
    assert expected in message, message


def test_augmentation_kwargs_without_an_augmentation_is_refused_also_with_augmult():
    # augmult > 0 without an augmentation gives K identical views ("none"), which take no
    # arguments: before, get_augmentation refused {'padding': 4} only after the first
    # checkpoint had been written.
    with pytest.raises(main.ConfigError, match=r"augmentation_kwargs = \{'padding': 4\}: "
                       r"augmentation_kwargs is read only by the augmentation .*and this "
                       r"run's augmentation is None \(tfdp.AugmentationConfig.augmentation, "
                       r"not bound: its default\)"):
        _parse(["fashion_mnist.gin"], ["tfdp.AugmentationConfig.augmult = 2",
                                       "tfdp.AugmentationConfig.augmentation_kwargs = "
                                       "{'padding': 4}"])


def test_a_config_file_that_binds_an_argument_its_branch_does_not_read_is_refused(tmp_path):
    config = tmp_path / "mine.gin"
    config.write_text("include 'cifar10_wrn16_4_eps1.gin'\n"
                      "tfdp.training.build_optimizer.momentum = 0.9\n")
    with pytest.raises(main.ConfigError, match=r"build_optimizer.momentum = 0.9: momentum is "
                       r"read only by the optimizer 'momentum', and this run's optimizer is "
                       r"'sgd'"):
        _parse([str(config)], [])


@pytest.mark.parametrize("files, params", [
    (["fashion_mnist.gin"], ["tfdp.training.build_optimizer.momentum = 0.5"]),
    (["fashion_mnist.gin"], ["tfdp.training.build_optimizer.name = 'adam'",
                             "tfdp.training.build_optimizer.beta_1 = 0.5"]),
    (["cifar10_wrn16_4_eps1.gin"], ["tfdp.training.build_optimizer.name = 'adamw'",
                                    "tfdp.training.build_optimizer.beta_2 = 0.99",
                                    "tfdp.training.build_optimizer.weight_decay = 1e-4"]),
    (["fashion_mnist.gin"], ["tfdp.RuntimeConfig.strategy = 'mirrored'",
                             "tfdp.training.make_strategy.devices = ['/cpu:0']"]),
    (["fashion_mnist.gin"], ["tfdp.RuntimeConfig.strategy = 'tpu'",
                             "tfdp.training.make_strategy.tpu = 'my-tpu'"]),
    (["fashion_mnist.gin"], ["tfdp.RuntimeConfig.strategy = 'multi_worker_mirrored'",
                             "tfdp.training.make_strategy.worker_timeout_s = 60"]),
    (["fashion_mnist.gin"], ["tfdp.AugmentationConfig.augmentation = 'mnist_crop'",
                             "tfdp.AugmentationConfig.augmentation_kwargs = {'padding': 4}"]),
    (["imagenet_tan.gin"], []),  # binds augmentation_kwargs with its augmentation
])
def test_an_argument_its_branch_reads_is_accepted(files, params):
    _parse(files, params)


def test_a_gin_param_that_switches_the_branch_says_what_it_leaves_unread(caplog):
    # fashion_mnist.gin binds momentum = 0.9 for its "momentum" optimizer; gin cannot unbind
    # it, so a --gin_param that picks Adam is accepted, and the log names what it drops.
    with caplog.at_level(logging.WARNING):
        _parse(["fashion_mnist.gin"], ["tfdp.training.build_optimizer.name = 'adam'"])
    assert ("A --gin_param chose the optimizer 'adam' (tfdp.training.build_optimizer.name), "
            "so the config's tfdp.training.build_optimizer.momentum = 0.9 is not read: "
            "momentum is read only by the optimizer 'momentum'") in caplog.text
    # A value the --gin_param itself gives for an argument that is not read is refused.
    with pytest.raises(main.ConfigError, match=r"build_optimizer.momentum = 0.5: momentum"):
        _parse(["fashion_mnist.gin"], ["tfdp.training.build_optimizer.name = 'adam'",
                                       "tfdp.training.build_optimizer.momentum = 0.5"])


# -- The same property for a user who calls train_and_evaluate from Python ---------------


def test_train_and_evaluate_refuses_augmentation_kwargs_without_an_augmentation(tmp_path):
    # Before: the 2 steps trained without augmentation, and {'padding': 4} was dropped.
    gin.clear_config()
    gin.parse_config_files_and_bindings(
        [main.resolve_gin_file("fashion_mnist.gin"), main.resolve_gin_file("smoke.gin")],
        ["NUM_EXAMPLES = 64", "BATCH_SIZE = 16",
         "tfdp.AugmentationConfig.augmentation_kwargs = {'padding': 4}"])
    try:
        with data.mock_data(num_examples=64):
            with pytest.raises(ValueError, match=r"augmentation_kwargs=\{'padding': 4\} with "
                               r"augmentation=None: no augmentation reads them"):
                experiment.train_and_evaluate(workdir=str(tmp_path / "wd"))
    finally:
        gin.clear_config()
    assert not (tmp_path / "wd").exists()


def test_augmentation_kwargs_that_the_augmentation_refuses_stop_the_run_before_the_workdir(
        tmp_path, run_smoke):
    # Before: get_augmentation refused the keyword only after the workdir was locked and its
    # first checkpoint written.
    with pytest.raises(ValueError, match=r"Augmentation 'mnist_crop' got unexpected keyword "
                       r"argument\(s\) \['pading'\]; it accepts \['flip', 'padding'\]"):
        run_smoke(tmp_path / "wd", ["fashion_mnist.gin"], [
            "tfdp.AugmentationConfig.augmentation = 'mnist_crop'",
            "tfdp.AugmentationConfig.augmult = 1",
            "tfdp.AugmentationConfig.augmentation_kwargs = {'pading': 4}"])
    assert not (tmp_path / "wd").exists()


@pytest.mark.slow
def test_operative_config_says_which_file_binding_the_switch_left_unread(tmp_path, run_smoke):
    # gin still lists the file's momentum = 0.9 among build_optimizer's values; the file the
    # run writes says, first, that the run did not read it.
    run_smoke(tmp_path / "wd", ["fashion_mnist.gin"], [
        "TARGET_EPSILON = None", "NOISE_MULTIPLIER = 1.0",
        "tfdp.training.build_optimizer.name = 'adam'",
        "tfdp.training.build_optimizer.learning_rate = 0.001"])
    text = (tmp_path / "wd" / "operative_config.gin").read_text()
    assert text.startswith("# NOT READ by this run: A --gin_param chose the optimizer 'adam' "
                           "(tfdp.training.build_optimizer.name), so the config's "
                           "tfdp.training.build_optimizer.momentum = 0.9 is not read"), text[:400]
    run_smoke(tmp_path / "plain", ["fashion_mnist.gin"],
              ["TARGET_EPSILON = None", "NOISE_MULTIPLIER = 1.0"])
    assert "NOT READ" not in (tmp_path / "plain" / "operative_config.gin").read_text()
