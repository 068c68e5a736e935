"""The rows of a kernel product `z = a @ W`: an example's positions and its K views.

Every rule treats the K consecutive rows of a flattened `[batch * K, ...]`
tensor as one example (`example_rows`); `Rows` hands a kernel rule its
input rows one column block at a time (`conv.conv2d_patches` builds them for a
convolution).
"""

import dataclasses
import math
from typing import Callable, Optional, Tuple

import numpy as np
import tensorflow as tf


def example_rows(tensor: tf.Tensor, num_views: int = 1) -> tf.Tensor:
    """Groups the rows of each example: `[batch * K, ..., d]` -> `[batch, rows, d]`.

    The K views of example i are rows i*K .. i*K + K - 1 of `tensor`; all their
    positions (every axis but the first and last) become the example's rows.
    """
    d = tensor.shape[-1]
    if d is None:
        d = tf.shape(tensor)[-1]
    batch = tf.shape(tensor)[0] // num_views
    rows = _static_rows(tensor, num_views)
    result = tf.reshape(tensor, [batch, -1 if rows is None else rows, d])
    # The static rows survive a dynamic batch (the trainer's Poisson batches): the Gram
    # form and the staged sums need them.
    result.set_shape([None, rows, tensor.shape[-1]])
    return result


def _static_size(tensor: tf.Tensor) -> Optional[int]:
    """Floats per row of `tensor` [n, ...], or None if not static."""
    inner = tensor.shape[1:]
    return math.prod(inner.as_list()) if inner.is_fully_defined() else None


def _static_rows(tensor: tf.Tensor, num_views: int) -> Optional[int]:
    inner = tensor.shape[1:-1]
    if not inner.is_fully_defined():
        return None
    return num_views * math.prod(inner.as_list())


@dataclasses.dataclass(frozen=True)
class Rows:
    """The input rows `a` of a kernel product `z = a @ W`, in column blocks.

    The blocks are built one at a time, each after the previous one has been
    used (control dependencies), so that only one is in memory.

    Attributes:
      blocks: callables, each returning float32 `[batch * K, ..., F_k]`; their
        concatenation along the last axis is `a` (F = sum F_k).
      fan_in: F, W's first dimension.
      order: None, or an int array `[F]`: column f of `a` multiplies row
        `order[f]` of W (see `conv.conv2d_patches`).
      row_sums: None, or a callable returning float32 `[batch * K, ...]`, each
        row's sum over its F columns (any float32 rounding of it), cheaper
        than building the blocks (weight standardization centres the rows
        with it).
      magnitude: None, or a callable returning float32 `[batch * K]`, an
        upper bound on every |entry| of each image's rows (the largest
        |entry| of the input region the patches read: a patch holds input
        entries and zeros), cheaper than building the blocks. The Gram form
        scales by it (`scaled`).
      rebuild: None, or a callable `factors [batch * K] -> Rows` that builds
        the same rows from the input times one factor per image: cheaper
        than scaling every block (a 3x3 patch is 9 input entries).
      gradients: None, or a callable `(output_grads, num_views, source=None)
        -> [batch, fan_out, F]`: every example's `h^T = sum_r g_r a_r^T` (a's
        column order) without building the rows, e.g. one grouped
        convolution (`conv.conv2d_patches`); the direct form uses it where
        `forms.grouped_conv_gradients()` says so. `source`: the examples' slice of
        `source` to read instead (a chunk of the batch, `forms._recomputed`).
      source: None, or float32 `[batch * K, ...]`, the input region that
        `gradients` reads.
    """

    blocks: Tuple[Callable[[], tf.Tensor], ...]
    fan_in: int
    order: Optional[np.ndarray] = None
    row_sums: Optional[Callable[[], tf.Tensor]] = None
    magnitude: Optional[Callable[[], tf.Tensor]] = None
    rebuild: Optional[Callable[[tf.Tensor], "Rows"]] = None
    gradients: Optional[Callable[..., tf.Tensor]] = None
    source: Optional[tf.Tensor] = None

    @classmethod
    def of(cls, inputs: tf.Tensor) -> "Rows":
        """The rows of a dense layer's input `[batch * K, ..., fan_in]`, one block."""
        return cls((lambda: inputs,), inputs.shape[-1], None,
                   lambda: tf.reduce_sum(inputs, axis=-1), lambda: _largest_entry(inputs),
                   lambda factors: cls.of(_times_per_image(inputs, factors)))

    def largest_entry(self, num_views: int) -> tf.Tensor:
        """Per example (over its K views), an upper bound on every |entry|, float32 `[batch]`."""
        if self.magnitude is not None:
            per_image = self.magnitude()
        else:  # one pass over the blocks
            per_image = tf.reduce_max(tf.stack(
                [_largest_entry(block()) for block in self.blocks]), axis=0)
        return tf.reduce_max(tf.reshape(per_image, [-1, num_views]), axis=1)

    def scaled(self, factors: tf.Tensor, num_views: int) -> "Rows":
        """These rows times one float32 factor per example `[batch]` (a power of two: exact)."""
        per_image = tf.repeat(factors, num_views)
        if self.rebuild is not None:
            return self.rebuild(per_image)
        row_sums = None if self.row_sums is None else (
            lambda: _times_per_image(self.row_sums(), per_image))
        return Rows(tuple((lambda b=b: _times_per_image(b(), per_image)) for b in self.blocks),
                    self.fan_in, self.order, row_sums)

    def row_means(self, num_views: int) -> tf.Tensor:
        """Each row's mean over its columns, float32 `[batch, R]` (a rounding of it)."""
        if self.row_sums is not None:
            sums = self.row_sums()
        else:  # one pass over the blocks
            sums = tf.add_n([tf.reduce_sum(block(), axis=-1) for block in self.blocks])
        return example_rows(sums[..., None], num_views)[..., 0] / self.fan_in

    def to_kernel_rows(self, tensor: tf.Tensor) -> tf.Tensor:
        """`tensor` [F, ...] indexed like `a`'s columns -> indexed like W's rows."""
        if self.order is None:
            return tensor
        return tf.gather(tensor, np.argsort(self.order), axis=0)


def _times_per_image(t: tf.Tensor, factors: tf.Tensor) -> tf.Tensor:
    """`t [n, ...]` times `factors [n]`, one per leading index."""
    return t * tf.reshape(factors, [-1] + [1] * (t.shape.rank - 1))


def _largest_entry(t: tf.Tensor) -> tf.Tensor:
    """The largest |entry| of each `t[i]`, float32 `[n]` (nan if any entry is nan)."""
    flat = tf.abs(tf.reshape(t, [tf.shape(t)[0], -1]))
    return tf.where(tf.reduce_any(tf.math.is_nan(flat), axis=1), np.float32(np.nan),
                    tf.reduce_max(flat, axis=1))


def _one_block_at_a_time(rows: Rows, num_views: int, fn) -> list:
    """`[fn(block as [batch, R, F_k]) for each block]`, each after the previous."""
    results, previous = [], []
    for block in rows.blocks:
        with tf.control_dependencies(previous):
            result = fn(example_rows(block(), num_views))
        results.append(result)
        previous = tf.nest.flatten(result)
    return results
