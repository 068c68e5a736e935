"""Every shipped gin config: its epsilon matches the paper, and it runs 2 steps on mock data."""

import os

import gin
import pytest

from tfdp import data
from tfdp import experiment
from tfdp import main
from tfdp import accounting

# Configs whose file name starts with "_" are fragments for `include`; smoke.gin is an overlay.
CONFIGS = sorted(
    name for name in main.shipped_gin_configs() if not name.startswith("_") and name != "smoke.gin"
)

# The epsilon each config must reach (within 1.5%), from the paper it reproduces.
PUBLISHED_EPSILON = {
    # De et al. 2022, Table 12 (WRN-16-4, N = 50,000, B = 4096).
    "cifar10_wrn16_4_eps1.gin": 1.0,  # computes to 0.988
    "cifar10_wrn16_4_eps2.gin": 2.0,
    "cifar10_wrn16_4_eps3.gin": 3.0,
    "cifar10_wrn16_4_eps4.gin": 4.0,
    "cifar10_wrn16_4_eps6.gin": 6.0,
    # The paper's eps=8 row (sigma = 3, 2468 steps) is inconsistent with its own eps=6 row
    # (sigma = 3, 1843 steps): it computes to 7.05, well below 8. We assert what it is.
    "cifar10_wrn16_4_eps8.gin": 7.046,
    # De et al. 2022, Table 13 (WRN-40-4, B = 16384). The eps=6 row computes to 6.02.
    "cifar10_wrn40_4_eps1.gin": 1.0,
    "cifar10_wrn40_4_eps2.gin": 2.0,
    "cifar10_wrn40_4_eps3.gin": 3.0,
    "cifar10_wrn40_4_eps4.gin": 4.0,
    "cifar10_wrn40_4_eps6.gin": 6.0,
    "cifar10_wrn40_4_eps8.gin": 8.0,
    # De et al. 2022, Table 14; TAN Table 4.
    "imagenet.gin": 8.0,
    "imagenet_tan.gin": 8.0,
    # Tramer & Boneh 2021 and the Fashion-MNIST recipe: sigma is calibrated to epsilon = 3.
    "fashion_mnist.gin": 3.0,
    "fashion_mnist_scatternet_linear.gin": 3.0,
    "fashion_mnist_scatternet_cnn.gin": 3.0,
    "fashion_mnist_recipe.gin": 3.0,
    "fashion_mnist_recipe_cnn.gin": 3.0,
    "cifar10_scatternet_linear.gin": 3.0,
    "cifar10_scatternet_cnn.gin": 3.0,
    "cifar10_tramer_cnn.gin": 3.0,
    # Private fine-tuning on train[2000:] (issue 20): sigma calibrated to epsilon = 3.
    "fashion_mnist_finetune.gin": 3.0,
}

# Macros some configs leave for the user to set (a path only they know), and the value the
# epsilon checks use; the smoke runs replace them with a real backbone (`_required_params`).
REQUIRED_MACROS = {"fashion_mnist_finetune.gin": {"PRETRAINED_BACKBONE": '"unused"'}}


def _required_params(config):
    return [f"{k} = {v}" for k, v in REQUIRED_MACROS.get(config, {}).items()]


def _macro(name):
    try:
        return gin.query_parameter(f"%{name}")
    except ValueError:
        return None


def _binding(name, default=None):
    try:
        return gin.query_parameter(f"tfdp.train_and_evaluate.{name}")
    except ValueError:
        return default


def _plan(config):
    gin.clear_config()
    try:
        main.parse_config([config], _required_params(config))
        return accounting.plan_mechanism(
            num_examples=_macro("NUM_EXAMPLES"), batch_size=_macro("BATCH_SIZE"),
            num_steps=_macro("NUM_STEPS"), l2_clip_norm=_macro("L2_CLIP_NORM"),
            target_delta=_macro("TARGET_DELTA"), noise_multiplier=_macro("NOISE_MULTIPLIER"),
            target_epsilon=_macro("TARGET_EPSILON"),
            accountant=_binding("accountant", "rdp"), sampling=_binding("sampling", "poisson"),
            normalize_update=_binding("normalize_update", False),
            num_microbatches=_binding("num_microbatches"),
            data_normalization=_binding("data_normalization"),
        )
    finally:
        gin.clear_config()


def test_every_config_has_a_published_epsilon():
    assert set(CONFIGS) == set(PUBLISHED_EPSILON)


@pytest.mark.parametrize("config", CONFIGS)
def test_config_epsilon_matches_the_paper(config):
    mechanism = _plan(config)
    epsilon = mechanism.epsilon()
    assert epsilon == pytest.approx(PUBLISHED_EPSILON[config], rel=0.015)
    if mechanism.target_epsilon is not None:
        assert epsilon <= mechanism.target_epsilon  # never past the budget


@pytest.mark.parametrize("config", CONFIGS)
def test_config_header_names_source_command_and_expected_result(config):
    path = main.resolve_gin_file(config)
    header = open(path).read().split("\n\n")[0]
    assert "Source:" in header and "Expected:" in header
    assert f"--gin_file={config}" in header


MOCK_EXAMPLES = 32
# Shrink what smoke.gin leaves alone so every config runs in seconds on 2 CPU cores:
# small batches and images, fewer views and chunks. The code path is the config's own.
SMOKE_OVERRIDES = [
    f"NUM_EXAMPLES = {MOCK_EXAMPLES}",
    "BATCH_SIZE = 4",
]
OPTIONAL_MACROS = {"AUGMULT": 2, "ACCUMULATION_STEPS": 2, "IMAGE_SIZE": 32}


def _smoke_param(config):
    # The WRN rows of one table differ only in (sigma, steps, lr, epsilon), all checked by
    # test_config_epsilon_matches_the_paper; one row per table runs in the default suite
    # and the others under `-m slow`, to keep CI under its 10-minute budget.
    if config.startswith("cifar10_wrn") and not config.endswith("_eps8.gin"):
        return pytest.param(config, marks=pytest.mark.slow)
    # The ImageNet configs run 2 steps on real local files in the default suite
    # (tests/imagenet_local_test.py); their mock-data run is slow-only.
    if config.startswith("imagenet"):
        return pytest.param(config, marks=pytest.mark.slow)
    return config


@pytest.mark.parametrize("config", [_smoke_param(c) for c in CONFIGS])
def test_config_runs_two_steps_on_mock_data(config, tmp_path, tensorflow_warnings):
    gin.clear_config()
    main.parse_config([config], _required_params(config))
    present = {k: v for k, v in OPTIONAL_MACROS.items() if _macro(k) is not None}
    train_split = _binding("train_split", "train")
    gin.clear_config()
    params = SMOKE_OVERRIDES + [f"{k} = {v}" for k, v in present.items()]
    if "PRETRAINED_BACKBONE" in REQUIRED_MACROS.get(config, {}):
        # A backbone of the Fashion-MNIST CNN with random weights, as a .keras file.
        from tfdp import models  # pylint: disable=g-import-not-at-top

        models.build_tramer_cnn(10).save(str(tmp_path / "backbone.keras"))
        params.append(f'PRETRAINED_BACKBONE = "{tmp_path / "backbone.keras"}"')
    if train_split != "train":
        params.append("tfdp.train_and_evaluate.train_split = 'train'")  # mock: one split
    if config.startswith("cifar10_wrn"):
        params += ["DEPTH = 10", "tfdp.models.build_wide_resnet.width = 1"]  # same blocks, fewer
    if config.startswith("imagenet"):
        params.append("tfdp.models.build_nf_resnet.width = 1")
    main.parse_config([config, "smoke.gin"], params)
    try:
        with data.mock_data(num_examples=MOCK_EXAMPLES):
            report = experiment.train_and_evaluate(workdir=str(tmp_path / "workdir"))
    finally:
        gin.clear_config()
    assert report["steps"] == 2
    assert os.path.isdir(tmp_path / "workdir" / "export")
    # Ghost clipping: no conv kernel's per-example gradients fall back to a sequential loop.
    assert not any("while_loop" in m for m in tensorflow_warnings), tensorflow_warnings
