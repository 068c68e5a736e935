"""Tests for the ScatterNet heads (Tramer & Boneh 2021, App. C.2-C.3)."""

import keras
import numpy as np
import pytest

from tfdp.models.scatternet_models import (
    build_scatternet_cnn,
    build_scatternet_gnws_cnn,
    build_scatternet_linear,
)


def _num_trainable(model):
    return sum(int(np.prod(w.shape)) for w in model.trainable_weights)


# Linear: h*w*K*10 + 10 (Table 5; Table 4: 40K / 155K). GroupNorm without
# affine parameters (authors' nn.GroupNorm(..., affine=False)) adds nothing.
@pytest.mark.parametrize(
    "shape, groups, expected",
    [((7, 7, 81), None, 39_700), ((7, 7, 81), 27, 39_700), ((8, 8, 243), 81, 155_530)],
)
def test_linear_head_parameter_count(shape, groups, expected):
    assert _num_trainable(build_scatternet_linear(shape, 10, groups=groups)) == expected


# CNN heads, counts of the authors' code (models.py):
#  mnist: 81*16*9+16 = 11,680; 16*32*9+32 = 4,640; 512*32+32 = 16,416;
#         32*10+10 = 330                                    -> 33,066 (Table 4: 33K)
#  cifar10: 243*64*9+64 = 140,032; 64*64*9+64 = 36,928; 1024*10+10 = 10,250
#                                                           -> 187,210 (Table 4: 187K)
#  cifar10_small: 35,008 + 2,320 + 4,640 + 9,248 + 5,130    -> 56,346
@pytest.mark.parametrize(
    "shape, architecture, expected",
    [
        ((7, 7, 81), None, 33_066),
        ((8, 8, 243), None, 187_210),
        ((8, 8, 243), "cifar10_small", 56_346),
    ],
)
def test_cnn_head_parameter_count(shape, architecture, expected):
    model = build_scatternet_cnn(shape, 10, architecture=architecture, groups=27)
    assert _num_trainable(model) == expected


# GN-WS head, width 128 on 7x7x81: 81*128*9 + 128*128*9 kernel weights (no bias: a
# GroupNorm with an offset follows), 2 GroupNorms of 128 scales and 128 offsets, and
# 4*4*128*10 + 10 dense (stride 2 takes 7x7 to 4x4) = 93,312 + 147,456 + 512 + 20,490.
@pytest.mark.parametrize("width, expected", [(128, 261_770), (32, 23_328 + 9_216 + 128 + 5_130)])
def test_gnws_head_parameter_count(width, expected):
    assert _num_trainable(build_scatternet_gnws_cnn((7, 7, 81), 10, width=width)) == expected


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(width=100), "width=100 must be a positive multiple of norm_groups=16"),
        (dict(width=0), "width=0"),
        (dict(norm_groups=0), "norm_groups=0"),
        (dict(norm_order="gn_conv"), "norm_order='gn_conv'"),
        (dict(groups=10), "groups=10 must divide the 81"),
    ],
)
def test_gnws_head_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_scatternet_gnws_cnn((7, 7, 81), 10, **kwargs)


def test_gnws_head_standardizes_its_kernels_and_orders_relu_before_group_norm():
    model = build_scatternet_gnws_cnn((7, 7, 81), 10, width=32)
    names = [layer.name for layer in model.layers]
    assert names.index("conv0_relu") < names.index("conv0_gn") < names.index("conv1")
    # Scaling a kernel does not change the function (weight standardization).
    features = np.random.default_rng(2).normal(size=(3, 7, 7, 81)).astype(np.float32)
    before = model(features).numpy()
    kernel = model.get_layer("conv1").kernel
    kernel.assign(kernel * 7.0)
    np.testing.assert_allclose(model(features).numpy(), before, rtol=1e-4, atol=1e-5)


def test_group_norm_normalizes_each_example_without_affine_parameters():
    model = build_scatternet_linear((2, 2, 4), 3, groups=2)
    norm = model.get_layer("feature_group_norm")
    assert not norm.weights
    x = np.random.default_rng(0).normal(5.0, 3.0, (1, 2, 2, 4)).astype(np.float32)
    out = norm(x).numpy()
    for group in (slice(0, 2), slice(2, 4)):  # channels {0,1} and {2,3}
        np.testing.assert_allclose(out[..., group].mean(), 0.0, atol=1e-5)
        np.testing.assert_allclose(out[..., group].std(), 1.0, atol=1e-3)


def test_data_normalization_uses_the_given_statistics():
    mean = np.array([1.0, -2.0, 0.0], np.float32)
    variance = np.array([4.0, 1.0, 0.25], np.float32)
    model = build_scatternet_linear((1, 1, 3), 2, feature_mean=mean, feature_variance=variance)
    x = np.array([[[[3.0, -2.0, 1.0]]]], np.float32)
    # (x - mean) / sqrt(variance) = (2/2, 0/1, 1/0.5) = (1, 0, 2).
    out = model.get_layer("feature_data_norm")(x).numpy()
    np.testing.assert_allclose(out, [[[[1.0, 0.0, 2.0]]]])
    assert _num_trainable(model) == 3 * 2 + 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(groups=27, feature_mean=np.zeros(81), feature_variance=np.ones(81)), "not both"),
        (dict(feature_mean=np.zeros(81)), "go together"),
        (dict(groups=10), "groups=10 must divide the 81"),
        (dict(feature_mean=np.zeros(80), feature_variance=np.ones(80)), "shape \\(81,\\)"),
        (dict(feature_mean=np.zeros(81), feature_variance=np.zeros(81)), "must be > 0"),
    ],
)
def test_normalization_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_scatternet_linear((7, 7, 81), 10, **kwargs)


def test_cnn_architecture_errors():
    with pytest.raises(ValueError, match="cannot infer the architecture"):
        build_scatternet_cnn((6, 6, 81), 10)
    with pytest.raises(ValueError, match="architecture='resnet'"):
        build_scatternet_cnn((8, 8, 243), 10, architecture="resnet")


@pytest.mark.slow
def test_heads_forward_and_per_example_gradients(check_per_example_grads):
    features = np.random.default_rng(1).normal(size=(2, 7, 7, 81)).astype(np.float32)
    for model in (
        build_scatternet_linear((7, 7, 81), 10, groups=27),
        build_scatternet_cnn((7, 7, 81), 10, groups=27),
        build_scatternet_gnws_cnn((7, 7, 81), 10, width=32),
    ):
        logits = model(features)
        assert logits.shape == (2, 10) and logits.dtype == "float32"
        check_per_example_grads(model, features, np.array([2, 9]))
    assert isinstance(model, keras.Model)
