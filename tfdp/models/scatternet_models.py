"""ScatterNet classifiers of Tramer & Boneh 2021 (App. C.1-C.3).

The ScatterNet is fixed, so the trainer computes the features once
(`compute_scatternet_features`), caches them, and trains a HEAD on them
(`build_scatternet_linear`, `build_scatternet_cnn`). For export,
`build_scatternet_classifier` composes the ScatterNet and a trained head into
one model that takes images.

Feature normalization (Tramer & Boneh 2021, Sec. 2.2, App. C.3), at most one:
  * GroupNorm (`groups`): each example's channels are split into groups and
    normalized on their own, without affine parameters (the authors'
    `nn.GroupNorm(num_groups, K, affine=False)`); free in privacy terms.
  * Data normalization (`feature_mean`, `feature_variance`): fixed per-channel
    statistics released with DP by
    `tfdp.dp.data_normalization.private_channel_mean_and_var` (App. B); its
    privacy cost must be added to the run's accounting.

Trainable parameter counts follow the authors' code (ftramer/Handcrafted-DP,
models.py), which Tables 4-5 report: GroupNorm without affine parameters and
the data-normalization statistics add none.
"""

import gin
import keras
import numpy as np
import tensorflow as tf

from tfdp.models.preprocessing import scatternet_input_layer
from tfdp.models.scatter_net import ScatterNet
from tfdp.models.tramer_cifar_cnn import conv_tanh_stack, torch_default_initializer
from tfdp.models.wide_resnet import NORM_ORDERS, norm_act
from tfdp.models.ws_conv2d import WSConv2D

# GroupNorm epsilon of PyTorch's nn.GroupNorm, which the authors use.
_GROUP_NORM_EPSILON = 1e-5

# CNN heads on ScatterNet features, from the authors' code (models.py):
# `MNIST_CNN` with in_channels != 1 and `CIFAR10_CNN` with in_channels != 3.
SCATTERNET_CNN_ARCHITECTURES = ("mnist", "cifar10", "cifar10_small")


def _feature_normalization(x, groups, feature_mean, feature_variance):
    """Applies the optional GroupNorm or fixed data normalization."""
    channels = x.shape[-1]
    if groups is not None and (feature_mean is not None or feature_variance is not None):
        raise ValueError(
            "ScatterNet head: pass either groups (GroupNorm) or feature_mean and "
            "feature_variance (private data normalization), not both."
        )
    if (feature_mean is None) != (feature_variance is None):
        raise ValueError(
            "ScatterNet head: feature_mean and feature_variance go together; pass both "
            "(e.g. from tfdp.dp.data_normalization.private_channel_mean_and_var) or neither."
        )
    if groups is not None:
        if groups < 1 or channels % groups:
            raise ValueError(
                f"ScatterNet head: groups={groups!r} must divide the {channels} feature "
                "channels (Tramer & Boneh use 9, 27 or 81)."
            )
        return keras.layers.GroupNormalization(
            groups=groups,
            center=False,
            scale=False,
            epsilon=_GROUP_NORM_EPSILON,
            name="feature_group_norm",
        )(x)
    if feature_mean is not None:
        mean = np.asarray(feature_mean, np.float32).reshape(-1)
        variance = np.asarray(feature_variance, np.float32).reshape(-1)
        if mean.shape != (channels,) or variance.shape != (channels,):
            raise ValueError(
                f"ScatterNet head: feature_mean {mean.shape} and feature_variance "
                f"{variance.shape} must both have shape ({channels},), one value per "
                "feature channel."
            )
        if not np.all(variance > 0):
            raise ValueError(
                "ScatterNet head: feature_variance must be > 0 everywhere; "
                "private_channel_mean_and_var bounds it below by its threshold."
            )
        return keras.layers.Normalization(
            mean=mean, variance=variance, name="feature_data_norm"
        )(x)
    return x


def _logits_model(inputs, x, num_classes, name, *, flatten=True):
    """The head's last layers, as a model: flatten (unless `flatten=False`) and dense logits."""
    if flatten:
        x = keras.layers.Flatten(name="flatten")(x)
    logits = keras.layers.Dense(
        num_classes, kernel_initializer=torch_default_initializer(), name="logits"
    )(x)
    return keras.Model(inputs, logits, name=name)


def _check_feature_shape(input_shape):
    if len(input_shape) != 3 or any(d is None or d < 1 for d in input_shape):
        raise ValueError(
            f"ScatterNet head: input_shape={tuple(input_shape)!r} must be the feature shape "
            "(height, width, channels), e.g. (7, 7, 81) or (8, 8, 243)."
        )


@gin.configurable(module="tfdp.models")
def build_scatternet_linear(
    input_shape,
    num_classes,
    *,
    groups=None,
    feature_mean=None,
    feature_variance=None,
    name="scatternet_linear",
):
    """Builds the linear (logistic regression) head on ScatterNet features.

    Tramer & Boneh 2021, App. C.2, Table 5 (authors' `ScatterLinear`):
    optional feature normalization, flatten, one dense layer with a per-class
    bias. Trainable parameters: h * w * K * num_classes + num_classes, i.e.
    3969 * 10 + 10 = 39,700 for 28x28 grayscale and 15552 * 10 + 10 = 155,530
    for CIFAR-10 (Table 4: 40K and 155K).

    Args:
      input_shape: feature shape (h, w, K), e.g. (7, 7, 81) or (8, 8, 243).
      num_classes: number of output logits.
      groups: GroupNorm groups (None = no GroupNorm); must divide K.
      feature_mean: optional float32 [K] private per-channel mean.
      feature_variance: optional float32 [K] private per-channel variance (> 0).
      name: model name.

    Returns:
      A `keras.Model`: float32 features [batch, h, w, K] -> float32 logits
      [batch, num_classes].

    Raises:
      ValueError: on a malformed input_shape, groups that do not divide K, both
        normalizations at once, or mean/variance of the wrong shape.
    """
    _check_feature_shape(input_shape)
    inputs = keras.Input(shape=tuple(input_shape), name="features")
    x = _feature_normalization(inputs, groups, feature_mean, feature_variance)
    return _logits_model(inputs, x, num_classes, name)


@gin.configurable(module="tfdp.models")
def build_scatternet_cnn(
    input_shape,
    num_classes,
    *,
    architecture=None,
    groups=None,
    feature_mean=None,
    feature_variance=None,
    name="scatternet_cnn",
):
    """Builds the tanh CNN head on ScatterNet features.

    Follows the authors' code (ftramer/Handcrafted-DP, models.py), which is what
    Table 4 counts; it differs from the paper's Tables 8-9:
      * "mnist" (`MNIST_CNN` on features, 7x7x81): conv 16 filters 3x3 stride 2
        padding 1, tanh; conv 32 filters 3x3 stride 1 padding 1, tanh; dense 32,
        tanh; dense num_classes. 33,066 parameters at 10 classes (Table 4:
        "33K"). Table 8 also lists two 2x2 stride-1 max-pools, which the code
        does not have; with them the count would be 20,778, not 33K.
      * "cifar10" (`CIFAR10_CNN` on features, 8x8x243): conv 64 3x3 tanh,
        2x2 max-pool, conv 64 3x3 tanh, dense num_classes. 187,210 parameters
        (Table 4: "187K"). Table 9 lists a second max-pool before the dense
        layer, which the code does not have.
      * "cifar10_small" (the "smaller variant ... 16-16-32-32" of Table 9):
        convs 16-16-M-32-32, dense num_classes. 56,346 parameters.
    Convolutions use "same" padding (equal to the code's padding 1, also for
    the stride-2 7x7 -> 4x4 case) and PyTorch's default weight initialization.

    Args:
      input_shape: feature shape (h, w, K).
      num_classes: number of output logits.
      architecture: one of `SCATTERNET_CNN_ARCHITECTURES`; None picks "mnist"
        for 7x7 features and "cifar10" for 8x8 features.
      groups: GroupNorm groups (None = no GroupNorm); must divide K.
      feature_mean: optional float32 [K] private per-channel mean.
      feature_variance: optional float32 [K] private per-channel variance (> 0).
      name: model name.

    Returns:
      A `keras.Model`: float32 features [batch, h, w, K] -> float32 logits
      [batch, num_classes].

    Raises:
      ValueError: on an unknown architecture (or none inferable from the
        feature size), or the normalization errors of `build_scatternet_linear`.
    """
    _check_feature_shape(input_shape)
    if architecture is None:
        architecture = {(7, 7): "mnist", (8, 8): "cifar10"}.get(tuple(input_shape[:2]))
        if architecture is None:
            raise ValueError(
                f"build_scatternet_cnn: cannot infer the architecture for features of "
                f"size {input_shape[0]}x{input_shape[1]}; pass architecture= one of "
                f"{SCATTERNET_CNN_ARCHITECTURES}."
            )
    if architecture not in SCATTERNET_CNN_ARCHITECTURES:
        raise ValueError(
            f"build_scatternet_cnn: architecture={architecture!r}; use one of "
            f"{SCATTERNET_CNN_ARCHITECTURES}."
        )
    inputs = keras.Input(shape=tuple(input_shape), name="features")
    x = _feature_normalization(inputs, groups, feature_mean, feature_variance)
    if architecture == "mnist":
        for index, (filters, strides) in enumerate(((16, 2), (32, 1))):
            x = keras.layers.Conv2D(
                filters,
                3,
                strides=strides,
                padding="same",
                activation="tanh",
                kernel_initializer=torch_default_initializer(),
                name=f"conv{index}",
            )(x)
        x = keras.layers.Flatten(name="flatten")(x)
        x = keras.layers.Dense(
            32, activation="tanh", kernel_initializer=torch_default_initializer(), name="fc1"
        )(x)
        return _logits_model(inputs, x, num_classes, name, flatten=False)
    config = (64, "M", 64) if architecture == "cifar10" else (16, 16, "M", 32, 32)
    x = conv_tanh_stack(x, config)
    return _logits_model(inputs, x, num_classes, name)


@gin.configurable(module="tfdp.models")
def build_scatternet_gnws_cnn(
    input_shape,
    num_classes,
    *,
    width=128,
    groups=27,
    norm_groups=16,
    norm_order="conv_relu_gn",
    feature_mean=None,
    feature_variance=None,
    name="scatternet_gnws_cnn",
):
    """Builds a wider CNN head of GroupNorm and weight-standardized convolutions.

    Tramer & Boneh 2021's ScatterNet features (App. C.1) as the input of the
    model family that De et al. 2022 train privately (App. C.1: GroupNorm
    instead of BatchNorm, weight standardization, Gaussian weights of
    variance 1 / fan-in), in the order TAN finds better with DP-SGD (Sander
    et al. 2023, Sec. 4.4, Fig. 5: ReLU then GroupNorm):

        feature normalization (GroupNorm of the features, or private data
          normalization; as `build_scatternet_linear`)
        WSConv2D(width, 3x3, stride 1), ReLU/GroupNorm(norm_groups)
        WSConv2D(width, 3x3, stride 2), ReLU/GroupNorm(norm_groups)
        flatten, dense num_classes

    On 7x7x81 Fashion-MNIST features, width 128: 93,312 + 147,456 kernel
    weights, 2 x 256 GroupNorm parameters, 20,490 dense parameters: 261,770
    trainable parameters (T&B's CNN head: 33,066). Every layer treats each
    example on its own (checked at compile by `tfdp.models.validate_dp_model`).

    Args:
      input_shape: feature shape (h, w, K), e.g. (7, 7, 81).
      num_classes: number of output logits.
      width: channels of both convolutions (>= 1, divisible by norm_groups).
      groups: GroupNorm groups of the input features (None = none); must
        divide K. T&B use 27 for Fashion-MNIST.
      norm_groups: GroupNorm groups after each convolution (De et al.: 16).
      norm_order: "conv_relu_gn" (TAN) or "conv_gn_relu".
      feature_mean: optional float32 [K] private per-channel mean.
      feature_variance: optional float32 [K] private per-channel variance (> 0).
      name: model name.

    Returns:
      A `keras.Model`: float32 features [batch, h, w, K] -> float32 logits
      [batch, num_classes].

    Raises:
      ValueError: a width that is not a positive multiple of norm_groups, an
        unknown norm_order, or the normalization errors of
        `build_scatternet_linear`.
    """
    _check_feature_shape(input_shape)
    if not isinstance(width, int) or width < 1 or not isinstance(norm_groups, int) \
            or norm_groups < 1 or width % norm_groups:
        raise ValueError(
            f"build_scatternet_gnws_cnn: width={width!r} must be a positive multiple of "
            f"norm_groups={norm_groups!r} (e.g. width 128, norm_groups 16)."
        )
    if norm_order not in NORM_ORDERS:
        raise ValueError(
            f"build_scatternet_gnws_cnn: norm_order={norm_order!r}; use one of {NORM_ORDERS}."
        )
    inputs = keras.Input(shape=tuple(input_shape), name="features")
    x = _feature_normalization(inputs, groups, feature_mean, feature_variance)
    for index, strides in enumerate((1, 2)):
        x = WSConv2D(width, 3, strides=strides, padding="same", name=f"conv{index}")(x)
        x = norm_act(x, f"conv{index}", norm_groups, norm_order)
    return _logits_model(inputs, x, num_classes, name)


def build_scatternet_classifier(head, input_shape, *, name="scatternet_classifier"):
    """Composes the fixed ScatterNet and a (trained) head into an image model.

    Args:
      head: a `keras.Model` from `build_scatternet_linear` or
        `build_scatternet_cnn` whose input shape equals the ScatterNet output
        shape for `input_shape`.
      input_shape: image shape (height, width, channels), channels 1 or 3,
        e.g. (28, 28, 1) or (32, 32, 3).
      name: model name.

    Returns:
      A `keras.Model`: float32 images [batch, height, width, channels] with
      pixel values in [0, 255] -> float32 logits. Layers: Tramer & Boneh's
      fixed input scaling (`scatternet_input_layer`), `ScatterNet`, `head`
      (sharing the head's weights).

    Raises:
      ValueError: if the head's input shape does not match the features.
      ImportError: if Kymatio is not installed.
    """
    inputs = keras.Input(shape=tuple(input_shape), name="images")
    x = scatternet_input_layer(input_shape[-1])(inputs)
    features = ScatterNet(name="scatternet")(x)
    if tuple(head.input_shape[1:]) != tuple(features.shape[1:]):
        raise ValueError(
            f"build_scatternet_classifier: the head expects features of shape "
            f"{tuple(head.input_shape[1:])} but the ScatterNet gives "
            f"{tuple(features.shape[1:])} for images of shape {tuple(input_shape)}."
        )
    return keras.Model(inputs, head(features), name=name)


def compute_scatternet_features(images, *, batch_size=256, jit_compile=True):
    """Computes ScatterNet features of a whole data set, for caching.

    Applies Tramer & Boneh's fixed input scaling and the J=2, L=8 ScatterNet
    (App. C.1) in batches of `batch_size` inside one `tf.function`, compiled
    with XLA by default (same values to 1e-6, about 2x faster on CPU). Measured
    on this project's 2-core CPU machine while other jobs ran (load ~5): 86 s
    for 70,000 28x28 grayscale images (MNIST-sized) and 43 s per 10,000 32x32
    RGB images (~4.3 min for CIFAR-10's 60,000). The last partial batch is
    zero-padded to `batch_size` so that XLA compiles one shape only.

    Args:
      images: uint8 (or float in [0, 255]) [num_examples, height, width,
        channels], channels 1 or 3.
      batch_size: images per batch (memory grows with it).
      jit_compile: compile the transform with XLA.

    Returns:
      np.float32 [num_examples, height / 4, width / 4, 81 * channels].

    Raises:
      ValueError: if images is not rank 4 or batch_size < 1.
      ImportError: if Kymatio is not installed.
    """
    images = np.asarray(images)
    if images.ndim != 4:
        raise ValueError(
            f"compute_scatternet_features: images of shape {images.shape} must be "
            "[num_examples, height, width, channels]."
        )
    if batch_size < 1:
        raise ValueError(f"compute_scatternet_features: batch_size={batch_size!r} must be >= 1.")
    num_examples, image_shape = images.shape[0], tuple(images.shape[1:])
    preprocess = scatternet_input_layer(image_shape[-1])
    scatter = ScatterNet()
    scatter.build((None,) + image_shape)
    out_shape = scatter.compute_output_shape((num_examples,) + image_shape)

    @tf.function(
        input_signature=[tf.TensorSpec((None,) + image_shape, tf.float32)],
        jit_compile=jit_compile,
    )
    def transform(batch):
        return scatter(preprocess(batch))

    features = np.empty(out_shape, np.float32)
    batch_size = min(batch_size, max(num_examples, 1))
    for start in range(0, num_examples, batch_size):
        batch = images[start : start + batch_size].astype(np.float32)
        count = batch.shape[0]
        if count < batch_size:
            batch = np.concatenate(
                [batch, np.zeros((batch_size - count,) + image_shape, np.float32)]
            )
        features[start : start + count] = transform(batch).numpy()[:count]
    return features
