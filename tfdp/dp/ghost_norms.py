"""Per-example gradient norms without per-example gradients ("ghost norms").

A layer computes its output `z` from its input activations `a` and its
variables; the gradient of example i's loss with respect to a variable
depends only on `a_i` and on `g_i = dL_i / dz_i`, which one ordinary
backward pass of the summed loss gives for the whole batch at once. The rules
here compute each example's SQUARED L2 norm of that gradient from `(a, g)`
alone, without materializing it where a cheaper form exists (Goodfellow
2015; Li et al. 2022, Sec. 4, "ghost clipping"; Bu et al. 2022, mixed ghost
clipping; Kong, Ribero & Velegkas 2024 for convolutions):

| parameter                    | per-example gradient                 | rule                         |
|------------------------------|--------------------------------------|------------------------------|
| dense / conv kernel          | sum_r a_r g_r^T over rows r          | `kernel_sq_norms`            |
| conv kernel (rows: patches)  | the above                            | `conv2d_kernel_sq_norms`     |
| weight-standardized kernel   | the above, chained through WS        | `ws_kernel_sq_norms`         |
| einsum kernel (EinsumDense)  | the above, input/output as rows      | `einsum_kernel_sq_norms`     |
| depthwise conv kernel        | sum_r a_rc g_rc^T per channel c      | `depthwise_kernel_sq_norms`  |
| grouped conv kernel          | sum_r a_rg g_rg^T per group g    | `grouped_conv2d_kernel_sq_norms` |
| embedding table              | g_r scattered into row id_r          | `embedding_sq_norms`         |
| bias, offset (beta)          | sum_r g_r                            | `broadcast_sq_norms`         |
| scale (gamma, gain, skip)    | sum_r x_r * g_r                      | `broadcast_sq_norms`         |

The rows r of one example are its positions (conv output pixels, sequence
steps) and, with augmentation multiplicity, its K views: an example's
gradient is the sum over all of them (its loss is the mean over views, whose
1/K is already in `g`), so its norm is the norm of that sum, never a sum of
the views' norms. Every rule therefore takes `num_views` and treats the K
consecutive rows of the flattened `[batch * K, ...]` tensors jointly.

Kernel gradients have two forms, and `choose_form` picks one for the static
shapes and the device's plan (by what each rule really computes and holds):
the DIRECT form builds the per-example gradient `[batch, fan_in, fan_out]`
(cost R * fan_in * fan_out per example, as the plain step's kernel gradient)
and the GRAM form never does, summing `(A A^T) * (G G^T)` over the R x R row
pairs (cost R^2 * (fan_in + fan_out), six passes on a GPU or TPU; Li et al.
2022, eq. (4)). A convolution's direct form comes from its patches on a CPU
and from one grouped convolution on a GPU or TPU (`conv2d_example_gradients`).
There, a kernel whose per-example gradient is larger than what it is built
from (the example's input region and output gradients) is not held but
built twice, chunk by chunk of the batch: once for its norms, once for the
weighted sum, which clips the second build again to the first one's norm
(`_recomputed`, `reclip_factors`): one layer's chunk of per-example
gradients in memory at a time, the memory of Bu et al. 2023's book-keeping.

Every rule returns `(squares, weighted_sum)`: float32 `[batch]`, per
example an upper bound on the squared norm of what `weighted_sum` adds for
it (per unit factor), at the matmul precision the device really uses (see
"Rounding" below), and a function `weighted_sum(factors)` that returns
`sum_i factors[i] * gradient_i` for each parameter, float32, from the same
per-example gradients: those the rule held (direct-form kernels, biases,
scales), or, for Gram-form kernels, from the same centred rows and output
gradients as the norm (the "book-keeping" of Bu et al. 2022, Sec. 3.2,
without a second backward pass). No float64 anywhere: every product and sum
whose rounding the bound covers goes through `tfdp.dp.precision`. A zero
factor drops its example even where its gradient is inf or nan (as
`tfdp.dp.clipping.weighted_sum`).

Pure TensorFlow on tensors: nothing here knows about Keras models. Which
layer has which rule is kept in a registry (`register_layer_rule`,
`find_layer_rule`) that `tfdp.training` fills with the Keras layer classes.
"""

import dataclasses
import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tfdp.dp import clipping
from tfdp.dp import compiler_checks
from tfdp.dp import device_arithmetic
from tfdp.dp import precision

DIRECT = "direct"
GRAM = "gram"


# -- Registry: layer class -> rule (filled by tfdp.training) ------------------

_LAYER_RULES: dict = {}


class UnsupportedLayer(Exception):
    """A registered rule cannot handle this instance (e.g. a LoRA kernel).

    Raised by a rule before it records anything; the layer then keeps the
    vectorized per-example path for its variables.
    """


def register_layer_rule(layer_class: type, rule: Callable[..., Any]) -> None:
    """Registers `rule` for instances of exactly `layer_class`.

    Subclasses are not matched: a subclass may change the forward pass (as
    `WSConv2D` does to `Conv2D`), so it needs a rule of its own.

    Args:
      layer_class: a layer class (the registry never imports Keras itself).
      rule: whatever the caller dispatches to; `tfdp.training.ghost_clipping`
        registers its tap functions here.
    """
    _LAYER_RULES[layer_class] = rule


def find_layer_rule(layer: Any) -> Optional[Callable[..., Any]]:
    """The rule registered for `type(layer)`, or None."""
    return _LAYER_RULES.get(type(layer))


# -- Rows: an example's positions and views -----------------------------------


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
      standardized: a weight-standardized kernel (`ws_kernel_sq_norms`).

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


# -- Kernels --------------------------------------------------------------------

# Patches larger than this many floats per example are built one kernel row
# at a time (a WRN-16-4 stage-1 conv has 590k: 150 MB at B = 64).
_BLOCK_FLOATS = 2**14


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
        `order[f]` of W (see `conv2d_patches`).
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
        convolution (`conv2d_patches`); the direct form uses it where
        `grouped_conv_gradients()` says so. `source`: the examples' slice of
        `source` to read instead (a chunk of the batch, `_recomputed`).
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
#   adding e_w S to it (`_Gram`). Weight standardization's projection adds its
#   own terms (`ws_kernel_sq_norms`).
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


# Where a direct-form conv kernel on the grouped route is RECOMPUTED instead of held (issue
# 35): None follows the device (`recomputed_gradients`); True or False forces it.
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
    return recompute_chunk_count(images // num_views)


def recompute_chunk_count(batch: int) -> int:
    """The chunks a recomputed kernel's batch of `batch` examples is cut into (a divisor of it).

    The largest divisor of `batch` up to `RECOMPUTE_CHUNKS` that leaves at
    least `RECOMPUTE_CHUNK_EXAMPLES` examples per chunk (1 for a small batch):
    a chunk's per-example gradients are then at most 1/8 of the batch's,
    and a GPU's grouped convolution still gets 8 or more examples at a time.
    """
    wanted = max(1, min(RECOMPUTE_CHUNKS, batch // RECOMPUTE_CHUNK_EXAMPLES))
    return max(n for n in range(1, wanted + 1) if batch % n == 0)


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
      error: `[batch]`, a bound on |squares - |h|^2| (see "Rounding").
      support: `[batch]`, an upper bound on S = sum_r |x_r| |y_r|.
      row_norms: `[batch, R + 1]`, upper bounds on |x_r|.
      y: `[batch, R + 1, fan_out]`, the (scaled) output gradients and s.
      means: per block of rows, `[batch, F_k]` (None without centring).
      row_means: None, or `[batch, R]`: each row's mean over its columns,
        subtracted first (`_centred_columns`; weight standardization).
      weighted_error: e_w: the weighted sum adds, for one example, a vector
        within `e_w f S` of `f h`.
      sums: with `unit`, `[batch, R + 1]`, sum_k x_rk as computed (WS).
      along: with `unit`, `[batch, R + 1, fan_out]`, u_o . x_r as computed (WS).
      sums_error, along_error: their errors, per |x_r| (see `ws_kernel_sq_norms`).
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
                a = _centred_columns(tf.where(keep3, a, 0.0), row_means)
                if mean is not None:
                    mean = tf.where(keep[:, None], mean, 0.0)
                return _contract_rows(_rows_with_mean(a, mean), y)

            return finish(tf.concat(_one_block_at_a_time(rows, num_views, block_sum), axis=0))

        return weighted_sum


def _gram_form(rows: Rows, output_grads: tf.Tensor, num_views: int, *,
               scale: Optional[tf.Tensor] = None, unit: Optional[tf.Tensor] = None,
               centre_rows: bool = False) -> _Gram:
    """The centred Gram form of `h = sum_r a_r g_r^T` per example (see "Rounding").

    `g_r` is the float32 output gradient, times `scale` (float32 `[fan_out]`,
    WS) if given. Each example's rows and output gradients are first scaled
    by powers of two (`_Gram`; `tfdp.dp.precision`, "Range"). With `unit`
    (float32 `[F, fan_out]` in a's column order, WS) also each row's sum and
    its products with the unit vectors. With `centre_rows`, the rows are
    first centred over their columns (`_centred_columns`, with
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
        a = _centred_columns(a, row_means)
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
    xi = _root(precision.upper(tf.add_n([p["norms"] for p in parts]), norm_error))
    n_grams, width_o = _gram(y)
    e_o = precision.chunked_contraction_error(width_o, n_grams.shape[1])
    n = _staged_over(n_grams, 1)
    eta = _root(precision.upper(precision.staged_sum(tf.square(y)),
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


def kernel_sq_norms(rows: Rows, output_grads: tf.Tensor, *, num_views: int = 1):
    """Per-example squared norm of the gradient of a kernel W in `z = a @ W`.

    Every axis of `a` between the first and the last is a position (sequence
    step, conv patch) of the example, and so are its K views: the example's
    gradient is `sum_r a_r g_r^T` over all of them. `choose_form` picks the
    direct form (held per-example gradients) or the centred Gram form; either
    way the squares are an upper bound on the squared norm of what the
    weighted sum adds for the example (see "Rounding" above), in float32.

    Args:
      rows: the input rows `a`, `[batch * K, ..., F]` (`Rows.of(inputs)` for a
        dense layer, `conv2d_patches` for a convolution).
      output_grads: float32 `[batch * K, ..., fan_out]`, `dL/dz`.
      num_views: K, the augmult views of each example (consecutive rows).

    Returns:
      `(squares, weighted_sum)`: float32 `[batch]`; `weighted_sum(factors)`
      gives float32 `[F, fan_out]` in W's row order.
    """
    fan_out = output_grads.shape[-1]
    form = choose_form(_static_rows(output_grads, num_views), rows.fan_in, fan_out)
    if form == DIRECT:
        finish = lambda s: rows.to_kernel_rows(tf.transpose(s))  # noqa: E731
        chunks = _recompute_chunks(rows, output_grads, num_views)
        if chunks:
            return _recomputed(rows, output_grads, num_views, chunks, lambda h: h, finish)
        held = _direct_products(rows, output_grads, num_views)
        squares = held_squares(held)
        return squares, _summer(held, squares, lambda s: rows.to_kernel_rows(tf.transpose(s)))
    gram = _gram_form(rows, output_grads, num_views)
    norm = _root(gram.bound()) + gram.weighted_error * gram.support + gram.floor
    return gram.unscaled_squares(norm), gram.weighted_sum(num_views, rows.to_kernel_rows)


def _same_padding(size, kernel, stride, dilation):
    """TensorFlow's "SAME" padding (before, after) of one spatial axis."""
    out = -(-size // stride)
    total = max((out - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)
    return total // 2, total - total // 2


def conv2d_patches(inputs: tf.Tensor, *, kernel_size, strides, dilation_rate,
                   padding: str) -> Rows:
    """The input patch of every output position of a 2D convolution (NHWC), as `Rows`.

    Built from one slice of the (padded) input per kernel offset, which on
    CPU is several times faster than `tf.image.extract_patches`. A stride s
    > 1 is first folded into the channels with `tf.nn.space_to_depth`, so that
    every slice is contiguous (TensorFlow's strided slices are slow). When s
    divides the kernel size (Tramer & Boneh's 8x8 and 4x4 kernels with stride
    2) whole s x s blocks are sliced, s^2 times fewer slices; the patch's
    entries then come in another order (`Rows.order`). Patches of more than
    `_BLOCK_FLOATS` floats per example come in one block per kernel row.

    Args:
      inputs: float32 `[n, height, width, channels]`.
      kernel_size, strides, dilation_rate: pairs of ints, as the convolution's.
      padding: "same" or "valid" (TensorFlow's padding rule, as `tf.nn.conv2d`).

    Returns:
      `Rows` whose blocks concatenate to `[n, out_height, out_width, F]`,
      F = kh * kw * channels, in the (kh, kw, channels) order of a
      `[kh, kw, channels, filters]` kernel unless `order` says otherwise.
    """
    (kh, kw), (sh, sw), (dh, dw) = kernel_size, strides, dilation_rate
    height, width, channels = inputs.shape[1:]
    fan_in = kh * kw * channels
    original = inputs

    def rebuild(factors):  # the same patches of the input times a factor per image
        return conv2d_patches(_times_per_image(original, factors), kernel_size=kernel_size,
                              strides=strides, dilation_rate=dilation_rate, padding=padding)

    def row_sums():  # the patches of the channels' sum, summed: 1 / channels of the work
        if channels == 1:
            summed = original
        else:
            summed = tf.reduce_sum(original, axis=-1, keepdims=True)
        ones = conv2d_patches(summed, kernel_size=kernel_size, strides=strides,
                              dilation_rate=dilation_rate, padding=padding)
        return tf.reduce_sum(tf.concat([b() for b in ones.blocks], axis=-1), axis=-1)

    if height is None or width is None or not (sh == sw and (sh == 1 or dh == dw == 1)):
        # The largest entry from the patches themselves (`Rows.largest_entry`): an input
        # entry no patch reads must not set the scale (an inf there would turn it off).
        return Rows((lambda: tf.image.extract_patches(
            inputs, sizes=[1, kh, kw, 1], strides=[1, sh, sw, 1], rates=[1, dh, dw, 1],
            padding=padding.upper()),), fan_in, None, row_sums, None, rebuild)
    if padding.lower() == "same":
        pad_h = _same_padding(height, kh, sh, dh)
        pad_w = _same_padding(width, kw, sw, dw)
        inputs = tf.pad(inputs, [[0, 0], pad_h, pad_w, [0, 0]])
        height, width = height + sum(pad_h), width + sum(pad_w)
    out_h = (height - (kh - 1) * dh - 1) // sh + 1
    out_w = (width - (kw - 1) * dw - 1) // sw + 1
    # What the patches read: rows and columns a strided "valid" window never reaches are
    # left out of the largest entry (an inf or a 1e30 there would set the Gram form's scale).
    read = inputs[:, :(out_h - 1) * sh + (kh - 1) * dh + 1, :(out_w - 1) * sw + (kw - 1) * dw + 1]
    if (kh - 1) * dh + 1 < sh or (kw - 1) * dw + 1 < sw:
        # A window narrower than its stride (a 1x1 stride-2 shortcut) also skips the rows or
        # columns between windows: the largest entry over each kernel offset's own entries.
        padded = inputs

        def magnitude():
            return tf.reduce_max(tf.stack([
                _largest_entry(padded[:, y:y + (out_h - 1) * sh + 1:sh,
                                      x:x + (out_w - 1) * sw + 1:sw])
                for y in range(0, kh * dh, dh) for x in range(0, kw * dw, dw)]), axis=0)
    else:
        def magnitude():
            return _largest_entry(read)
    s = sh
    if s > 1:
        inputs = tf.pad(inputs, [[0, 0], [0, -height % s], [0, -width % s], [0, 0]])
        inputs = tf.nn.space_to_depth(inputs, s)  # channel (a, b, c) of block (i, j)
    order = None
    if s > 1 and kh % s == 0 and kw % s == 0:
        # Row i of blocks (i, j): patch entry (i, j, a, b, c) is kernel entry
        # (i * s + a, j * s + b, c).
        slices = [[(i, j, 0, s * s * channels) for j in range(kw // s)] for i in range(kh // s)]
        i, j, a, b, c = np.meshgrid(np.arange(kh // s), np.arange(kw // s), np.arange(s),
                                    np.arange(s), np.arange(channels), indexing="ij")
        order = (((i * s + a) * kw + (j * s + b)) * channels + c).ravel()
    else:  # kernel offset (y, x) reads block (y // s, x // s), channels of (y % s, x % s)
        slices = [[(y // s, x // s, (y % s * s + x % s) * channels, channels)
                   for x in range(0, kw * dw, dw)] for y in range(0, kh * dh, dh)]

    def block(row_slices):
        return lambda: tf.concat([inputs[:, i:i + out_h, j:j + out_w, first:first + size]
                                  for i, j, first, size in row_slices], axis=-1)

    if out_h * out_w * fan_in <= _BLOCK_FLOATS:
        slices = [[piece for row in slices for piece in row]]
    gradients = None
    if dh == dw:  # depthwise convolutions take one stride and one dilation
        def gradients(output_grads, num_views, source=None):
            source = read if source is None else source
            h = conv2d_example_gradients(source, output_grads, kernel_size=kernel_size,
                                         strides=strides, dilation_rate=dilation_rate,
                                         num_views=num_views)
            h = tf.reshape(h, [-1, fan_in, h.shape[-1]])  # [batch, F, O], kernel order
            h = tf.transpose(h, [0, 2, 1])
            return h if order is None else tf.gather(h, order, axis=2)  # a's column order
    return Rows(tuple(block(row) for row in slices), fan_in, order, row_sums,
                magnitude, rebuild, gradients,
                read if gradients is not None else None)


# Where the direct form of a convolution's kernel builds its per-example gradients with one
# grouped convolution (`conv2d_example_gradients`) instead of patches: None follows the
# device (`grouped_conv_gradients`); True or False forces it (tests, benchmarks).
GROUPED_CONV_GRADIENTS: Optional[bool] = None


def grouped_conv_gradients() -> bool:
    """Whether direct-form conv kernels use `conv2d_example_gradients` (read at trace time).

    `GROUPED_CONV_GRADIENTS` if set, else `device_arithmetic.splits()`: on a GPU or a
    TPU (whose matmuls round their inputs), where a grouped convolution is the
    device's own kernel and patches cost memory and bandwidth; not on a CPU,
    where TensorFlow's and XLA's grouped convolutions are 1.3-24x slower than
    the patches (docs/design/step_cost.md, "Grouped convolutions").
    """
    if GROUPED_CONV_GRADIENTS is not None:
        return GROUPED_CONV_GRADIENTS
    return device_arithmetic.splits()


def conv2d_example_gradients(inputs: tf.Tensor, output_grads: tf.Tensor, *, kernel_size,
                             strides, dilation_rate, num_views: int = 1) -> tf.Tensor:
    """Every example's kernel gradient of a 2D convolution, as grouped convolutions.

    Example i's gradient `dW[y, x, c, o] = sum_{p, q} a_i[p s + y d, q s + x d, c]
    g_i[p, q, o]` (stride s, dilation d, the input already padded) is a
    correlation of its input with its output gradient as the filter; with
    the batch as channels it is a depthwise convolution
    (`tf.nn.depthwise_conv2d`; under XLA a convolution with
    `feature_group_count` = batch, as JAX's `vmap` of a kernel gradient
    lowers): no patches, and the multiply-adds of the plain step's kernel
    gradient (Rochette et al. 2019; the issue's XLA direction). A stride s
    takes one such convolution per phase of the kernel offsets (at most s^2),
    each over its input phase `a[r::s, t::s]`. The K views of an example are
    summed, one view at a time. One pass at the device's precision, like any
    held vector (`_direct_products`).

    Args:
      inputs: float32 `[batch * K, height, width, channels]`, padded: the
        region the convolution's windows read (`conv2d_patches`' `read`).
      output_grads: float32 `[batch * K, out_height, out_width, filters]`.
      kernel_size, strides, dilation_rate: pairs of ints, the convolution's;
        strides and dilations equal on both axes, not both above 1.
      num_views: K.

    Returns:
      float32 `[batch, kh, kw, channels, filters]`.

    Raises:
      ValueError: unequal strides or dilations, or both above 1 (a depthwise
        convolution takes one or the other).
    """
    (kh, kw), (sh, sw), (dh, dw) = kernel_size, strides, dilation_rate
    if sh != sw or dh != dw or (sh > 1 and dh > 1):
        raise ValueError(f"conv2d_example_gradients: strides {strides} and dilation_rate "
                         f"{dilation_rate} must be equal on both axes and not both above 1.")
    channels, filters = inputs.shape[-1], output_grads.shape[-1]
    s = sh
    # Stride s: offset y = s * alpha + r reads input row (p + alpha) s + r, row p + alpha of
    # the input's phase r (`a[r::s]`): one stride-1 correlation per phase (r, t), each of
    # the offsets it owns only (a dilated filter would compute every phase for every
    # offset: 4x the work of a strided 1x1 convolution), interleaved afterwards.
    phases_h, phases_w = range(min(s, kh)), range(min(s, kw))
    total = None
    for view in range(num_views):
        a = inputs[view::num_views] if num_views > 1 else inputs
        g = output_grads[view::num_views] if num_views > 1 else output_grads
        # [oh, ow, batch, O]
        kernel = device_arithmetic.device_rounded(tf.transpose(g, [1, 2, 0, 3]))
        out = {}
        for r in phases_h:
            for t in phases_w:
                phase = a[:, r::s, t::s] if s > 1 else a
                # [C, H, W, n]
                lhs = device_arithmetic.device_rounded(tf.transpose(phase, [3, 1, 2, 0]))
                # Offset (y, x) reads input (p s + y d): the input strided by d.
                out[r, t] = tf.nn.depthwise_conv2d(lhs, kernel, strides=[1, dh, dh, 1],
                                                   padding="VALID")  # [C, ka_r, kb_t, n O]
        if s > 1:
            out = _interleave_phases(out, s, kh, kw)
        else:
            out = out[0, 0]
        total = out if total is None else total + out  # [channels, kh, kw, batch * filters]
    total = tf.reshape(total, [channels, kh, kw, -1, filters])
    return tf.transpose(total, [3, 1, 2, 0, 4])


def _interleave_phases(out: dict, s: int, kh: int, kw: int) -> tf.Tensor:
    """`{(r, t): [C, ka_r, kb_t, n]}` (offsets s alpha + r, s beta + t) -> `[C, kh, kw, n]`."""
    ka, kb = -(-kh // s), -(-kw // s)
    first = out[0, 0]
    rows = []
    for r in range(s):
        row = []
        for t in range(s):
            if (r, t) in out:
                block = out[r, t]
                pad = [[0, 0], [0, ka - block.shape[1]], [0, kb - block.shape[2]], [0, 0]]
                row.append(tf.pad(block, pad))
            else:  # a phase past the kernel: no offsets (cropped below)
                row.append(tf.zeros_like(first))
        rows.append(tf.stack(row, axis=3))  # [C, ka, kb, s(t), n]
    grid = tf.stack(rows, axis=2)  # [C, ka, s(r), kb, s(t), n]
    shape = tf.shape(first)
    grid = tf.reshape(grid, [shape[0], ka * s, kb * s, shape[3]])
    return grid[:, :kh, :kw]


def conv2d_kernel_sq_norms(
    inputs: tf.Tensor,
    output_grads: tf.Tensor,
    *,
    kernel_size,
    strides,
    dilation_rate,
    padding: str,
    num_views: int = 1,
):
    """Per-example squared norm of a Conv2D kernel's gradient (NHWC, one group).

    The convolution is a dense layer applied to every input patch
    (`conv2d_patches`), so the example's rows are its K x P patches.

    Args:
      inputs: float32 `[batch * K, height, width, in_channels]`.
      output_grads: float32 `[batch * K, out_height, out_width, filters]`, `dL/dz`
        of the convolution's output (before bias and activation).
      kernel_size, strides, dilation_rate, padding: the convolution's.
      num_views: K.

    Returns:
      `(squares, weighted_sum)`: float32 `[batch]`; `weighted_sum(factors)`
      gives float32 `[kh, kw, in_channels, filters]`.
    """
    rows = conv2d_patches(inputs, kernel_size=kernel_size, strides=strides,
                          dilation_rate=dilation_rate, padding=padding)
    squares, weighted_sum = kernel_sq_norms(rows, output_grads, num_views=num_views)
    shape = [*kernel_size, inputs.shape[-1], output_grads.shape[-1]]
    return squares, lambda factors: tf.reshape(weighted_sum(factors), shape)


def ws_kernel_sq_norms(
    rows: Rows,
    output_grads: tf.Tensor,
    kernel: tf.Tensor,
    *,
    epsilon: float,
    num_views: int = 1,
):
    """Per-example squared norm of the gradient wrt a weight-STANDARDIZED kernel's variable.

    The layer computes `z = a @ U` with `U = WS(W)`: for every output
    channel o, with `c_o = W_o - mean(W_o)` over the fan-in F and
    `s_o = max(|c_o|^2, epsilon)^(-1/2)`, `U_o = s_o c_o`
    (`tfdp.models.WSConv2D`; |c_o|^2 = F var_o). The optimizer updates W, so
    its gradient is what is clipped. With `h_o = dL/dU_o` (the per-example
    kernel gradient of `z = a @ U`), the chain rule through WS gives

        dL/dW_o = s_o (I - 1 1^T / F - u_o u_o^T) h_o,  u_o = U_o,

    an orthogonal projection P_o (u_o is a unit vector orthogonal to 1) when
    `|c_o|^2 >= epsilon`; below it the scale is the constant epsilon^(-1/2)
    and the u_o term drops out (the `maximum` passes no gradient to |c_o|^2).
    Everything is float32; `u_o` is computed once per step (float32, so P_o is
    a projection only up to rounding, which the bound covers).

    The projection removes most of h on a nearly constant input (h is then
    nearly parallel to 1), so its norm must not be taken as a naive
    difference of float32 terms. Direct form (small kernels):
    every example's `s_o P_o h_o` is built, held, and its own norm taken (a
    sum of squares: no cancellation). Gram form: the weighted sum of the
    centred rows' products (see "Rounding") is projected once, and

        |P h|^2 = |h|^2 - sum_o (1.h_o)^2 / F - sum_o (u_o.h_o)^2
                  + sum_o (|u_o|^2 - 1)(u_o.h_o)^2 + 2 sum_o (1.h_o)(1.u_o)(u_o.h_o) / F

    (the last two: P_o is built from the float32 u_o), each term from the
    rows (`1.h_o = sum_r (sum_k x_rk) y_ro`, `u_o.h_o = sum_r (x_r.u_o) y_ro`),
    with a bound on the rounding of each; the norm returned also covers the
    projection's own rounding in the weighted sum. The Gram form first
    centres every row over its F columns (`Rows.row_means`): the same P_o h_o,
    with nearly no component along 1 left for the bound to cancel.

    Args:
      rows: the rows `a` (`Rows.of(inputs)` or `conv2d_patches`), F columns.
      output_grads: float32 `[batch * K, ..., filters]`, `dL/dz` of `z = a @ U`
        (before any gain or bias).
      kernel: the variable W, float32 `[..., filters]` with `prod(shape[:-1]) = F`.
      epsilon: the layer's lower bound on |c_o|^2.
      num_views: K.

    Returns:
      `(squares, weighted_sum)`: float32 `[batch]`; `weighted_sum(factors)`
      gives the weighted sum of the per-example gradients wrt W, float32
      `kernel.shape`.

    Reference: Qiao et al. 2019 (weight standardization); De et al. 2022, App. C.1.
    """
    fan_out = kernel.shape[-1]
    fan_in = math.prod(kernel.shape[:-1])
    if fan_in == 1:  # W - mean(W) is 0 whatever W is: the gradient is exactly 0
        batch = tf.shape(output_grads)[0] // num_views
        return (tf.zeros([batch], NORM_DTYPE),
                lambda factors: tf.zeros(kernel.shape, tf.float32))
    w = tf.reshape(tf.cast(tf.convert_to_tensor(kernel), tf.float32), [fan_in, fan_out])
    if rows.order is not None:
        w = tf.gather(w, rows.order)  # W's rows in the order of a's columns
    columns = tf.transpose(w)  # [fan_out, F]
    centred = columns - precision.staged_sum(columns)[:, None] / fan_in
    variance = precision.staged_sum(tf.square(centred))  # F var_o, [fan_out]
    scale = 1.0 / tf.sqrt(tf.maximum(variance, epsilon))
    on_sphere = tf.cast(variance >= epsilon, tf.float32)
    unit_t = centred * (scale * on_sphere)[:, None]  # u_o, or 0 below epsilon; [fan_out, F]

    def project(h):  # P_o h_o for every o; h float32 [..., fan_out, F]
        mean = precision.staged_sum(h) / fan_in
        along = precision.staged_sum(h * unit_t)
        return h - mean[..., None] - unit_t * along[..., None]

    def to_kernel(summed):  # [fan_out, F] in a's column order -> kernel.shape
        return tf.reshape(rows.to_kernel_rows(tf.transpose(summed)), kernel.shape)

    # P_o removes the direction 1 from h_o: centring every row over its columns first
    # removes it from h exactly, so that a nearly constant input (h nearly parallel to 1)
    # leaves nothing large for P_o to cancel in float32.
    form = choose_form(_static_rows(output_grads, num_views), fan_in, fan_out, True)
    if form == DIRECT:  # held: its float32 projection's rounding is in the vector added
        chunks = _recompute_chunks(rows, output_grads, num_views)
        if chunks:
            return _recomputed(rows, output_grads, num_views, chunks,
                               lambda h: project(h * scale[:, None]), to_kernel)
        held = project(tf.concat(_direct_products(rows, output_grads, num_views), axis=-1)
                       * scale[:, None])
        squares = held_squares(held)
        return squares, _summer(held, squares, to_kernel)

    gram = _gram_form(rows, output_grads, num_views, scale=scale, unit=tf.transpose(unit_t),
                      centre_rows=True)
    squares = gram.unscaled_squares(_ws_gram_norm(gram, unit_t, fan_in))
    return squares, gram.weighted_sum(
        num_views, lambda summed: to_kernel(project(tf.transpose(summed))))


def _ws_gram_norm(gram: _Gram, unit_t: tf.Tensor, fan_in: int) -> tf.Tensor:
    """A bound on |v| / f for the projected Gram-form weighted sum, scaled units (`_Gram`).

    With A = |h|^2, X = sum_o x_o^2 (x_o = 1.h_o / sqrt(F)), Y = sum_o y_o^2
    (y_o = u_o.h_o): `|P h|^2 <= A - X - Y + sum_o delta_o y_o^2 + 2 sum_o
    eps_o |x_o| |y_o|`, delta_o >= ||u_o|^2 - 1|, eps_o >= |1.u_o| / sqrt(F).
    x_o and y_o are computed within e_x T_o and e_y T_o (T_o = sum_r |x_r| |y_ro|,
    sum_o T_o^2 <= S^2), so X and Y within `2 e S sqrt(X) + e^2 S^2` plus their
    own sums' rounding. The weighted sum adds `fl(P W)` with `W` within
    `e_w f S` of `f h` (`_Gram`); P's rounding adds at most `c_P u |W|`.
    """
    root_f = math.sqrt(fan_in)
    chain_f = precision.sum_chain(fan_in)
    num_rows = gram.y.shape[1]
    e_rows = precision.gamma(precision.sum_chain(num_rows) + 1)
    # The float32 unit vectors: how far P (built from them) is from a projection.
    unit_sq = precision.staged_sum(tf.square(unit_t))  # [fan_out]
    delta = (tf.abs(1.0 - unit_sq) + 2.0 * precision.square_sum_error(fan_in) * unit_sq
             + 2 * _U)
    unit_norm = _root(precision.upper(unit_sq, 2.0 * precision.square_sum_error(fan_in)))
    eps = (tf.abs(precision.staged_sum(unit_t))
           + 1.01 * precision.gamma(chain_f) * root_f * unit_norm) / root_f
    y, support = gram.y, gram.support
    ones = precision.staged_sum(gram.sums[:, :, None] * y, axis=1) / root_f  # x_o [batch, O]
    along = precision.staged_sum(gram.along * y, axis=1)  # y_o, [batch, O]
    spread = precision.upper(  # T_o
        precision.staged_sum(gram.row_norms[:, :, None] * tf.abs(y), axis=1),
        2 * precision.sum_error(num_rows))
    e_x = gram.sums_error + (1 + gram.sums_error) * e_rows + 2 * _U
    e_y = (gram.along_error + (1 + gram.along_error) * e_rows) * unit_norm  # [fan_out]
    e_y_max = tf.reduce_max(e_y)
    x_sq = precision.staged_sum(tf.square(ones))
    y_sq = precision.staged_sum(tf.square(along))
    e_sum = precision.gamma(precision.sum_chain(ones.shape[-1]) + 1)
    err_x = 2 * e_x * support * tf.sqrt(x_sq) + e_x**2 * tf.square(support) + e_sum * x_sq
    err_y = (2 * e_y_max * support * tf.sqrt(y_sq) + tf.square(e_y_max * support)
             + e_sum * y_sq)
    x_top = tf.abs(ones) + e_x * spread
    y_top = tf.abs(along) + e_y * spread
    deviation = precision.staged_sum(delta * tf.square(y_top) + 2 * eps * x_top * y_top)
    whole = gram.bound()  # |h|^2
    projected = (whole - x_sq - y_sq + precision.upper(err_x + err_y + deviation, 0.01)
                 + 4 * _U * (whole + x_sq + y_sq))
    projected = precision.upper(tf.maximum(projected, 0.0), 4 * _U)
    stretch = tf.maximum(1.0, tf.reduce_max(delta + eps))  # the norm of P: 1 unless u_o is off
    slack = gram.weighted_error * support + gram.floor
    rounding = 1.03 * (2 * (chain_f + 2) + 8) * _U
    norm = _root(projected) + stretch * slack + rounding * (_root(whole) + slack)
    return precision.upper(norm, 8 * _U)


# -- Broadcast parameters: biases, offsets and scales -------------------------


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
      held vector (the module's "Rounding").
    """
    terms = output_grads if inputs is None else inputs * output_grads
    size = math.prod(parameter_shape)
    batch = tf.shape(terms)[0] // num_views
    terms = tf.reshape(terms, [batch, -1, size])  # [batch, R, size]
    if terms.shape[1] is None:  # unknown positions: a plain float32 sum (held all the same)
        per_example = tf.reduce_sum(terms, axis=1)
    else:  # held: any float32 sum; staged, as accurate as the float32 backward pass
        per_example = precision.staged_sum(terms, axis=1)
    squares = held_squares(per_example)
    return squares, _summer(per_example, squares,
                            lambda summed: tf.reshape(summed, parameter_shape))


# -- Kernels of other shapes: einsum, depthwise, embedding tables -------------


def einsum_kernel_geometry(equation: str, kernel_rank: int) -> Tuple[int, int]:
    """`(example_axes, contracted)` of an EinsumDense equation that `kernel_sq_norms` covers.

    Covered: `"<free><contracted>,<contracted><kernel_free>-><free><kernel_free>"`:
    the kernel contracts the LAST input axes, in order, and its other axes
    are the LAST output axes, in order, after the input's free axes (the first
    of which is the batch). Then `z = a @ W` with `a` the input reshaped to
    `[..., prod(contracted)]` and W the kernel reshaped to `[prod(contracted),
    prod(kernel_free)]`. Multi-head attention's projections are of this form
    (`"abc,cde->abde"`, `"abcd,cde->abe"`), as is Dense (`"ab,bc->ac"`).

    Args:
      equation: the layer's einsum equation (no ellipsis).
      kernel_rank: the kernel's rank, to check the equation against.

    Returns:
      `(len(free), len(contracted))`, the input's free and contracted axes.

    Raises:
      UnsupportedLayer: for any other equation (an ellipsis, an axis shared by
        input, kernel and output, a reordered output): the layer keeps the
        vectorized path.
    """
    parts = equation.replace(" ", "").split("->")
    operands = parts[0].split(",") if len(parts) == 2 else []
    if "." in equation or len(operands) != 2:
        raise UnsupportedLayer(f"einsum equation {equation!r} is not 'input,kernel->output'")
    (x, w), z = operands, parts[1]
    contracted = "".join(c for c in x if c in w and c not in z)
    free, kernel_free = x[:len(x) - len(contracted)], w[len(contracted):]
    if (not contracted or not free or x != free + contracted or w != contracted + kernel_free
            or z != free + kernel_free or len(set(x + w)) != len(x) + len(kernel_free)
            or len(w) != kernel_rank):
        raise UnsupportedLayer(
            f"einsum equation {equation!r}: its kernel does not contract the input's last "
            "axes into the output's last axes")
    return len(free), len(contracted)


def einsum_kernel_sq_norms(inputs: tf.Tensor, output_grads: tf.Tensor, equation: str,
                           kernel_shape: Sequence[int], *, num_views: int = 1):
    """Per-example squared norm of an EinsumDense kernel's gradient (`kernel_sq_norms`).

    Args:
      inputs: float32 `[batch * K, ...]`, the layer's input.
      output_grads: float32 `[batch * K, ...]`, `dL/dz` of the einsum's output.
      equation: the layer's equation, of the form `einsum_kernel_geometry` covers.
      kernel_shape: the kernel's shape.
      num_views: K.

    Returns:
      `(squares, weighted_sum)`: float32 `[batch]`; `weighted_sum(factors)`
      gives float32 `kernel_shape`.

    Raises:
      UnsupportedLayer: for another equation (`einsum_kernel_geometry`).
    """
    free, contracted = einsum_kernel_geometry(equation, len(kernel_shape))
    fan_in = math.prod(kernel_shape[:contracted])
    fan_out = math.prod(kernel_shape[contracted:])
    x_free, g_free = tf.shape(inputs)[:free], tf.shape(output_grads)[:free]
    a = tf.reshape(inputs, tf.concat([x_free, [fan_in]], 0))
    g = tf.reshape(output_grads, tf.concat([g_free, [fan_out]], 0))
    a.set_shape(inputs.shape[:free].concatenate([fan_in]))
    g.set_shape(output_grads.shape[:free].concatenate([fan_out]))
    squares, weighted_sum = kernel_sq_norms(Rows.of(a), g, num_views=num_views)
    return squares, lambda factors: tf.reshape(weighted_sum(factors), kernel_shape)


def _held_sum(per_example: tf.Tensor, factors: tf.Tensor) -> tf.Tensor:
    """`factors[i] * per_example[i]`, zero (even for inf or nan) where `factors[i] <= 0`."""
    shape = [-1] + [1] * (per_example.shape.rank - 1)  # a batch of unknown size too
    keep = tf.reshape(factors > 0, shape)
    weights = tf.reshape(tf.cast(factors, per_example.dtype), shape)
    return tf.where(keep, per_example * weights, tf.zeros([], per_example.dtype))


def depthwise_kernel_sq_norms(
    inputs: tf.Tensor,
    output_grads: tf.Tensor,
    *,
    kernel_size,
    strides,
    dilation_rate,
    padding: str,
    depth_multiplier: int,
    num_views: int = 1,
):
    """Per-example squared norm of a DepthwiseConv2D kernel's gradient (NHWC).

    Output channel `c * M + m` (M = depth_multiplier, as
    `tf.nn.depthwise_conv2d`) is input channel c's patches times the kernel
    slice `[kh, kw, c, m]`: the gradient is, for each channel,
    `h_c = sum_r a_rc g_rc^T` over the example's K x P patches. A depthwise
    convolution is a grouped one with one input channel per group
    (`grouped_conv2d_kernel_sq_norms`, which computes it).

    Args:
      inputs: float32 `[batch * K, height, width, channels]`.
      output_grads: float32 `[batch * K, out_height, out_width, channels * M]`,
        `dL/dz` of the depthwise convolution's output (before bias and activation).
      kernel_size, strides, dilation_rate, padding: the convolution's.
      depth_multiplier: M >= 1.
      num_views: K.

    Returns:
      `(squares, weighted_sum)`: float32 `[batch]`; `weighted_sum(factors)`
      gives float32 `[kh, kw, channels, M]`.
    """
    channels = inputs.shape[-1]
    squares, weighted_sum = grouped_conv2d_kernel_sq_norms(
        inputs, output_grads, kernel_size=kernel_size, strides=strides,
        dilation_rate=dilation_rate, padding=padding, groups=channels, num_views=num_views)
    shape = [*kernel_size, channels, depth_multiplier]
    return squares, lambda factors: tf.reshape(weighted_sum(factors), shape)


def grouped_conv2d_kernel_sq_norms(
    inputs: tf.Tensor,
    output_grads: tf.Tensor,
    *,
    kernel_size,
    strides,
    dilation_rate,
    padding: str,
    groups: int,
    num_views: int = 1,
):
    """Per-example squared norm of a grouped Conv2D kernel's gradient (NHWC).

    With G groups, input channels `g * Cg .. (g + 1) * Cg - 1` (Cg = C / G)
    feed only output channels `g * Fg .. (g + 1) * Fg - 1` (Fg = filters / G),
    through the kernel slice `[kh, kw, :, g * Fg : (g + 1) * Fg]`, as
    `keras.layers.Conv2D(groups=G)` computes it. ConvNeXt's 7x7 "depthwise"
    convolutions are `Conv2D(groups=C)` (Cg = 1). The gradient of group g is
    `h_g = sum_r a_rg g_rg^T` over the example's K x P patches (a_rg: the
    group's kh kw Cg patch entries). It is built directly (R kh kw Cg filters
    per example, the cost of the convolution itself, and the size of the
    kernel per example), in float32, one block of `conv2d_patches` at a
    time, and HELD: its squared norm is a staged float32 sum of squares and
    the weighted sum adds exactly these gradients (the direct form of the module's
    "Rounding"). G = 1 is an ordinary convolution, which `conv2d_kernel_sq_norms`
    does with the cheaper of both forms.

    Args:
      inputs: float32 `[batch * K, height, width, channels]`.
      output_grads: float32 `[batch * K, out_height, out_width, filters]`,
        `dL/dz` of the convolution's output (before bias and activation).
      kernel_size, strides, dilation_rate, padding: the convolution's.
      groups: G, dividing both channels and filters.
      num_views: K.

    Returns:
      `(squares, weighted_sum)`: float32 `[batch]`; `weighted_sum(factors)`
      gives float32 `[kh, kw, channels / G, filters]`.

    Raises:
      ValueError: if G does not divide the channels and the filters.
    """
    channels, filters = inputs.shape[-1], output_grads.shape[-1]
    if channels % groups or filters % groups:
        raise ValueError(f"groups={groups} must divide the input channels ({channels}) and "
                         f"the filters ({filters}).")
    per_group, out_per_group = channels // groups, filters // groups
    rows = conv2d_patches(inputs, kernel_size=kernel_size, strides=strides,
                          dilation_rate=dilation_rate, padding=padding)
    g = example_rows(output_grads, num_views)  # [batch, R, filters]
    g = tf.reshape(g, [tf.shape(g)[0], -1, groups, out_per_group])

    def block(a):  # [batch, R, F_k], F_k = offsets_k * C with the channel innermost
        a = tf.reshape(a, [tf.shape(a)[0], -1, a.shape[-1] // channels, groups, per_group])
        return precision.einsum("brkgc,brgf->bkgcf", a, g, exact=False)  # held

    h = tf.concat(_one_block_at_a_time(rows, num_views, block), axis=1)  # a's offset order
    if rows.order is not None:  # the same offset for all channels: the order of offsets
        h = tf.gather(h, np.argsort(rows.order[::channels] // channels), axis=1)
    # [batch, kh kw, G, Cg, Fg] -> the kernel's [kh, kw, Cg, G Fg]
    shape = [*kernel_size, per_group, filters]
    h = tf.reshape(tf.transpose(h, [0, 1, 3, 2, 4]), [-1, *shape])
    squares = held_squares(h)
    return squares, _summer(h, squares)


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
    into the table (the direct form of the module's "Rounding").

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
    squares = held_squares(h)

    def weighted_sum(factors):
        weighted = _held_sum(h, factors)
        return tf.math.unsorted_segment_sum(tf.reshape(weighted, [-1, dim]),
                                            tf.reshape(ids, [-1]), vocabulary_size)

    return squares, weighted_sum
