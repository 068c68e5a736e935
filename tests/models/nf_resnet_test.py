"""Tests for build_nf_resnet and NFResBlock (Brock et al. 2021a; De et al. 2022)."""

import math

import keras
import numpy as np
import pytest

from tfdp.models.nf_res_block import RELU_GAIN, NFResBlock
from tfdp.models.nf_resnet import build_nf_resnet
from tfdp.models.scaled_ws_conv2d import ScaledWSConv2D
from tfdp.models.validation import validate_dp_model


def _num_trainable(model):
    return sum(int(np.prod(w.shape)) for w in model.trainable_weights)


def test_relu_gain_gives_unit_variance():
    # gamma = sqrt(2 / (1 - 1/pi)) (Brock et al. 2021a): Var(gamma * relu(z)) = 1.
    z = np.random.default_rng(0).normal(size=1_000_000)
    assert RELU_GAIN == pytest.approx(1.712859, abs=1e-6)
    assert np.var(RELU_GAIN * np.maximum(z, 0.0)) == pytest.approx(1.0, abs=0.01)


@pytest.mark.slow
def test_nf_resnet50_parameter_count():
    # 25,556,984 = 25,557,032 (BatchNorm ResNet-50, the "25.5M" of the
    # literature) - 64 (the stem conv has a gain but no bias, where ResNet-50's
    # stem BatchNorm has scale and offset) + 16 (one scalar skip gain per block).
    # Every other conv's gain + bias matches the BatchNorm scale + offset it
    # replaces.
    model = build_nf_resnet(50, 1000)
    assert _num_trainable(model) == 25_556_984
    assert model.count_params() == 25_556_984
    blocks = [l for l in model.layers if isinstance(l, NFResBlock)]
    assert len(blocks) == 16
    assert all(float(b.skip_gain.numpy()) == 1.0 for b in blocks)  # De et al. C.1
    assert not any(
        isinstance(l, (keras.layers.BatchNormalization, keras.layers.GroupNormalization))
        for l in model.layers
    )


@pytest.fixture(scope="module")
def small_nf_resnet():
    """NF-ResNet-50 at width 1 (64-512 channels) on 16x16 images, 5 classes."""
    return build_nf_resnet(50, 5, input_shape=(16, 16, 3), width=1, alpha=0.2)


@pytest.mark.slow
def test_beta_follows_the_expected_variance_schedule(small_nf_resnet):
    alpha = 0.2
    model = small_nf_resnet
    betas = {l.name: l.beta for l in model.layers if isinstance(l, NFResBlock)}
    # Variance starts at 1, grows by alpha^2 per block, and is reset to
    # 1 + alpha^2 after each transition (first) block of a stage.
    assert betas["stage1_block0"] == pytest.approx(1.0)
    assert betas["stage1_block1"] == pytest.approx(math.sqrt(1 + alpha**2))
    assert betas["stage1_block2"] == pytest.approx(math.sqrt(1 + 2 * alpha**2))
    assert betas["stage2_block0"] == pytest.approx(math.sqrt(1 + 3 * alpha**2))
    assert betas["stage2_block1"] == pytest.approx(math.sqrt(1 + alpha**2))
    assert betas["stage3_block5"] == pytest.approx(math.sqrt(1 + 5 * alpha**2))
    assert betas["stage4_block0"] == pytest.approx(math.sqrt(1 + 6 * alpha**2))


def test_block_output_variance_at_init_matches_the_design():
    rng = np.random.default_rng(1)
    alpha, beta = 0.2, math.sqrt(1 + 2 * 0.2**2)
    block = NFResBlock(256, beta=beta, alpha=alpha)
    x = (beta * rng.normal(size=(2, 32, 32, 256))).astype(np.float32)
    out = block(x).numpy()
    # Non-transition block: Var(out) = beta^2 + alpha^2 = 1.08 + 0.04 = 1.12,
    # and the residual branch alone has variance alpha^2 (zero padding at the
    # 3x3 conv's borders loses a few percent of it).
    assert np.var(out) == pytest.approx(beta**2 + alpha**2, rel=0.02)
    assert np.var(out - x) / alpha**2 == pytest.approx(1.0, abs=0.12)
    assert abs(np.mean(out - x)) < 0.02

    transition = NFResBlock(512, strides=2, beta=beta, alpha=alpha)
    out = transition(x).numpy()
    assert out.shape == (2, 16, 16, 512)
    # Transition block: the shortcut conv re-normalizes to variance 1, so
    # Var(out) = 1 + alpha^2 = 1.04.
    assert np.var(out) == pytest.approx(1 + alpha**2, rel=0.03)


def test_skip_gain_scales_the_residual_branch():
    x = np.random.default_rng(2).normal(size=(1, 8, 8, 16)).astype(np.float32)
    block = NFResBlock(16, skipinit_gain=0.0)
    np.testing.assert_allclose(block(x).numpy(), x)  # SkipInit at 0: identity
    block.skip_gain.assign(1.0)
    assert not np.allclose(block(x).numpy(), x)


def test_block_config_and_saving_round_trip(tmp_path):
    block = NFResBlock(32, strides=2, beta=1.1, alpha=0.3, skipinit_gain=0.5, name="blk")
    clone = NFResBlock.from_config(block.get_config())
    assert clone.get_config() == block.get_config()
    inputs = keras.Input((8, 8, 16))
    model = keras.Model(inputs, block(inputs))
    assert isinstance(block.conv_shortcut, ScaledWSConv2D)
    block.skip_gain.assign(0.7)
    block.conv1.gain.assign(np.linspace(0.5, 2.0, 8))
    path = str(tmp_path / "block.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    x = np.random.default_rng(3).normal(size=(1, 8, 8, 16)).astype(np.float32)
    np.testing.assert_allclose(loaded(x).numpy(), model(x).numpy(), atol=1e-5)


def test_forward_on_a_batch_of_two_small_images(small_nf_resnet):
    model = small_nf_resnet
    images = np.random.default_rng(4).uniform(0, 255, (2, 16, 16, 3)).astype(np.float32)
    logits = model(images)
    assert logits.shape == (2, 5) and np.all(np.isfinite(logits.numpy()))
    validate_dp_model(model, check_inputs=images)


@pytest.mark.slow
def test_per_example_gradients_of_nf_blocks_under_vectorized_map(check_per_example_grads):
    # The full NF-ResNet-50 takes ~30 s here; two blocks (one transition) cover
    # every layer type it uses.
    inputs = keras.Input((8, 8, 3))
    x = ScaledWSConv2D(16, 3, use_bias=False)(inputs)
    x = NFResBlock(16)(x)
    x = NFResBlock(32, strides=2, beta=math.sqrt(1.04))(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inputs, keras.layers.Dense(3)(x))
    images = np.random.default_rng(5).normal(size=(2, 8, 8, 3)).astype(np.float32)
    check_per_example_grads(model, images, np.array([0, 2]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(depth=34), "depth=34; use one of \\[50, 101, 152, 200\\]"),
        (dict(alpha=0.0), "alpha=0.0 must be > 0"),
        (dict(width=0), "width=0"),
    ],
)
def test_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_nf_resnet(**kwargs)
