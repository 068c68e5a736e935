"""Wide-ResNet WRN-d-k for DP-SGD (De et al. 2022, App. C.1)."""

import gin
import keras

from tfdp.models.preprocessing import rescale_pixels_layer
from tfdp.models.ws_conv2d import WSConv2D, fan_in_gaussian_initializer

NORM_ORDERS = ("conv_gn_relu", "conv_relu_gn")

# GroupNorm epsilon of the reference implementations (haiku / jax_privacy and
# PyTorch both use 1e-5; Keras' default is 1e-3).
_GROUP_NORM_EPSILON = 1e-5


@gin.configurable(module="tfdp.models")
def build_wide_resnet(
    depth,
    width,
    num_classes,
    *,
    input_shape=(32, 32, 3),
    groups=16,
    norm_order="conv_gn_relu",
    name=None,
):
    """Builds a Wide-ResNet WRN-`depth`-`width` with GroupNorm and WS convs.

    The structure is Zagoruyko & Komodakis 2016's pre-activation WRN, as in
    their code (szagoruyko/wide-residual-networks, pytorch/resnet.py):
    a 3x3 convolution with 16 channels, three stages of (depth - 4) / 6 basic
    blocks with 16k, 32k, 64k channels (k = width; strides 1, 2, 2), a final
    norm + ReLU, global average pooling and a dense layer. A basic block is

        o = norm_act(x); y = conv3x3(o, stride); y = norm_act(y); z = conv3x3(y)
        out = z + (conv1x1(o, stride) if channels or resolution change else x)

    De et al. 2022 (App. C.1) changes, all applied here:
      * every BatchNorm is replaced by `keras.layers.GroupNormalization` with
        `groups` groups (16 in the paper), which normalizes each example on its
        own (BatchNorm mixes examples and breaks per-example clipping);
      * every convolution is a `WSConv2D` (weight standardization at every
        step, differentiable), without bias (a GroupNorm with an offset
        follows each one);
      * all weights are Gaussian with variance 1 / fan-in;
      * no dropout.
    `norm_order` chooses the order around each convolution:
    "conv_gn_relu" (norm_act = GroupNorm then ReLU, the standard order) or
    "conv_relu_gn" (norm_act = ReLU then GroupNorm), which Sander et al. 2023
    (TAN, Sec. 4.4, Fig. 5) find markedly better with DP-SGD (and which
    jax_privacy's WideResNet, the code of De et al., uses).

    GroupNorm has the same trainable parameters as BatchNorm (a scale and an
    offset per channel), so the parameter count equals the original WRN's:
    2,748,890 for WRN-16-4 and 8,949,210 for WRN-40-4 at 10 classes
    (Zagoruyko & Komodakis 2016 report 2.7M and 8.9M).

    Args:
      depth: number of layers d; d = 6n + 4 with n >= 1 (16 or 40 in the paper).
      width: widening factor k >= 1 (4 in the paper).
      num_classes: number of output logits.
      input_shape: (height, width, channels) of the images.
      groups: GroupNorm groups; must divide 16 * width and 16.
      norm_order: "conv_gn_relu" or "conv_relu_gn".
      name: model name (default "wrn_{depth}_{width}").

    Returns:
      A `keras.Model`: float32 images [batch, height, width, channels] with
      pixel values in [0, 255] -> float32 logits [batch, num_classes]. Its first
      layer rescales pixels to [-1, 1] with fixed constants.

    Raises:
      ValueError: if depth is not 6n + 4, width < 1, num_classes < 1, groups
        does not divide the channel counts, or norm_order is unknown.

    Reference:
      Zagoruyko & Komodakis 2016, "Wide Residual Networks"; De et al. 2022,
      App. C.1; Sander et al. 2023, Sec. 4.4.
    """
    _check_arguments(depth, width, num_classes, groups, norm_order)
    blocks_per_stage = (depth - 4) // 6

    inputs = keras.Input(shape=tuple(input_shape), name="images")
    x = rescale_pixels_layer()(inputs)
    x = _conv(16, 3, 1, "stem")(x)
    in_channels = 16
    for stage, (filters, stage_stride) in enumerate(
        zip((16 * width, 32 * width, 64 * width), (1, 2, 2)), start=1
    ):
        for block in range(blocks_per_stage):
            x = _basic_block(
                x,
                in_channels,
                filters,
                stage_stride if block == 0 else 1,
                f"stage{stage}_block{block}",
                groups=groups,
                norm_order=norm_order,
            )
            in_channels = filters
    x = norm_act(x, "final", groups, norm_order)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    logits = keras.layers.Dense(
        num_classes, kernel_initializer=fan_in_gaussian_initializer(), name="logits"
    )(x)
    return keras.Model(inputs, logits, name=name or f"wrn_{depth}_{width}")


def _check_arguments(depth, width, num_classes, groups, norm_order):
    """Raises the ValueError that `build_wide_resnet` documents for an invalid argument."""
    if not isinstance(depth, int) or depth < 10 or (depth - 4) % 6 != 0:
        raise ValueError(
            f"build_wide_resnet: depth={depth!r} must be 6n + 4 with n >= 1 "
            "(e.g. 10, 16, 28, 40)."
        )
    if not isinstance(width, int) or width < 1:
        raise ValueError(f"build_wide_resnet: width={width!r} must be an integer >= 1.")
    if num_classes < 1:
        raise ValueError(f"build_wide_resnet: num_classes={num_classes!r} must be >= 1.")
    if norm_order not in NORM_ORDERS:
        raise ValueError(
            f"build_wide_resnet: norm_order={norm_order!r}; use one of {NORM_ORDERS}."
        )
    if groups < 1 or 16 % groups != 0:
        raise ValueError(
            f"build_wide_resnet: groups={groups!r} must divide 16 (the stem's channel "
            "count) and so every stage's channel count; De et al. use 16."
        )


def norm_act(x, prefix, groups, norm_order):
    """GroupNorm and ReLU (layers `{prefix}_gn`, `{prefix}_relu`) in `norm_order`'s order."""
    norm = keras.layers.GroupNormalization(
        groups=groups, epsilon=_GROUP_NORM_EPSILON, name=f"{prefix}_gn"
    )
    relu = keras.layers.ReLU(name=f"{prefix}_relu")
    if norm_order == "conv_gn_relu":
        return relu(norm(x))
    return norm(relu(x))


def _conv(filters, kernel_size, strides, prefix):
    """A bias-free, "same"-padded `WSConv2D` named `{prefix}_conv`."""
    return WSConv2D(
        filters, kernel_size, strides=strides, padding="same", name=f"{prefix}_conv"
    )


def _basic_block(x, in_channels, filters, strides, prefix, *, groups, norm_order):
    """One pre-activation basic block (layers named `{prefix}_...`); returns its output.

    o = norm_act(x); out = conv3x3(norm_act(conv3x3(o, strides))) + shortcut, the
    shortcut being conv1x1(o, strides) if channels or resolution change, else x.
    """
    o = norm_act(x, f"{prefix}_pre", groups, norm_order)
    y = _conv(filters, 3, strides, f"{prefix}_a")(o)
    y = norm_act(y, f"{prefix}_mid", groups, norm_order)
    y = _conv(filters, 3, 1, f"{prefix}_b")(y)
    if in_channels != filters or strides != 1:
        shortcut = _conv(filters, 1, strides, f"{prefix}_shortcut")(o)
    else:
        shortcut = x
    return keras.layers.Add(name=f"{prefix}_add")([shortcut, y])
