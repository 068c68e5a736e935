"""Helpers shared by the ghost-clipping tests, the fuzzer and `benchmarks/ghost_ascent.py`.

Not a test module (no `_test.py` suffix): the model FAMILIES, DPModel's
per-example loss, a layer without a ghost-norm rule, and the float64
brute-force reference of the fuzzer (`float64_twin`,
`float64_example_gradients`).
"""

import contextlib

import keras
import numpy as np
import tensorflow as tf

from keras import ops

from tfdp import models

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def example_loss_fn(model):
    """DPModel's per-example loss (the mean over the example's views)."""
    rank = len(model.inputs[0].shape)

    def example_loss(example):
        images, label = example
        views = images if images.shape.rank == rank else images[tf.newaxis]
        logits = model(tf.cast(views, tf.float32), training=True)
        loss = tf.reduce_mean(LOSS(tf.fill([tf.shape(logits)[0]], tf.cast(label, tf.int32)),
                                   logits))
        return loss, (loss, tf.reduce_mean(logits, axis=0))

    return example_loss


def nf_blocks(num_classes=10):
    inputs = keras.Input((8, 8, 3))
    x = models.ScaledWSConv2D(8, 3, padding="same", use_bias=False, name="stem")(inputs)
    x = models.NFResBlock(16, strides=2, name="transition")(x)
    x = models.NFResBlock(16, beta=1.02, name="identity")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x))


def layer_norm_model(num_classes=10):
    inputs = keras.Input((4, 6))
    x = keras.layers.Dense(8, activation="tanh")(inputs)
    x = keras.layers.LayerNormalization()(x)
    x = keras.layers.Flatten()(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x))


def depthwise_model(num_classes=10):
    """Depthwise convolutions (ConvNeXt, EfficientNet): strided, dilated, multiplied."""
    inputs = keras.Input((7, 7, 2))
    x = keras.layers.DepthwiseConv2D(3, strides=2, padding="same", depth_multiplier=2)(inputs)
    x = keras.layers.DepthwiseConv2D(2, dilation_rate=2, activation="relu")(x)
    x = keras.layers.Conv2D(4, 1, use_bias=False)(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x))


def positions(x):
    """0 .. T-1 for every example of `x` [batch, T, d] (float; Embedding casts to int)."""
    return ops.cumsum(ops.ones_like(x[:, :, 0]), axis=1) - 1.0


def vit_block(num_classes=10):
    """A tiny ViT: patch projection, position Embedding, pre-norm attention and MLP."""
    inputs = keras.Input((6, 5))  # 6 patches of 5 values
    x = keras.layers.Dense(8, name="patches")(inputs)
    x = x + keras.layers.Embedding(6, 8, name="position")(positions(inputs))
    h = keras.layers.LayerNormalization()(x)
    x = x + keras.layers.MultiHeadAttention(2, 4, name="attention")(h, h)
    h = keras.layers.LayerNormalization()(x)
    h = keras.layers.Dense(16, activation="gelu")(h)
    x = x + keras.layers.Dense(8)(h)
    x = keras.layers.GlobalAveragePooling1D()(keras.layers.LayerNormalization()(x))
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x))


def token_embedding_model(num_classes=10):
    """Token ids (repeated within an example) through an Embedding and an EinsumDense."""
    inputs = keras.Input((5,))  # ids in [0, 7): uniform floats, truncated
    x = keras.layers.Embedding(7, 4, name="tokens")(inputs)
    x = keras.layers.EinsumDense("abc,cde->abde", (5, 2, 3), bias_axes="de")(x)
    x = keras.layers.EinsumDense("abcd,cde->abe", (5, 6), bias_axes="e")(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(keras.layers.Flatten()(x)))


def convnext_block_model(num_classes=10):
    """ConvNeXt's layers (keras.applications.ConvNeXt*): a patchify stem, a block of a
    grouped 7x7 "depthwise" Conv2D(groups=C), LayerNorm, Dense on the 4-D activations
    (pointwise convolutions), LayerScale and the residual add, then a strided 2x2 conv."""
    from keras.src.applications import convnext  # LayerScale: Keras exports no name

    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, 2, strides=2, name="stem")(inputs)
    x = keras.layers.LayerNormalization(epsilon=1e-6)(x)
    y = keras.layers.Conv2D(8, 7, padding="same", groups=8, name="grouped")(x)
    y = keras.layers.LayerNormalization(epsilon=1e-6)(y)
    y = keras.layers.Dense(16, activation="gelu", name="pointwise_1")(y)
    y = keras.layers.Dense(8, name="pointwise_2")(y)
    y = convnext.LayerScale(0.5, 8, name="layer_scale")(y)
    x = keras.layers.Conv2D(6, 2, strides=2, groups=2, name="down")(x + y)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x))


def image_vit(num_classes=10, *, input_shape=(32, 32, 3), patch=8, dim=16, heads=2,
              depth=2):
    """A small ViT of Keras layers: a Conv2D patch embedding, a learned position
    embedding (an Embedding over the patch positions, added), pre-norm
    MultiHeadAttention and MLP blocks, LayerNorm, mean pooling, a Dense head."""
    inputs = keras.Input(input_shape)
    x = keras.layers.Rescaling(1.0 / 255.0)(inputs)
    x = keras.layers.Conv2D(dim, patch, strides=patch, name="patch_embedding")(x)
    x = keras.layers.Reshape((-1, dim))(x)
    x = x + keras.layers.Embedding(x.shape[1], dim, name="position_embedding")(positions(x))
    for i in range(depth):
        h = keras.layers.LayerNormalization(epsilon=1e-6)(x)
        x = x + keras.layers.MultiHeadAttention(heads, dim // heads, name=f"attention_{i}")(h, h)
        h = keras.layers.LayerNormalization(epsilon=1e-6)(x)
        h = keras.layers.Dense(2 * dim, activation="gelu")(h)
        x = x + keras.layers.Dense(dim)(h)
    x = keras.layers.GlobalAveragePooling1D()(keras.layers.LayerNormalization(epsilon=1e-6)(x))
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x))


# Every model family tfdp trains, at small sizes; inputs in the model's units.
FAMILIES = {
    "tramer_cnn": (lambda: models.build_tramer_cnn(10), (28, 28, 1), 255.0),
    "tramer_cifar_cnn": (lambda: models.build_tramer_cifar_cnn(10, input_shape=(16, 16, 3),
                                                               size="small"), (16, 16, 3), 255.0),
    "scatternet_linear": (lambda: models.build_scatternet_linear((7, 7, 81), 10, groups=27),
                          (7, 7, 81), 1.0),
    "scatternet_cnn": (lambda: models.build_scatternet_cnn((7, 7, 81), 10, groups=27),
                       (7, 7, 81), 1.0),
    "wrn_gn_ws": (lambda: models.build_wide_resnet(10, 1, 10, input_shape=(16, 16, 3)),
                  (16, 16, 3), 255.0),
    "wrn_relu_gn": (lambda: models.build_wide_resnet(10, 1, 10, input_shape=(8, 8, 3),
                                                     norm_order="conv_relu_gn"), (8, 8, 3), 255.0),
    "nf_resnet_blocks": (nf_blocks, (8, 8, 3), 1.0),
    "layer_norm": (layer_norm_model, (4, 6), 1.0),
    # The layers of pretrained backbones.
    "depthwise": (depthwise_model, (7, 7, 2), 255.0),
}

# Models with EinsumDense (MultiHeadAttention): their reference is a loop over examples,
# not tf.vectorized_map. Under vectorized_map, Keras' ops.einsum fast path for
# "abc,cde->abde" (a broadcast tf.matmul with output_type) gives the LAST example wrong
# outputs and corrupts memory (TF 2.21, Keras 3.15; docs/design/dp_step.md).
LOOP_FAMILIES = {
    "vit_block": (vit_block, (6, 5), 1.0),
    "token_embedding": (token_embedding_model, (5,), 7.0),
    # Dense on 4-D activations: the vectorized path meets the oneDNN bug there too.
    "convnext_block": (convnext_block_model, (8, 8, 3), 255.0),
    "image_vit": (lambda: image_vit(input_shape=(8, 8, 3), patch=4, dim=8, depth=1),
                  (8, 8, 3), 255.0),
}


class UnruledScale(keras.layers.Layer):
    """A layer without a ghost-norm rule: `x * scale`, one scalar variable."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

    def call(self, x):
        return x * self.scale


class CallsLayer(keras.layers.Layer):
    """A layer without a rule that calls another layer (used elsewhere too): `tanh(inner(x))`."""

    def __init__(self, inner, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner

    def call(self, x):
        return keras.ops.tanh(self.inner(x))


# -- The float64 brute-force reference ----------------------------------------


@contextlib.contextmanager
def float64_keras():
    """Layers built inside take float64 variables and compute in float64."""
    policy, floatx = keras.config.dtype_policy(), keras.config.floatx()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        yield
    finally:
        keras.config.set_dtype_policy(policy)
        keras.config.set_floatx(floatx)


def float64_twin(builder, model):
    """`builder()` built in float64, holding `model`'s weights (cast exactly to float64).

    `builder` must build the same architecture as `model` (same layer and
    weight creation order), e.g. the builder `model` came from.
    """
    with float64_keras():
        twin = builder()
    twin.set_weights(model.get_weights())
    return twin


def float64_example_gradients(twin, images, labels):
    """Per-example gradients of DPModel's per-example loss, one example at a time, in float64.

    Args:
      twin: a float64 model (`float64_twin`).
      images: array `[batch, H, W, C]` or `[batch, K, H, W, C]` (K views; the
        example's loss is the mean over them), any float dtype.
      labels: int array `[batch]`.

    Returns:
      list over examples of lists over `twin.trainable_variables` of float64 arrays.
    """
    rank = len(twin.inputs[0].shape)
    gradients = []
    for x, y in zip(np.asarray(images), np.asarray(labels)):
        views = x if x.ndim == rank else x[np.newaxis]
        with tf.GradientTape() as tape:
            logits = twin(tf.constant(views, tf.float64), training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=tf.fill([views.shape[0]], int(y)), logits=logits))
        grads = tape.gradient(loss, twin.trainable_variables,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        # An Embedding's gradient is IndexedSlices: made dense (repeated ids add up).
        gradients.append([tf.convert_to_tensor(g).numpy().astype(np.float64) for g in grads])
    return gradients


def global_norm64(arrays):
    """The L2 norm of a list of arrays, accumulated in float64."""
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(a, np.float64))) for a in arrays)))


def conv_group_norm(cls, input_shape, *, strides, groups, pool):
    """A builder of the cancellation canary: `cls(16, 3)` then GroupNorm, pooled
    or flattened, then Dense(10). On a near-constant image at 255 the group norm makes
    sum_r g_r ~ 0, so the conv kernel's gradient is a difference of large terms."""

    def build():
        inputs = keras.Input(input_shape)
        x = cls(16, 3, strides=strides)(inputs)
        x = keras.layers.GroupNormalization(groups=groups)(x)
        x = keras.layers.GlobalAveragePooling2D()(x) if pool else keras.layers.Flatten()(x)
        return keras.Model(inputs, keras.layers.Dense(10)(x))

    return build
