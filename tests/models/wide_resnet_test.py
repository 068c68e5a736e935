"""Tests for build_wide_resnet (De et al. 2022, App. C.1)."""

import gin
import keras
import numpy as np
import pytest

from tfdp.models.validation import validate_dp_model
from tfdp.models.wide_resnet import build_wide_resnet
from tfdp.models.ws_conv2d import WSConv2D


def _num_trainable(model):
    return sum(int(np.prod(w.shape)) for w in model.trainable_weights)


# Zagoruyko & Komodakis 2016 report 2.7M (WRN-16-4) and 8.9M (WRN-40-4). The
# exact counts are those of their reference code (pytorch/resnet.py: bias-free
# convs, 2 BatchNorm parameters per channel, 1x1 shortcut conv only when the
# channel count changes, dense layer with bias); GroupNorm has the same scale
# and offset per channel as BatchNorm. WRN-16-4 by hand:
#   stem 3*3*3*16 = 432
#   stage 1 (16->64): 32 + 9216 + 128 + 36864 + 1024 | 128 + 36864 + 128 + 36864
#   stage 2 (64->128): 128 + 73728 + 256 + 147456 + 8192 | 256 + 147456 + 256 + 147456
#   stage 3 (128->256): 256 + 294912 + 512 + 589824 + 32768 | 512 + 589824 + 512 + 589824
#   final GN 512, dense 256*10 + 10 = 2570            -> 2,748,890
@pytest.mark.parametrize(
    "depth, width, expected", [(16, 4, 2_748_890), (40, 4, 8_949_210), (10, 1, 77_850)]
)
def test_parameter_count_matches_the_published_wrn(depth, width, expected):
    model = build_wide_resnet(depth, width, 10)
    assert _num_trainable(model) == expected
    assert model.count_params() == expected  # no non-trainable state at all


def test_structure_groupnorm_and_ws_convs_without_bias():
    model = build_wide_resnet(16, 4, 10)
    convs = [layer for layer in model.layers if isinstance(layer, keras.layers.Conv2D)]
    # 1 stem + 3 stages * 2 blocks * 2 convs + 3 shortcut convs.
    assert len(convs) == 16
    assert all(isinstance(c, WSConv2D) and not c.use_bias for c in convs)
    norms = [l for l in model.layers if isinstance(l, keras.layers.GroupNormalization)]
    assert len(norms) == 13  # 2 per block + final
    assert {n.groups for n in norms} == {16}
    assert model.layers[1].name == "rescale_pixels"
    validate_dp_model(model)


@pytest.mark.parametrize(
    "norm_order, first, second",
    [
        ("conv_gn_relu", keras.layers.GroupNormalization, keras.layers.ReLU),
        ("conv_relu_gn", keras.layers.ReLU, keras.layers.GroupNormalization),
    ],
)
def test_norm_order_sets_the_layer_order_after_each_conv(norm_order, first, second):
    model = build_wide_resnet(10, 1, 10, input_shape=(16, 16, 3), norm_order=norm_order)
    for index, layer in enumerate(model.layers):
        if isinstance(layer, WSConv2D) and layer.name.endswith("_a_conv"):
            # The conv inside a block feeds norm_act, then the block's 2nd conv.
            following = model.layers[index + 1 : index + 3]
            assert isinstance(following[0], first), [l.name for l in following]
            assert isinstance(following[1], second), [l.name for l in following]


def test_forward_on_a_batch_of_two():
    model = build_wide_resnet(10, 1, 7, input_shape=(16, 16, 3))
    images = np.random.default_rng(0).uniform(0, 255, (2, 16, 16, 3)).astype(np.float32)
    logits = model(images)
    assert logits.shape == (2, 7) and logits.dtype == "float32"
    assert np.all(np.isfinite(logits.numpy()))
    # Per-example processing: the batch gives the same logits as each image alone.
    validate_dp_model(model, check_inputs=images)


@pytest.mark.slow
def test_per_example_gradients_under_vectorized_map(check_per_example_grads):
    model = build_wide_resnet(10, 1, 3, input_shape=(8, 8, 3), norm_order="conv_relu_gn")
    images = np.random.default_rng(1).uniform(0, 255, (2, 8, 8, 3)).astype(np.float32)
    check_per_example_grads(model, images, np.array([0, 2]))


def test_builder_is_registered_with_gin():
    gin.parse_config("tfdp.models.build_wide_resnet.norm_order = 'conv_relu_gn'")
    try:
        model = gin.get_configurable("tfdp.models.build_wide_resnet")(
            10, 1, 2, input_shape=(8, 8, 3)
        )
    finally:
        gin.clear_config()
    index = [l.name for l in model.layers].index("stage1_block0_a_conv")
    assert isinstance(model.layers[index + 1], keras.layers.ReLU)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(depth=15, width=4, num_classes=10), "depth=15 must be 6n \\+ 4"),
        (dict(depth=16, width=0, num_classes=10), "width=0"),
        (dict(depth=16, width=4, num_classes=10, norm_order="gn_conv"), "norm_order='gn_conv'"),
        (dict(depth=16, width=4, num_classes=10, groups=5), "groups=5 must divide 16"),
    ],
)
def test_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_wide_resnet(**kwargs)
