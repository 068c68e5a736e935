"""Broadcast parameters: biases, offsets (beta), and scales (gamma, gain, skip gain).

`z = x * p` or `z = x + p`, p broadcast over the leading axes: each example's
gradient is a sum over its positions, held (`broadcast_sq_norms`). The
normalizations' scale and offset (`tfdp.training.ghost_taps.normalization`),
every layer's bias (`ghost_taps.registry`), a ScaledWSConv2D's gain
(`ghost_taps.conv`) and the blocks' scales (`ghost_taps.blocks`) take it.
"""

import math
from typing import Optional, Sequence

import tensorflow as tf

from tfdp.dp import precision
from tfdp.dp.ghost_norms import forms


def broadcast_sq_norms(
    output_grads: tf.Tensor,
    parameter_shape: Sequence[int],
    *,
    inputs: Optional[tf.Tensor] = None,
    num_views: int = 1,
):
    """Per-example squared norm of the gradient of a broadcast parameter.

    `z = x * p` (a scale: per channel, or a scalar) or `z = x + p` (a bias or
    offset), with `p` of shape `parameter_shape` broadcast over the leading
    axes of `z`: its gradient is the sum over those axes (and the example's
    views) of `x * g`, or of `g`.

    Args:
      output_grads: float32 `[batch * K, ..., *parameter_shape]`, `dL/dz`.
      parameter_shape: the parameter's shape, equal to the trailing axes of z
        (`()` for a scalar).
      inputs: the tensor `x` multiplied by a scale, shaped as `output_grads`;
        None for a bias.
      num_views: K.

    Returns:
      `(squares, weighted_sum)`: float32 `[batch]`; `weighted_sum(factors)`
      gives float32 `parameter_shape`. Each example's gradient is held (a
      staged float32 sum over its positions), and its norm is that of the
      held vector (`forms`, "Rounding").
    """
    terms = output_grads if inputs is None else inputs * output_grads
    size = math.prod(parameter_shape)
    batch = tf.shape(terms)[0] // num_views
    terms = tf.reshape(terms, [batch, -1, size])  # [batch, R, size]
    if terms.shape[1] is None:  # unknown positions: a plain float32 sum (held all the same)
        per_example = tf.reduce_sum(terms, axis=1)
    else:  # held: any float32 sum; staged, as accurate as the float32 backward pass
        per_example = precision.staged_sum(terms, axis=1)
    squares = forms.held_squares(per_example)
    return squares, forms._summer(per_example, squares,
                            lambda summed: tf.reshape(summed, parameter_shape))
