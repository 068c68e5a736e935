"""The Gram form of a kernel's per-example gradients: its norm, its bound, its weighted sum.

The per-example gradient `h = sum_r a_r g_r^T` is never built: its squared
norm is summed from the Grams `(x_r . x_r')(y_r . y_r')` of the example's
centred rows (Li et al. 2022, eq. (4), "ghost clipping"), with an
a-posteriori bound of its rounding (Higham 2002, Sec. 3.1), and the
weighted sum is one exact contraction over the same rows (the book-keeping
of Bu et al. 2022, Sec. 3.2). `tfdp.dp.ghost_norms.forms`, "Rounding", states
the contract and the bound.
"""

import dataclasses
import math
from typing import Optional

import numpy as np
import tensorflow as tf

from tfdp.dp import compiler_checks
from tfdp.dp import precision
from tfdp.dp.ghost_norms import forms
from tfdp.dp.ghost_norms.rows import Rows, _largest_entry, _one_block_at_a_time, example_rows

_U = precision.UNIT_ROUNDOFF


def _rows_with_mean(a: tf.Tensor, mean: Optional[tf.Tensor]) -> tf.Tensor:
    """`[a_1 - m, ..., a_R - m, m]` per example, `[batch, R + 1, F_k]` (`a` if `mean` is None)."""
    if mean is None:
        return a
    return tf.concat([a - mean[:, None, :], mean[:, None, :]], axis=1)


def _gram(x: tf.Tensor) -> tf.Tensor:
    """`x x^T` per example, `[batch, R, R]`, exact products, chunked (`precision`)."""
    batch, rows = tf.shape(x)[0], x.shape[1]
    chunks = precision.chunk_last_axis(x)  # [batch, R, C, c]
    count, width = chunks.shape[2], chunks.shape[3]
    flat = tf.reshape(tf.transpose(chunks, [0, 2, 1, 3]), [-1, rows, width])  # [batch C, R, c]
    grams = precision.einsum("nrf,nsf->nrs", flat, flat, exact=True)
    return tf.reshape(grams, [batch, count, rows, rows]), width


def _rows_times(x: tf.Tensor, matrix: tf.Tensor):
    """`x @ matrix` for x `[batch, R, F_k]`, matrix `[F_k, O]`: exact products, chunked over F_k.

    Returns `([batch, R, O], (chunk length, chunks))`: the chunks' products
    summed with `staged_sum` (error `precision.chunked_contraction_error`).
    """
    batch, rows, fan_out = tf.shape(x)[0], x.shape[1], matrix.shape[-1]
    chunks = precision.chunk_last_axis(tf.reshape(x, [-1, x.shape[-1]]))  # [batch R, C, c]
    count, width = chunks.shape[1], chunks.shape[2]
    pad = count * width - matrix.shape[0]
    columns = tf.reshape(tf.pad(matrix, [[0, pad], [0, 0]]), [count, width, fan_out])
    products = precision.einsum("cnf,cfo->cno", tf.transpose(chunks, [1, 0, 2]), columns,
                                exact=True)  # [C, batch R, O]
    summed = precision.staged_sum(products, axis=0)
    return tf.reshape(summed, [batch, rows, fan_out]), (width, count)


def _contract_rows(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    """`sum_{i, r} x_ir y_ir^T`, `[F_k, O]`: exact products, staged over chunks of rows.

    For one example (the others' rows zero) the result is within
    `rows_contraction_error(R) * sum_r |x_r| |y_r|` of the exact one.
    """
    rows = x.shape[1]
    chunk = _row_chunk()
    if rows <= chunk:
        return precision.einsum("brf,bro->fo", x, y, exact=True)
    count = -(-rows // chunk)
    pad = [[0, 0], [0, count * chunk - rows], [0, 0]]
    x = tf.reshape(tf.pad(x, pad), [-1, count, chunk, x.shape[-1]])
    y = tf.reshape(tf.pad(y, pad), [-1, count, chunk, y.shape[-1]])
    partial = precision.einsum("cbrf,cbro->cfo", tf.transpose(x, [1, 0, 2, 3]),
                               tf.transpose(y, [1, 0, 2, 3]), exact=True)  # [C, F_k, O]
    return precision.staged_sum(partial, axis=0)


def _row_chunk() -> int:
    """Rows of one example per contraction of `_contract_rows` (one GEMM up to 128 rows)."""
    return min(precision.ROW_CHUNK, precision.contraction_chunk() * 4)


def _rows_contraction_error(rows: int) -> float:
    chunk = min(rows, _row_chunk())
    return precision.chunked_contraction_error(chunk, -(-rows // chunk))


def _staged_over(t: tf.Tensor, axis: int) -> tf.Tensor:
    return precision.staged_sum(t, axis=axis)


@dataclasses.dataclass
class _Gram:
    """The Gram form of one kernel's per-example gradients, and their weighted sum.

    Built by `_gram_form`. Every tensor is float32 and per example, and in
    SCALED units (`tfdp.dp.precision`, "Range"): the rows x_r and
    the output gradients y_r of example i are divided by powers of two that
    bring their largest entries into [1, 4), so that no product of a huge
    factor and a tiny one underflows. The true h is `2^exponent[i]` times the
    scaled one; `norm` scales a bound back, and `weighted_sum` folds the
    power of two into each example's weight.

    Attributes:
      squares: `[batch]`, |h|^2 as computed.
      error: `[batch]`, a bound on |squares - |h|^2| (`forms`, "Rounding").
      support: `[batch]`, an upper bound on S = sum_r |x_r| |y_r|.
      row_norms: `[batch, R + 1]`, upper bounds on |x_r|.
      y: `[batch, R + 1, fan_out]`, the (scaled) output gradients and s.
      means: per block of rows, `[batch, F_k]` (None without centring).
      row_means: None, or `[batch, R]`: each row's mean over its columns,
        subtracted first (`forms._centred_columns`; weight standardization).
      weighted_error: e_w: the weighted sum adds, for one example, a vector
        within `e_w f S` of `f h`.
      sums: with `unit`, `[batch, R + 1]`, sum_k x_rk as computed (WS).
      along: with `unit`, `[batch, R + 1, fan_out]`, u_o . x_r as computed (WS).
      sums_error, along_error: their errors, per |x_r| (see `weight_standardized`).
      rows: the scaled rows (what the norms and the weighted sum read).
      exponent: int32 `[batch]`, the power of two that scales back.
      floor: `[batch]`, `underflow_slack`'s root: what flushing can add to |h|,
        scaled units (0 where a or g is all zero).
      finite: bool `[batch]`, whether the rows and output gradients are
        finite; where not, the squares are inf (factor 0: dropped).
    """

    squares: tf.Tensor
    error: tf.Tensor
    support: tf.Tensor
    row_norms: tf.Tensor
    y: tf.Tensor
    means: list
    weighted_error: float
    rows: Rows
    exponent: tf.Tensor
    floor: tf.Tensor
    finite: tf.Tensor
    row_means: Optional[tf.Tensor] = None
    sums: Optional[tf.Tensor] = None
    along: Optional[tf.Tensor] = None
    sums_error: float = 0.0
    along_error: float = 0.0

    def bound(self) -> tf.Tensor:
        """An upper bound on |h|^2, float32 `[batch]`, scaled units (flushing included)."""
        return precision.upper(tf.maximum(self.squares, 0.0) + self.error + self.floor**2,
                               4 * _U)

    def unscaled_squares(self, norm: tf.Tensor) -> tf.Tensor:
        """`(norm * 2^exponent)^2`, rounded up: a scaled-units norm bound -> squares `[batch]`."""
        unscaled = precision.times_power_of_two(norm, self.exponent)  # exact, or inf, or tiny
        return tf.where(self.finite, precision.upper(tf.square(unscaled), 8 * _U), np.inf)

    def weighted_sum(self, num_views: int, finish):
        """`weighted_sum(factors)` from the same rows x_r and gradients y_r as the norms.

        `finish` gets float32 `[F, fan_out]` (a's column order). Rows of a
        zero factor are zeroed first, so that an inf or nan there cannot
        reach the sum. Example i's weight is `factors[i] * 2^exponent[i]`
        (exact: a power of two), so that it adds `factors[i]` times its
        unscaled gradient.
        """
        rows = self.rows

        def weighted_sum(factors):
            keep = tf.cast(factors, tf.float32) > 0
            weights = tf.where(keep, tf.cast(factors, tf.float32), 0.0)
            weights = precision.times_power_of_two(weights, self.exponent)
            keep3 = keep[:, None, None]
            y = tf.where(keep3, self.y, 0.0) * weights[:, None, None]
            means = iter(self.means)

            row_means = self.row_means
            if row_means is not None:
                row_means = tf.where(keep[:, None], row_means, 0.0)

            def block_sum(a):
                mean = next(means)
                a = forms._centred_columns(tf.where(keep3, a, 0.0), row_means)
                if mean is not None:
                    mean = tf.where(keep[:, None], mean, 0.0)
                return _contract_rows(_rows_with_mean(a, mean), y)

            return finish(tf.concat(_one_block_at_a_time(rows, num_views, block_sum), axis=0))

        return weighted_sum


def _gram_form(rows: Rows, output_grads: tf.Tensor, num_views: int, *,
               scale: Optional[tf.Tensor] = None, unit: Optional[tf.Tensor] = None,
               centre_rows: bool = False) -> _Gram:
    """The centred Gram form of `h = sum_r a_r g_r^T` per example (`forms`, "Rounding").

    `g_r` is the float32 output gradient, times `scale` (float32 `[fan_out]`,
    WS) if given. Each example's rows and output gradients are first scaled
    by powers of two (`_Gram`; `tfdp.dp.precision`, "Range"). With `unit`
    (float32 `[F, fan_out]` in a's column order, WS) also each row's sum and
    its products with the unit vectors. With `centre_rows`, the rows are
    first centred over their columns (`forms._centred_columns`, with
    `Rows.row_means` of the scaled rows).
    """
    g = example_rows(output_grads, num_views)  # [batch, R, fan_out]
    if scale is not None:
        g = g * scale
    # Scale-safe: the largest |entry| of each example's g and a into [1, 4).
    largest_g, largest_a = _largest_entry(g), rows.largest_entry(num_views)
    exponent_g = precision.binary_exponent(largest_g)
    g = g * precision.power_of_two(-exponent_g)[:, None, None]
    exponent_a = precision.binary_exponent(largest_a)
    rows = rows.scaled(precision.power_of_two(-exponent_a), num_views)
    row_means = rows.row_means(num_views) if centre_rows else None
    centred = g.shape[1] > 1
    y = tf.concat([g, precision.compensated_sum(g, axis=1)[:, None, :]], 1) if centred else g
    num_rows = y.shape[1]
    first_column = [0]  # the blocks come in order: where the next one starts in a
    chunk_counts, along_widths, block_widths = [], [], []

    def block_terms(a):
        block_widths.append(a.shape[-1])
        a = forms._centred_columns(a, row_means)
        mean = tf.reduce_mean(a, axis=1) if centred else None  # any m: the x_r define h
        x = _rows_with_mean(a, mean)
        grams, width = _gram(x)
        chunk_counts.append((grams.shape[1], width))  # Python ints: not in `parts`
        parts = {"grams": grams, "norms": precision.staged_sum(tf.square(x)),
                 "mean": tf.zeros([0]) if mean is None else mean}
        if unit is not None:
            first, first_column[0] = first_column[0], first_column[0] + a.shape[-1]
            parts["sums"] = precision.staged_sum(x)
            parts["along"], width = _rows_times(x, unit[first:first + a.shape[-1]])
            along_widths.append(width)
        return parts

    parts = _one_block_at_a_time(rows, num_views, block_terms)
    blocks = len(parts)
    # M = sum over every chunk of every block; e_F for that staging.
    chunks = sum(count for count, _ in chunk_counts)
    e_f = precision.chunked_contraction_error(max(w for _, w in chunk_counts), chunks)
    m = _staged_over(tf.concat([p["grams"] for p in parts], axis=1), 1)  # [batch, R1, R1]
    chain_f = max(precision.sum_chain(width) for width in block_widths)
    norm_error = 2.0 * (precision.gamma(chain_f + 1) + precision.gamma(blocks))
    xi = forms._root(precision.upper(tf.add_n([p["norms"] for p in parts]), norm_error))
    n_grams, width_o = _gram(y)
    e_o = precision.chunked_contraction_error(width_o, n_grams.shape[1])
    n = _staged_over(n_grams, 1)
    eta = forms._root(precision.upper(precision.staged_sum(tf.square(y)),
                                2.0 * precision.square_sum_error(y.shape[-1])))
    flat = lambda t: tf.reshape(t, [-1, num_rows * num_rows])  # noqa: E731
    squares = precision.staged_sum(flat(m * n))
    e_q = precision.gamma(precision.sum_chain(num_rows * num_rows) + 1)
    outer = lambda v: v[:, :, None] * v[:, None, :]  # noqa: E731
    support = precision.upper(precision.staged_sum(xi * eta), 2 * precision.sum_error(num_rows))
    error = (e_f * precision.staged_sum(flat(outer(xi) * tf.abs(n)))
             + e_o * precision.staged_sum(flat(tf.abs(m) * outer(eta)))
             + e_q * precision.staged_sum(flat(tf.abs(m * n)))
             + e_f * e_o * tf.square(support))
    error = precision.upper(error, 0.01)  # the float32 sums of these non-negative terms
    # An all-zero a or g defines h = 0 exactly: nothing to flush. (A nan is not 0.)
    floor = tf.where(tf.logical_and(largest_a != 0, largest_g != 0), np.float32(math.sqrt(
        precision.underflow_slack(num_rows, sum(block_widths), y.shape[-1]))), 0.0)
    finite = tf.logical_and(compiler_checks.is_finite(largest_a),
                            compiler_checks.is_finite(largest_g))
    gram = _Gram(squares, error, support, xi, y,
                 [None if not centred else p["mean"] for p in parts],
                 _U + (1 + _U) * _rows_contraction_error(num_rows), rows,
                 exponent_a + exponent_g, floor, finite, row_means)
    if unit is not None:
        gram.sums = tf.add_n([p["sums"] for p in parts])
        gram.sums_error = 1.01 * (precision.gamma(chain_f) + precision.gamma(blocks))
        gram.along = tf.add_n([p["along"] for p in parts])  # [batch, R1, O]
        width, count = max(w for w, _ in along_widths), max(c for _, c in along_widths)
        chunked = precision.chunked_contraction_error(width, count)
        gram.along_error = chunked + (1 + chunked) * precision.gamma(blocks)
    return gram
