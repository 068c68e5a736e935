"""Every shipped gin config: its epsilon matches the paper, and it runs 2 steps on mock data."""

import dataclasses
import os

import gin
import pytest

from tfdp import configs
from tfdp import data
from tfdp import experiment
from tfdp import gin_bindings
from tfdp import main
from tfdp import models
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
    "fashion_mnist_best.gin": 3.0,
    "cifar10_scatternet_linear.gin": 3.0,
    "cifar10_scatternet_cnn.gin": 3.0,
    "cifar10_tramer_cnn.gin": 3.0,
    # Private fine-tuning on train[2000:]: sigma calibrated to epsilon = 3.
    "fashion_mnist_finetune.gin": 3.0,
}
# De et al. 2022, Tables 15-18 (WRN-28-10 pretrained on ImageNet-32, N = 50,000, B = 16384):
# the four tables share (sigma, steps) per epsilon. They compute to 0.998, 2.003, 4.020 and
# 7.998; TARGET_EPSILON stops the eps=2 and eps=4 runs 2 and 9 steps early.
for _dataset in ("cifar10", "cifar100"):
    for _trainable in ("all", "head"):
        for _epsilon in (1, 2, 4, 8):
            PUBLISHED_EPSILON[f"{_dataset}_finetune_wrn28_10_{_trainable}_eps{_epsilon}.gin"] = _epsilon
# De et al. 2022, Table 20 (last layer of NF-ResNet-200, N = 1,271,167, B = 16384, delta = 8e-7):
# 0.499, 0.996, 1.993, 3.968, 8.000.
for _tag, _epsilon in (("0_5", 0.5), ("1", 1), ("2", 2), ("4", 4), ("8", 8)):
    PUBLISHED_EPSILON[f"imagenet_finetune_nfresnet_head_eps{_tag}.gin"] = _epsilon

# The fine-tuning configs match their table within 1%; the older configs
# were held to 1.5% (cifar10_wrn16_4_eps1.gin computes to 0.988, -1.2%).
EPSILON_TOLERANCE = {name: 0.01 for name in PUBLISHED_EPSILON if "_finetune_" in name}

# Configs that train without DP (`tfdp.train_and_evaluate.privacy = None`): no epsilon.
NOT_PRIVATE = {
    "imagenet32_pretrain_wrn28_10.gin": "De et al. 2022, App. C.3: public pretraining",
    "fashion_mnist_public_pretrain.gin": "public pretraining on train[:2000] (De et al. 2022)",
}

def _param(config, *marks):
    return pytest.param(config, marks=marks)


# Macros some configs leave for the user to set (a path only they know), and the value the
# epsilon checks use; the smoke runs replace them with a real backbone (`_required_params`).
REQUIRED_MACROS = {config: {"PRETRAINED_BACKBONE": '"unused"'}
                   for config in CONFIGS if "finetune" in config}


def _required_params(config):
    return [f"{k} = {v}" for k, v in REQUIRED_MACROS.get(config, {}).items()]


def _macro(name):
    try:
        return gin.query_parameter(f"%{name}")
    except ValueError:
        return None


def _binding(name, default=None):
    """The config's binding of setting `name` in its home (`tfdp.configs.MOVED`), or default."""
    try:
        return gin.query_parameter(configs.MOVED.get(name, f"tfdp.train_and_evaluate.{name}"))
    except ValueError:
        return default


def _plan(config):
    """The config's DPMechanism (as the trainer plans it), and the config's own NUM_STEPS."""
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
        ), _macro("NUM_STEPS")
    finally:
        gin.clear_config()


def test_every_config_has_a_published_epsilon():
    assert set(CONFIGS) == set(PUBLISHED_EPSILON) | set(NOT_PRIVATE)
    assert not set(PUBLISHED_EPSILON) & set(NOT_PRIVATE)


@pytest.mark.parametrize("config", [_param(c) for c in CONFIGS if c not in NOT_PRIVATE])
def test_config_epsilon_matches_the_paper(config):
    mechanism, num_steps = _plan(config)
    published = PUBLISHED_EPSILON[config]
    tolerance = EPSILON_TOLERANCE.get(config, 0.015)
    # The paper's (sigma, B, steps, delta), as written in the config ...
    assert mechanism.epsilon(num_steps) == pytest.approx(published, rel=tolerance)
    # ... and what the run spends: capped at the budget when the table's values exceed it.
    epsilon = mechanism.epsilon()
    assert epsilon == pytest.approx(published, rel=tolerance)
    if mechanism.target_epsilon is not None:
        assert epsilon <= mechanism.target_epsilon  # never past the budget


@pytest.mark.parametrize("config", [_param(c) for c in sorted(NOT_PRIVATE)])
def test_non_private_config_says_so_and_sets_no_privacy_value(config):
    gin.clear_config()
    try:
        main.parse_config([config], _required_params(config))
        assert gin.query_parameter("tfdp.train_and_evaluate.privacy") is None
        # A DP value in a non-private config would be ignored, or read as a guarantee.
        for field in dataclasses.fields(configs.PrivacyConfig):
            assert _binding(field.name, "unset") == "unset", field.name
        for name in ("NOISE_MULTIPLIER", "TARGET_EPSILON", "TARGET_DELTA", "L2_CLIP_NORM"):
            assert _macro(name) is None, name
    finally:
        gin.clear_config()
    header = open(main.resolve_gin_file(config)).read().split("\n\n")[0]
    assert "NOT PRIVATE" in header


@pytest.mark.parametrize("config", [_param(c) for c in CONFIGS])
def test_config_dataset_is_a_tfds_dataset(config):
    # A misspelt dataset or builder config ("imagenet_resized/32x23") fails here, not on a
    # cluster after the data was prepared.
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    gin.clear_config()
    try:
        main.parse_config([config], _required_params(config))
        dataset = gin.query_parameter("tfdp.DataConfig.dataset")
    finally:
        gin.clear_config()
    name, _, builder_config = dataset.partition("/")
    builder = tfds.builder_cls(name)
    if builder_config:
        assert builder_config in {c.name for c in builder.BUILDER_CONFIGS}, dataset


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
    # Only fashion_mnist.gin's run (the README job's config) is in the default suite; every
    # other config's 2-step run is under -m slow, to keep CI under its 10-minute budget. The
    # default suite keeps each config's epsilon against its paper
    # (test_config_epsilon_matches_the_paper) and one mechanism plan per config family
    # (tests/configs_equality_test.py). What the runs under -m slow share:
    # - the WRN rows of one table differ only in (sigma, steps, lr, epsilon), and the two
    #   tables only in DEPTH, AUGMULT, BATCH_SIZE and ACCUMULATION_STEPS, which the smoke run
    #   overrides (DEPTH = 10, width 1): both tables' files bind the same settings through
    #   _cifar10_wrn_common.gin, so their smoke runs run the same model and code path;
    # - the fine-tuning configs share two fragments (the frozen-trunk and cached-feature paths
    #   themselves are tested with the model builder);
    # - imagenet.gin also runs 2 steps end to end on a synthetic JPEG folder
    #   (tests/runbook_test.py);
    # - cifar10_tramer_cnn.gin's model is fashion_mnist.gin's; fashion_mnist_recipe.gin
    #   includes fashion_mnist_scatternet_linear.gin and only adds settings (normalize_update,
    #   accumulation, EMA) and another learning rate; the ScatterNet builders and
    #   fashion_mnist_best.gin's GN-WS head are tested in tests/models.
    if config == "fashion_mnist.gin":
        return _param(config)
    return _param(config, pytest.mark.slow)


@pytest.fixture(scope="module")
def tiny_backbone(tmp_path_factory):
    """A pretrained-backbone stand-in for PRETRAINED_BACKBONE: the Tramer CNN, saved as .keras.

    Its 10-class head is replaced by the config's; 32x32x3, as CIFAR and the shrunk ImageNet.
    What the configs bind does not depend on the backbone's layers. With a WRN-10-1 here,
    the smoke run of cifar10_finetune_wrn28_10_all_eps8.gin was the suite's slowest config
    run (27 s; 8.7 s alone with this CNN). The WRN's ghost path runs in
    cifar10_wrn16_4_eps8.gin's smoke run, and a loaded backbone's in tests/models.
    """
    path = str(tmp_path_factory.mktemp("backbone") / "tramer_cnn.keras")
    models.build_tramer_cnn(10, input_shape=(32, 32, 3)).save(path)
    return path


@pytest.mark.parametrize("config", [_smoke_param(c) for c in CONFIGS])
def test_config_runs_two_steps_on_mock_data(config, tmp_path, tensorflow_warnings, request):
    gin.clear_config()
    main.parse_config([config], _required_params(config))
    present = {k: v for k, v in OPTIONAL_MACROS.items() if _macro(k) is not None}
    private = config not in NOT_PRIVATE
    train_split = _binding("train_split", "train")
    gin.clear_config()
    params = SMOKE_OVERRIDES + [f"{k} = {v}" for k, v in present.items()]
    if config.startswith("fashion_mnist") and "PRETRAINED_BACKBONE" in REQUIRED_MACROS.get(
            config, {}):
        # A backbone of the Fashion-MNIST CNN with random weights, as a .keras file.
        models.build_tramer_cnn(10).save(str(tmp_path / "backbone.keras"))
        params.append(f'PRETRAINED_BACKBONE = "{tmp_path / "backbone.keras"}"')
    if train_split != "train":
        params.append("tfdp.DataConfig.train_split = 'train'")  # mock: one split
    if config.startswith("cifar10_wrn"):
        params += ["DEPTH = 10", "tfdp.models.build_wide_resnet.width = 1"]  # same blocks, fewer
    if config in NOT_PRIVATE and "wrn" in config:  # (a binding of an uncalled builder
        params += ["tfdp.models.build_wide_resnet.depth = 10",  # is refused)
                   "tfdp.models.build_wide_resnet.width = 1"]
    if config in ("imagenet.gin", "imagenet_tan.gin"):
        params.append("tfdp.models.build_nf_resnet.width = 1")
    if "_finetune_" in config:
        params.append(f"PRETRAINED_BACKBONE = '{request.getfixturevalue('tiny_backbone')}'")
    main.parse_config([config, "smoke.gin"], params)
    try:
        with data.mock_data(num_examples=MOCK_EXAMPLES):
            report = experiment.train_and_evaluate(workdir=str(tmp_path / "workdir"))
        bound, operative = gin.config_str(), gin.operative_config_str()
    finally:
        gin.clear_config()
    assert report["steps"] == 2
    # Every binding the parse accepted (main._check_bindings_are_called) was
    # used by a configurable the run called, as gin's operative config records.
    unused = set(gin_bindings.parse(bound)[1]) - set(gin_bindings.parse(operative)[1])
    assert not unused, unused
    assert os.path.isdir(tmp_path / "workdir" / "export")
    # A non-private run writes no privacy report.
    assert os.path.exists(tmp_path / "workdir" / "privacy_report.json") == private
    # Ghost clipping: no conv kernel's per-example gradients fall back to a sequential loop.
    assert not any("while_loop" in m for m in tensorflow_warnings), tensorflow_warnings


@pytest.mark.parametrize("config", [_param("cifar10_finetune_wrn28_10_head_eps8.gin")])
def test_finetune_config_without_a_backbone_is_refused_before_training(config, tmp_path):
    # PRETRAINED_BACKBONE is left unset in the configs, for the user to set.
    try:
        with pytest.raises(main.ConfigError, match="--gin_param='PRETRAINED_BACKBONE="):
            main.parse_config([config, "smoke.gin"], SMOKE_OVERRIDES + ["AUGMULT = 2"])
    finally:
        gin.clear_config()
