"""What every family's rules share: the form choice, held vectors and their margin, the recompute.

- The form of a kernel's per-example gradient (`choose_form`): DIRECT (each
  example's gradient built and held, `_direct_products`) or GRAM (never
  built, `tfdp.dp.ghost_norms.gram`).
- "Rounding" (below): the contract every rule keeps, that an example's
  returned norm bounds what the weighted sum really adds for it, and the
  margin of a held vector (`held_squares`) and of its weighted sum (`_summer`).
- The switches read at trace time, and what the grouped route does with
  them: `GROUPED_CONV_GRADIENTS` (a conv kernel's per-example gradients as
  one grouped convolution, `grouped_conv_gradients`), `RECOMPUTED_GRADIENTS`,
  `RECOMPUTE_CHUNKS` and `RECOMPUTE_CHUNK_EXAMPLES` (such a kernel built
  twice, chunk by chunk of the batch, `_recomputed`: Bu et al. 2023's
  book-keeping memory). Tests and benchmarks set them on this module, which
  defines and reads them.
"""

from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from tfdp.dp import clipping
from tfdp.dp import compiler_checks
from tfdp.dp import device_arithmetic
from tfdp.dp import precision
from tfdp.dp.ghost_norms.rows import Rows, _one_block_at_a_time, _static_size, example_rows

DIRECT = "direct"
GRAM = "gram"


def choose_form(rows: Optional[int], fan_in: int, fan_out: int,
                standardized: bool = False) -> str:
    """`GRAM` where it holds less per example and costs at most 4x the direct form's extra work.

    Per example, with R rows, F = fan_in, O = fan_out and P the passes of an
    exact product on the planned device (6 where `device_arithmetic.splits()`: a GPU's
    TF32 or a TPU's bf16 matmuls; else 1):

    | form   | held until the clip factors are known | work beyond the plain step's kernel gradient |
    |--------|----------------------------------------|-----------------------------------------------|
    | direct | the gradient, F O floats               | its squares and its weighted sum: 2 F O       |
    | Gram   | the rows and output gradients, R (F + O) | the Grams, P R^2 (F + O); the weighted sum's extra passes, (P - 1) R F O; with weight standardization its rows' products with the unit kernel, P R F O |

    The direct form's gradient costs R F O, as the plain step's kernel
    gradient it replaces. The Gram form is taken where it holds less AND its
    extra work is at most 4x the direct form's: few rows (a dense layer, R =
    1: a large classifier head at a large batch holds F O floats per example
    in the direct form). Counting what the rules really compute, not the
    textbook R^2 (F + O) against R F O (Li et al. 2022; Bu et al. 2022's
    mixed ghost clipping), matters on a GPU or TPU, where every Gram product
    is six passes: on WRN-16-4 the textbook pick cost 3.4x the plain step's
    XLA flops and this one 1.05x (docs/design/step_cost.md).
    An unknown R (dynamic positions) takes the direct form.

    Args:
      rows: R (positions times views), or None if not static.
      fan_in, fan_out: the kernel's F and O.
      standardized: a weight-standardized kernel (`weight_standardized`).

    Returns:
      `DIRECT` or `GRAM`.
    """
    if rows is None:
        return DIRECT
    passes = 6 if device_arithmetic.splits() else 1
    kernel = rows * fan_in * fan_out
    held_direct, held_gram = fan_in * fan_out, rows * (fan_in + fan_out)
    extra_direct = 2 * fan_in * fan_out
    extra_gram = (passes * rows * rows * (fan_in + fan_out) + (passes - 1) * kernel
                  + (passes * kernel if standardized else 0))
    if held_gram < held_direct and extra_gram <= 4 * extra_direct:
        return GRAM
    return DIRECT


# -- Rounding: norms that never come out too small -----------------------------
#
# A per-example norm that comes out too small lets its example contribute more
# than C. The rules can cancel: the Gram form sums (a_r . a_r')(g_r . g_r') over
# row pairs, and on a nearly constant image at 255 these terms are 1e6 times the
# result; weight standardization subtracts two large projections from |h|^2.
# Computed naively in float32 that cancellation gives one example 1.52 C. On a
# TPU (bf16 matmul passes) it is worse. The contract: the
# vector each example adds to the clipped sum, AS THE DEVICE COMPUTES IT, has norm
# at most the norm returned for it, in float32, at the device's matmul precision
# (`tfdp.dp.precision`). So every rule returns, per example, `squares`: an upper
# bound on |v_i / f_i|^2, where v_i is what `weighted_sum(factors)` adds for
# example i with factor f_i (one-hot factors; the float32 sum over a batch, which
# every DP-SGD library shares, is not counted), rounding of the product f_i * v_i
# included. Two kinds of rule:
#
# - HELD: the rule builds each example's vector (direct-form kernels, grouped and
#   depthwise kernels, embedding rows, biases and scales) and keeps it; the weighted
#   sum adds exactly these vectors times the factors (`precision.weighted_sum`:
#   one rounding per product, on every device). The norm is that of the held
#   float32 vector: a staged sum of squares, which cannot cancel, with its
#   rounding bound (`held_squares`). How the held vector was computed (a bf16
#   pass, a float32 backward pass) does not matter for the bound: it is the
#   vector added. RECOMPUTED (`_recomputed`, a GPU's or TPU's large conv kernels):
#   the vector is built again for the weighted sum, and whatever that second build
#   returns, its own `held_squares` and `reclip_factors` scale it to at most the
#   first build's norm (the same vector: factor unchanged).
# - GRAM (large kernels over few positions; `choose_form`): the per-example
#   gradient h = sum_r a_r g_r^T is never built. Its rows are first CENTRED per
#   example over the positions: d_r = a_r - m with m the rows' mean, and
#   h = sum_r d_r g_r^T + m s^T with s = sum_r g_r (an error-free sum): R + 1
#   rows x_r (d_1 .. d_R and m) with output gradients y_r (g_1 .. g_R and s).
#   On a nearly constant image the d_r are small and s cancels, so the terms of
#   |h|^2 = sum (x_r . x_r')(y_r . y_r') are no longer 1e6 times the result. The
#   Grams are products good to float32 on every device (`precision.einsum(...,
#   exact=True)`, chunked and staged), and the computed |h|^2 gets an
#   a-posteriori bound of its rounding (Higham 2002, Sec. 3.1):
#       e_F sum xi_r xi_r' |N_rr'| + e_O sum |M_rr'| eta_r eta_r'
#           + e_q sum |M_rr' N_rr'| + e_F e_O S^2,
#   M, N the computed Grams of x and y, xi, eta the rows' norms, S = sum_r xi_r
#   eta_r, e_F, e_O, e_q the stated errors of the contractions and of the sum.
#   The weighted sum is computed from the SAME x_r, y_r (the means m kept from
#   the norms' pass), as one exact contraction over the rows: it adds, for
#   example i, a vector within e_w f_i S of f_i h, which the norm covers by
#   adding e_w S to it (`gram._Gram`). Weight standardization's projection adds its
#   own terms (`weight_standardized.ws_kernel_sq_norms`).
#
# What the bound costs: on ordinary images the returned norm exceeds the norm of
# the vector added by about 1e-5 relative (docs/design/ghost_norms_and_precision.md,
# "Over-count on ordinary images", has the distribution); on adversarial ones (a constant
# image with one pixel off) it may exceed it more, which only clips that example harder.


NORM_DTYPE = tf.float32  # the dtype of every rule's squares (no float64 anywhere)
_U = precision.UNIT_ROUNDOFF


held_squares = precision.held_squares  # the bound every held vector's norm uses


def _root(value: tf.Tensor) -> tf.Tensor:
    """An upper bound on `sqrt(value)` (value >= 0; a sqrt may be a few ulp off on TPUs)."""
    return precision.upper(tf.sqrt(tf.maximum(value, 0.0)), 8 * _U)


def _summer(blocks, squares, finish=None):
    """`weighted_sum(factors)`: `sum_i factors[i] * blocks[i]`, then `finish`.

    `blocks`: held per-example vectors (float32), a tensor `[batch, ...]` or a
    list of them concatenated (after summing) along their last axis. One
    rounding per product (`precision.weighted_sum`) when every example's
    `squares` is finite; otherwise `clipping.weighted_sum`, where a zero
    factor drops even an inf or nan gradient (also one rounding per product).
    Where the products split (a GPU or TPU, whose `precision.weighted_sum` is
    elementwise too), always `clipping.weighted_sum`.
    """
    blocks = blocks if isinstance(blocks, list) else [blocks]

    def weighted_sum(factors):
        factors = tf.cast(factors, blocks[0].dtype)
        if device_arithmetic.splits():
            # Elementwise products either way there (`precision.weighted_sum`): one
            # multiply_no_nan pass, no cond, whose two branches XLA computes both (a select:
            # 2.1 of WRN-16-4's 7.8 GB at B = 32).
            summed = [clipping.weighted_sum(factors, b) for b in blocks]
            summed = summed[0] if len(summed) == 1 else tf.concat(summed, axis=-1)
            return summed if finish is None else finish(summed)
        finite = tf.reduce_all(compiler_checks.is_finite(squares))
        summed = [tf.cond(finite, lambda b=b: precision.weighted_sum(factors, b),
                          lambda b=b: clipping.weighted_sum(factors, b)) for b in blocks]
        summed = summed[0] if len(summed) == 1 else tf.concat(summed, axis=-1)
        return summed if finish is None else finish(summed)

    return weighted_sum


def _centred_columns(a: tf.Tensor, row_means: Optional[tf.Tensor]) -> tf.Tensor:
    """`a_r - mu_r 1` per row (`row_means` mu `[batch, R]`), or `a` if None."""
    return a if row_means is None else a - row_means[:, :, None]


def _direct_products(rows: Rows, output_grads: tf.Tensor, num_views: int,
                     row_means: Optional[tf.Tensor] = None) -> list:
    """Each example's `h^T = sum_r g_r a_r^T`, `[batch, fan_out, F_k]` per block of `rows`.

    TRANSPOSED (`g^T a` is 20-40% faster than `a^T g` on CPU), one pass at
    the device's precision: these are held, and the norm is theirs. With
    `row_means`, of the rows centred over their columns (`_centred_columns`).
    Where `rows.gradients` exists and `grouped_conv_gradients()`, one block
    from it instead (held all the same: how it is computed does not matter
    for the bound).
    """
    if row_means is None and rows.gradients is not None and grouped_conv_gradients():
        return [rows.gradients(output_grads, num_views)]
    g = example_rows(output_grads, num_views)
    return _one_block_at_a_time(
        rows, num_views, lambda a: precision.matmul(g, _centred_columns(a, row_means),
                                                    transpose_a=True))


# Where the direct form of a convolution's kernel builds its per-example gradients with one
# grouped convolution (`conv.conv2d_example_gradients`) instead of patches: None follows the
# device (`grouped_conv_gradients`); True or False forces it (tests, benchmarks).
GROUPED_CONV_GRADIENTS: Optional[bool] = None


def grouped_conv_gradients() -> bool:
    """Whether direct-form conv kernels use `conv.conv2d_example_gradients` (trace time).

    `GROUPED_CONV_GRADIENTS` if set, else `device_arithmetic.splits()`: on a GPU or a
    TPU (whose matmuls round their inputs), where a grouped convolution is the
    device's own kernel and patches cost memory and bandwidth; not on a CPU,
    where TensorFlow's and XLA's grouped convolutions are 1.3-24x slower than
    the patches (docs/design/step_cost.md, "Grouped convolutions").
    """
    if GROUPED_CONV_GRADIENTS is not None:
        return GROUPED_CONV_GRADIENTS
    return device_arithmetic.splits()


# How the grouped route builds a conv kernel's per-example gradients: "grouped" (one grouped
# convolution, the batch as its feature groups), "batch_grouped" (one XLA convolution, the
# batch as its batch groups) or "per_example" (each example's own kernel-gradient
# convolution, as the plain step's), except for a convolution of fewer than
# PER_EXAMPLE_MIN_CHANNELS input channels (an image stem), which stays grouped: a TPU's
# compiler lowers a kernel gradient of 3 input channels as loops of elementwise fusions (on
# WRN-16-4 at B = 32, the stem's 32 such convolutions took 4.6 M of the step's 27.9 M
# estimated cycles). None: `per_example_convs()` picks.
PER_EXAMPLE_CONVS: Optional[str] = None
PER_EXAMPLE_MIN_CHANNELS = 8


def per_example_convs() -> str:
    """How `conv.conv2d_example_gradients` builds per-example gradients (trace time).

    "grouped", "per_example" or "batch_grouped": `PER_EXAMPLE_CONVS` if
    set, else "grouped". On a TPU's compiler a convolution of fewer than
    128 feature groups costs n times the plain kernel gradients' flops; the
    other two routes cost about them, but with WRN-16-4 their steps move
    more bytes: one convolution per example 5% more than the grouped route
    at B = 32 and 1.7-1.9x as many at B = 128 (each example's rebuilt
    gradient is written and read: bytes in proportion to B F O), batch
    groups 1.5-1.6x as many (docs/performance.md, "Per-example convolutions
    on a TPU" and "Batch groups"), so no device takes them by default.

    Raises:
      ValueError: `PER_EXAMPLE_CONVS` is not None, "grouped", "per_example"
        or "batch_grouped".
    """
    if PER_EXAMPLE_CONVS is None:
        return "grouped"
    if PER_EXAMPLE_CONVS not in ("grouped", "per_example", "batch_grouped"):
        raise ValueError(f"PER_EXAMPLE_CONVS={PER_EXAMPLE_CONVS!r}: give None, 'grouped', "
                         "'per_example' or 'batch_grouped'.")
    return PER_EXAMPLE_CONVS


# Where a direct-form conv kernel on the grouped route is RECOMPUTED instead of held:
# None follows the device (`recomputed_gradients`); True or False forces it.
RECOMPUTED_GRADIENTS: Optional[bool] = None
RECOMPUTE_CHUNKS = 8  # at most this many chunks of the batch per recomputed kernel
RECOMPUTE_CHUNK_EXAMPLES = 8  # and at least this many examples per chunk (where the batch allows)


def recomputed_gradients() -> bool:
    """Whether direct-form kernels that hold more than they read are recomputed (trace time).

    `RECOMPUTED_GRADIENTS` if set (True: every grouped-route kernel with a
    static batch, whatever it holds; tests), else `grouped_conv_gradients()`:
    where the per-example gradients are grouped convolutions (a GPU or TPU),
    whose memory, not their work, sets the DP step's cost.
    """
    if RECOMPUTED_GRADIENTS is not None:
        return RECOMPUTED_GRADIENTS
    return grouped_conv_gradients()


def _recompute_chunks(rows: Rows, output_grads: tf.Tensor, num_views: int) -> int:
    """How many chunks of the batch `_recomputed` takes, or 0 where it does not pay.

    It pays where the per-example gradient `F O` floats is more than what the
    recompute keeps until the clip factors are known: the input region and the
    output gradients of the example's K views (a WRN-16-4's stages 2 and 3:
    147k and 590k floats against 74k and 42k). A batch size unknown at trace
    time keeps the gradients held.
    """
    if (rows.gradients is None or rows.source is None or not grouped_conv_gradients()
            or not recomputed_gradients()):
        return 0
    images = output_grads.shape[0]
    reads, grads = _static_size(rows.source), _static_size(output_grads)
    if images is None or reads is None or grads is None:
        return 0
    kept = num_views * (reads + grads)  # per example
    if RECOMPUTED_GRADIENTS is None and kept >= rows.fan_in * output_grads.shape[-1]:
        return 0  # (True forces it: tests)
    return recompute_trip_count(images // num_views)


def recompute_chunk_count(batch: int) -> int:
    """The chunks a recomputed kernel's batch of `batch` examples is cut into (a divisor of it).

    The largest divisor of `batch` up to `RECOMPUTE_CHUNKS` that leaves at
    least `RECOMPUTE_CHUNK_EXAMPLES` examples per chunk (1 for a small batch):
    a chunk's per-example gradients are then at most 1/8 of the batch's,
    and a GPU's grouped convolution still gets 8 or more examples at a time.
    """
    wanted = max(1, min(RECOMPUTE_CHUNKS, batch // RECOMPUTE_CHUNK_EXAMPLES))
    return max(n for n in range(1, wanted + 1) if batch % n == 0)


def recompute_trip_count(batch: int) -> int:
    """The trips of a recomputed kernel's loops over a batch of `batch` examples (trace time).

    One example per trip on the per-example route (`per_example_convs()` is
    "per_example", whatever each convolution's channels): each trip of the
    norms' loop builds one example's gradient (projected where the kernel is
    weight-standardized) and squares it, and each trip of the weighted sum's
    loop builds it again, reclips and adds it; no chunk of gradients is
    stacked, and no operand is broadcast over a chunk (WRN-16-4 at B = 32 on
    a TPU v5e: 12.49 GB accessed against 18.09 with chunks of 8;
    docs/performance.md, "Per-example convolutions on a TPU"). Else
    `recompute_chunk_count(batch)`.
    """
    if per_example_convs() == "per_example":
        return batch
    return recompute_chunk_count(batch)


def reclip_factors(factors: tf.Tensor, first: tf.Tensor, again: tf.Tensor) -> tf.Tensor:
    """The factors for a recomputed held vector v': `fl(f s)`, with `fl(f s) |v'| <= f sqrt(first)`.

    `factors` f: the clip factors, computed from `first`, the squares the
    first build returned; `again`: the `held_squares` of the vector built
    again now (all float32 `[n]`). s is 1 where `again <= first` (the same
    vector computed again: the usual case, and then the factors are returned
    unchanged), 0 where `again` is not finite, else `sqrt(first / again) (1 -
    16 u)`; a quotient `first / again` or a product `f s < 1` that lands below
    float32's normals (where rounding is no longer relative) gives 0. With
    `held_squares`' bound (for any factor), what the example adds is then at
    most `f sqrt(first)`, whatever the recompute returned (a device whose second convolution
    differs from its first: another algorithm, a rewrite).
    """
    tiny = np.finfo(np.float32).tiny  # 2^-126: below it, rounding is absolute, not relative
    quotient = first / again
    ratio = tf.sqrt(quotient) * np.float32(1.0 - 16 * _U)
    # A non-finite ratio (again flushed to 0 in the division, or 0 / 0) or a quotient below
    # the normals (a device that keeps denormals rounds it by up to 2^-150) drops the example.
    finite = compiler_checks.is_finite(ratio) & compiler_checks.is_finite(again)
    shrunk = tf.where(finite & (quotient >= tiny),
                      tf.minimum(ratio, 1.0), tf.zeros_like(ratio))
    product = factors * shrunk
    product = tf.where(product < tiny, tf.zeros_like(product), product)
    return tf.where(again <= first, factors, product)


def _recomputed(rows: Rows, output_grads: tf.Tensor, num_views: int, chunks: int,
                transform: Callable[[tf.Tensor], tf.Tensor],
                finish: Callable[[tf.Tensor], tf.Tensor]):
    """`(squares, weighted_sum)` of the direct form, its gradients built twice, chunk by chunk.

    Book-keeping's memory (Bu et al. 2023: one layer's per-example tensors
    alive at a time) for a held vector: the squares come from `chunks`
    consecutive slices of the batch, one after the other (a while loop),
    each chunk's per-example gradients `transform(rows.gradients(...))`
    dropped after its norm; `weighted_sum(factors)` builds them again the
    same way, chunk by chunk, and adds `fl(f_i s_i) v_i` with `fl(f_i s_i)
    = reclip_factors(f, first, again)`, `again` the recomputed vector's own
    `held_squares`. So the bound of `held_squares` holds for what is added
    even if the second build differs from the first (s_i < 1 then; s_i = 1
    where it is the same vector). The chunks' sums are added in float32, as
    any batch's (not counted: see "Rounding").
    """
    batch = output_grads.shape[0] // num_views
    size = batch // chunks

    def split(t):
        return tf.reshape(t, [chunks, size * num_views, *t.shape[1:]])

    source, grads = split(rows.source), split(output_grads)

    def held(i):
        return transform(rows.gradients(grads[i], num_views, source=source[i]))

    shape = []  # the held vector's static shape, from the first trace

    def squares_of(i, out):
        vector = held(i)
        shape[:] = vector.shape[1:]
        return i + 1, out.write(i, held_squares(vector))

    _, out = tf.while_loop(lambda i, _: i < chunks, squares_of,
                           (tf.constant(0), tf.TensorArray(NORM_DTYPE, size=chunks,
                                                           element_shape=[size])),
                           parallel_iterations=1)
    squares = tf.reshape(out.stack(), [batch])

    def weighted_sum(factors):
        factors = tf.reshape(tf.cast(factors, tf.float32), [chunks, size])
        first = tf.reshape(squares, [chunks, size])

        def add(i, total):
            vector = held(i)
            chunk_factors = reclip_factors(factors[i], first[i], held_squares(vector))
            return i + 1, total + clipping.weighted_sum(chunk_factors, vector)

        _, total = tf.while_loop(lambda i, _: i < chunks, add,
                                 (tf.constant(0), tf.zeros(shape, tf.float32)),
                                 parallel_iterations=1)
        return finish(total)

    return squares, weighted_sum
