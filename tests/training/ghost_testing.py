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
        gradients.append([g.numpy().astype(np.float64) for g in grads])
    return gradients


def global_norm64(arrays):
    """The L2 norm of a list of arrays, accumulated in float64."""
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(a, np.float64))) for a in arrays)))
