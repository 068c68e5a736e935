"""Embedding tables: each example's gradient rows, one per distinct id, held (Embedding).

Tap rule: `tfdp.training.ghost_taps.embedding`.
"""

import tensorflow as tf

from tfdp.dp import precision
from tfdp.dp.ghost_norms import forms
from tfdp.dp.ghost_norms.rows import example_rows


def _held_sum(per_example: tf.Tensor, factors: tf.Tensor) -> tf.Tensor:
    """`factors[i] * per_example[i]`, zero (even for inf or nan) where `factors[i] <= 0`."""
    shape = [-1] + [1] * (per_example.shape.rank - 1)  # a batch of unknown size too
    keep = tf.reshape(factors > 0, shape)
    weights = tf.reshape(tf.cast(factors, per_example.dtype), shape)
    return tf.where(keep, per_example * weights, tf.zeros([], per_example.dtype))


def embedding_sq_norms(ids: tf.Tensor, output_grads: tf.Tensor, vocabulary_size: int, *,
                       num_views: int = 1):
    """Per-example squared norm of an embedding table's gradient (Embedding).

    `z_r = E[id_r]`: example i's gradient is `g_r` added into row `id_r` of
    a `[vocabulary_size, dim]` table, for each of its positions r (and
    views). Its squared norm is `sum_{r, r': id_r = id_r'} g_r . g_r'`. That
    Gram form would cancel, so instead the gradient's nonzero rows are held,
    without a `[vocabulary_size, dim]` tensor per example: with the 0/1 matrix
    `E_rr' = [id_r = id_r']` of the example's positions, `h = (first * E) g`
    holds at the FIRST position of each distinct id the sum of that id's
    output gradients, and 0 at repeats (R^2 dim per example, float32; static
    shapes, so XLA compiles it). Its squared norm is a staged float32 sum of
    squares (no cancellation) and the weighted sum scatters exactly these rows back
    into the table (the direct form of `forms`' "Rounding").

    Args:
      ids: int (or float, truncated as `keras.layers.Embedding` does)
        `[batch * K, ...]`, the layer's input; a negative id is row
        `id + vocabulary_size`, as `keras.ops.take` reads it.
      output_grads: float32 `[batch * K, ..., dim]`, `dL/dz`.
      vocabulary_size: the table's number of rows.
      num_views: K.

    Returns:
      `(squares, weighted_sum)`: float32 `[batch]`; `weighted_sum(factors)`
      gives float32 `[vocabulary_size, dim]`.
    """
    dim = output_grads.shape[-1]
    g = example_rows(output_grads, num_views)  # [batch, R, dim]
    batch = tf.shape(g)[0]
    ids = tf.reshape(tf.cast(ids, tf.int32), [batch, -1])  # [batch, R]
    # keras.ops.take reads row id + vocabulary_size for a negative id: the same row must
    # be the same id here, or its gradients would be normed apart (too small).
    ids = tf.where(ids < 0, ids + vocabulary_size, ids)
    same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), g.dtype)  # [batch, R, R]
    earlier = tf.reduce_sum(tf.linalg.band_part(same, -1, 0), axis=-1) - 1.0  # r' < r, same id
    first = tf.cast(tf.equal(earlier, 0.0), g.dtype)[:, :, None]
    # [batch, R, dim], nonzero at first occurrences; held, so one pass at the device's precision
    h = precision.einsum("brs,bsd->brd", same * first, g, exact=False)
    squares = forms.held_squares(h)

    def weighted_sum(factors):
        weighted = _held_sum(h, factors)
        return tf.math.unsorted_segment_sum(tf.reshape(weighted, [-1, dim]),
                                            tf.reshape(ids, [-1]), vocabulary_size)

    return squares, weighted_sum
