"""Tap rules of normalizations with a scale and offset: GroupNormalization, LayerNormalization.

Norms: `tfdp.dp.ghost_norms.broadcast` (`broadcast_sq_norms`: the scale and the offset).
"""

import keras
from keras import ops
import tensorflow as tf

from tfdp.dp.ghost_norms import broadcast as broadcast_norms
from tfdp.training.ghost_taps.registry import register, require


def normalization_site(layer, inputs, recorder, normalize, gamma, beta):
    """A normalization layer `normalize(x) * gamma + beta` (gamma, beta optional) as one site.

    The site's forward pass is the layer itself. The norms recompute
    `normalize(x)` rather than capture it: held from the forward pass to the
    norms, the normalized activations of WRN-16-4 take 130 MB at B = 64.
    """
    variables = [v for v in (gamma, beta) if v is not None]

    def norms(ins, out, g, k):
        parts = []
        if gamma is not None:
            parts.append(broadcast_norms.broadcast_sq_norms(
                g, gamma.shape, inputs=normalize(ins[0]), num_views=k))
        if beta is not None:
            parts.append(broadcast_norms.broadcast_sq_norms(g, beta.shape, num_views=k))
        return (tf.add_n([squares for squares, _ in parts]),
                lambda factors: [weighted_sum(factors) for _, weighted_sum in parts])

    return recorder.site(layer, variables, [inputs], layer, norms, listed=True)


@register(keras.layers.GroupNormalization)
def _group_norm(layer, inputs, recorder):
    require(layer.axis in (-1, len(inputs.shape) - 1), "GroupNormalization not on the last axis")

    def normalize(x):  # keras.layers.GroupNormalization without its scale and offset
        channels = x.shape[-1]
        grouped = tf.reshape(x, tf.concat(
            [tf.shape(x)[:-1], [layer.groups, channels // layer.groups]], 0))
        axes = [a for a in range(1, grouped.shape.rank) if a != grouped.shape.rank - 2]
        mean, variance = ops.moments(grouped, axes=axes, keepdims=True)
        inv = ops.rsqrt(variance + layer.epsilon)
        return tf.reshape(grouped * inv - mean * inv, tf.shape(x))

    return normalization_site(layer, inputs, recorder, normalize,
                               layer.gamma if layer.scale else None,
                               layer.beta if layer.center else None)


@register(keras.layers.LayerNormalization)
def _layer_norm(layer, inputs, recorder):
    rank = len(inputs.shape)
    axes = sorted(a % rank for a in layer.axis)
    require(not layer.rms_scaling, "LayerNormalization with rms_scaling")
    require(axes == list(range(rank - len(axes), rank)), "LayerNormalization not on trailing axes")

    def normalize(x):
        return ops.layer_normalization(x, axis=layer.axis, epsilon=layer.epsilon)

    return normalization_site(layer, inputs, recorder, normalize, layer.gamma, layer.beta)
