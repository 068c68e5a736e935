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

Kernel gradients have two forms, and `choose_form` picks the cheaper for
the static shapes: the DIRECT form builds the per-example gradient
`[batch, fan_in, fan_out]` (cost R * fan_in * fan_out per example) and the
GRAM form never does, summing `(A A^T) * (G G^T)` over the R x R row pairs
(cost R^2 * (fan_in + fan_out); Li et al. 2022, eq. (4)).

Every rule returns `(squares, weighted_sum)`: the squared norms, float64
`[batch]`, never below the exact ones (see "Rounding" below), and a function
`weighted_sum(factors)` that returns `sum_i factors[i] * gradient_i` for
each parameter, float32, from the same per-example gradients: those the
rule held (direct-form kernels, biases, scales), or, for Gram-form kernels,
in float64 from the same rows and output gradients (the
"book-keeping" of Bu et al. 2022, Sec. 3.2, without a second backward
pass). A zero factor drops its example even where its gradient is inf or
nan (as `tfdp.dp.clipping.weighted_sum`).

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
    return tf.reshape(tensor, [batch, -1, d])


def _static_size(tensor: tf.Tensor) -> Optional[int]:
    """Floats per row of `tensor` [n, ...], or None if not static."""
    inner = tensor.shape[1:]
    return math.prod(inner.as_list()) if inner.is_fully_defined() else None


def _static_rows(tensor: tf.Tensor, num_views: int) -> Optional[int]:
    inner = tensor.shape[1:-1]
    if not inner.is_fully_defined():
        return None
    return num_views * math.prod(inner.as_list())


def choose_form(rows: Optional[int], fan_in: int, fan_out: int) -> str:
    """`GRAM` when R (fan_in + fan_out) < fan_in * fan_out / 2, else `DIRECT`.

    The direct form builds every example's gradient (R fan_in fan_out per
    example, in float32) and holds it until the clip factors are known: the
    clipped sum then adds exactly the vectors whose norms were clipped. The
    Gram form costs R^2 (fan_in + fan_out) per example for the norms, in
    float64 (its terms cancel, see "Rounding"), and R fan_in fan_out float64
    for the clipped sum; it is used where it is more than twice cheaper and
    the per-example gradients would take the most memory: large kernels over
    few positions (WRN-16-4's last stage: 590k vs 164k per example). An
    unknown R (dynamic positions) takes the direct form.
    """
    if rows is not None and fan_in * fan_out > 2 * rows * (fan_in + fan_out):
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
    """

    blocks: Tuple[Callable[[], tf.Tensor], ...]
    fan_in: int
    order: Optional[np.ndarray] = None

    @classmethod
    def of(cls, inputs: tf.Tensor) -> "Rows":
        """The rows of a dense layer's input `[batch * K, ..., fan_in]`, one block."""
        return cls((lambda: inputs,), inputs.shape[-1], None)

    def to_kernel_rows(self, tensor: tf.Tensor) -> tf.Tensor:
        """`tensor` [F, ...] indexed like `a`'s columns -> indexed like W's rows."""
        if self.order is None:
            return tensor
        return tf.gather(tensor, np.argsort(self.order), axis=0)


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
# than C. The rules below can cancel: the Gram form sums (a_r . a_r')(g_r . g_r')
# over row pairs, and on a nearly constant image at 255 these terms are 1e6 times
# the result; weight standardization subtracts two large projections from |h|^2.
# In float32 that cancellation gave one example 1.52 C (issue 18). So every rule
# computes in float64 from the float32 activations `a` and output gradients `g`
# (products of two float32 numbers are exact in float64), and returns its computed
# square PLUS a bound on all float64 rounding in it: `n * u * S^2`, where
# u = 2^-53, n counts the terms of the longest chain of sums (Higham 2002,
# Accuracy and Stability of Numerical Algorithms, Sec. 3.1, gamma_n), and
# S = sum_r |a_r| |g_r| bounds every partial result (|sum_r a_r g_r^T| <= S, and
# each dot product of a row pair is at most |a_r||a_r'| by Cauchy-Schwarz). The
# returned square is therefore never below the exact squared norm of the gradient
# that (a, g) define; the excess is n u rho^2 of it (rho = S / |gradient|, about
# sqrt(R) for typical inputs: below 1e-10 relative).
#
# The clipped sum adds exactly the vectors whose norms were clipped. Direct-form
# kernels build each example's gradient in float32 and hold it: its squared norm
# is summed in float64 (no cancellation), and the sum adds these float32 vectors
# (WS: projected in float64, then rounded to float32, |round(v)| <= |v|(1 + 2^-24)).
# Gram-form kernels never build it: their weighted sum is computed in float64 from
# the same rows (`_weighted_rows_sum`), never by a separate float32 backward pass,
# whose rounding (up to R u32 S per example, 1e-4 relative on ordinary images) the
# norm would not bound. Cost: `BUILD.md`, "Ghost norms in float64".
#
# TPUs have no float64: there, use clipping="vectorized".

NORM_DTYPE = tf.float64
_UNIT_ROUNDOFF = 2.0**-53


def _wide(t: tf.Tensor) -> tf.Tensor:
    return tf.cast(t, NORM_DTYPE)


def _with_rounding_bound(squares: tf.Tensor, bound_sum: tf.Tensor, terms: int) -> tf.Tensor:
    """`max(squares, 0) + terms * u * bound_sum^2`: never below the exact square (see above)."""
    return tf.maximum(squares, 0.0) + (terms * _UNIT_ROUNDOFF) * tf.square(bound_sum)


def _sum_of_squares(t: tf.Tensor) -> tf.Tensor:
    """`sum(t[b]**2)` per example, float64 `[batch]`."""
    return tf.reduce_sum(tf.square(tf.reshape(t, [tf.shape(t)[0], -1])), axis=1)


@dataclasses.dataclass
class _KernelTerms:
    """What one pass over a kernel's rows gives (see `_kernel_terms`)."""

    squares: tf.Tensor  # float64 [batch], |h|^2 as computed (no bound added)
    bound_sum: tf.Tensor  # float64 [batch], bounds every partial result (see "Rounding")
    g_rows: tf.Tensor  # float64 [batch, R, fan_out], the (scaled) output gradients
    per_example: Optional[tf.Tensor]  # direct form: h^T [batch, fan_out, F], held
    along_ones: Optional[tf.Tensor]  # Gram form with `unit`: float64 [batch, fan_out], 1 . h_o
    along_unit: Optional[tf.Tensor]  # Gram form with `unit`: float64 [batch, fan_out], u_o . h_o


def _kernel_terms(rows: Rows, output_grads: tf.Tensor, num_views: int, *,
                  scale: Optional[tf.Tensor] = None,
                  unit: Optional[tf.Tensor] = None) -> _KernelTerms:
    """`|h|^2` of `h = sum_r a_r g_r^T` per example, and what WS needs.

    `g_r` is the float32 output gradient, times `scale` (float64 `[fan_out]`,
    WS) if given. `choose_form` picks one of two ways from the static shapes:
    - direct: h is built in float32, one `[batch, fan_out, F_k]` block of
      `rows` at a time, TRANSPOSED (`g^T a` is 20-40% faster than `a^T g` on
      CPU), and HELD: the clipped sum adds exactly these h, so the norm is
      theirs, with the squares summed in float64 (a sum of squares cannot
      cancel; `bound_sum` = |h|). With `scale`, h is scaled (and later
      projected) in float64.
    - Gram: h is never built: `|h|^2 = sum (A A^T) * (G G^T)` in float64 (Li
      et al. 2022, eq. (4)); `bound_sum` = S = sum_r |a_r| |g_r|. With `unit`
      (float64 `[F, fan_out]` in a's column order) also `1 . h_o = sum_r
      (sum_k a_rk) g_ro` and `u_o . h_o = sum_r (a_r . u_o) g_ro`.
    """
    fan_out = output_grads.shape[-1]
    form = choose_form(_static_rows(output_grads, num_views), rows.fan_in, fan_out)
    g32 = example_rows(output_grads, num_views)
    g_rows = _wide(g32) if scale is None else _wide(g32) * scale
    first_column = [0]  # the blocks come in order: where the next one starts in a

    def direct(a32):
        h = tf.matmul(g32, a32, transpose_a=True)
        if scale is not None:
            h = _wide(h) * scale[:, None]
        return {"h": h, "sq": _sum_of_squares(_wide(h))}

    def gram(a32):
        first, first_column[0] = first_column[0], first_column[0] + a32.shape[-1]
        a = _wide(a32)
        parts = {"row_sq": tf.reduce_sum(tf.square(a), axis=-1),
                 "gram": tf.matmul(a, a, transpose_b=True)}
        if unit is not None:
            parts["ones"] = tf.einsum("br,bro->bo", tf.reduce_sum(a, axis=-1), g_rows)
            parts["unit"] = tf.reduce_sum(
                tf.einsum("brf,fo->bro", a, unit[first:first + a32.shape[-1]]) * g_rows, axis=1)
        return parts

    parts = _one_block_at_a_time(rows, num_views, direct if form == DIRECT else gram)
    add = lambda key: tf.add_n([p[key] for p in parts])  # noqa: E731
    if form == DIRECT:
        squares = add("sq")
        return _KernelTerms(squares, tf.sqrt(squares), g_rows,
                            tf.concat([p["h"] for p in parts], axis=-1), None, None)
    g_gram = tf.matmul(g_rows, g_rows, transpose_b=True)
    squares = tf.reduce_sum(add("gram") * g_gram, axis=[1, 2])
    g_sq = tf.reduce_sum(tf.square(g_rows), axis=-1)  # [batch, R]
    bound_sum = tf.reduce_sum(tf.sqrt(add("row_sq") * g_sq), axis=1)
    return _KernelTerms(squares, bound_sum, g_rows, None,
                        add("ones") if unit is not None else None,
                        add("unit") if unit is not None else None)


def _kernel_rounding_terms(fan_in: int, fan_out: int, rows: Optional[int]) -> int:
    """n of `_with_rounding_bound` for a kernel rule (both forms, with WS's projections)."""
    r = rows if rows is not None else 2**20  # unknown positions: a generous count
    return fan_in * fan_out + 9 * fan_in + fan_out + r * r + 3 * r + 16


def _summer(blocks, squares, finish=None):
    """`weighted_sum(factors)`: `sum_i factors[i] * blocks[i]`, then `finish`.

    `blocks`: held per-example gradients (float32), a tensor `[batch, ...]` or
    a list of them concatenated (after summing) along their last axis. A
    contraction, which needs no temporary of their size, when every example's
    `squares` is finite; otherwise `clipping.weighted_sum`, where a zero factor
    drops even an inf or nan gradient.
    """
    blocks = blocks if isinstance(blocks, list) else [blocks]

    def weighted_sum(factors):
        factors = tf.cast(factors, blocks[0].dtype)
        finite = tf.reduce_all(tf.math.is_finite(squares))
        summed = [tf.cond(finite, lambda b=b: tf.tensordot(factors, b, 1),
                          lambda b=b: clipping.weighted_sum(factors, b)) for b in blocks]
        summed = summed[0] if len(summed) == 1 else tf.concat(summed, axis=-1)
        return summed if finish is None else finish(summed)

    return weighted_sum


def _weighted_rows_sum(rows: Rows, g_rows: tf.Tensor, num_views: int, finish):
    """`weighted_sum(factors)` of a Gram-form kernel (per-example gradients not built).

    `sum_i factors[i] h_i = sum_{i, r} factors[i] a_ir g_ir^T`, in float64,
    from the same rows and output gradients (`g_rows`, float64 `[batch, R,
    fan_out]`) as the norms, built again one block at a time: never a
    separate float32 backward pass, whose rounding (up to R u32 S per
    example) the float64 norm would not bound. Rows of a zero factor are
    zeroed first, so that an inf or nan there cannot reach the sum. `finish`
    gets float64 `[F, fan_out]` (a's column order).
    """

    def weighted_sum(factors):
        factors = _wide(factors)
        keep = factors > 0
        weights = tf.where(keep, factors, tf.zeros_like(factors))[:, None, None]
        g = tf.where(keep[:, None, None], g_rows, tf.zeros_like(g_rows)) * weights

        def block_sum(a):
            a = tf.where(keep[:, None, None], _wide(a), tf.zeros([], NORM_DTYPE))
            return tf.einsum("brf,bro->fo", a, g)

        return finish(tf.concat(_one_block_at_a_time(rows, num_views, block_sum), axis=0))

    return weighted_sum


def kernel_sq_norms(rows: Rows, output_grads: tf.Tensor, *, num_views: int = 1):
    """Per-example squared norm of the gradient of a kernel W in `z = a @ W`.

    Every axis of `a` between the first and the last is a position (sequence
    step, conv patch) of the example, and so are its K views: the example's
    gradient is `sum_r a_r g_r^T` over all of them. Computed in float64 with
    a bound on its rounding added (never too small: see "Rounding" above).

    Args:
      rows: the input rows `a`, `[batch * K, ..., F]` (`Rows.of(inputs)` for a
        dense layer, `conv2d_patches` for a convolution).
      output_grads: float32 `[batch * K, ..., fan_out]`, `dL/dz`.
      num_views: K, the augmult views of each example (consecutive rows).

    Returns:
      `(squares, weighted_sum)`: float64 `[batch]`; `weighted_sum(factors)`
      gives float32 `[F, fan_out]` in W's row order.
    """
    terms = _kernel_terms(rows, output_grads, num_views)
    squares = _with_rounding_bound(terms.squares, terms.bound_sum, _kernel_rounding_terms(
        rows.fan_in, output_grads.shape[-1], _static_rows(output_grads, num_views)))
    to_kernel = lambda summed: rows.to_kernel_rows(tf.cast(summed, tf.float32))  # noqa: E731
    if terms.per_example is not None:  # the held float32 gradients
        return squares, _summer(terms.per_example, squares,
                                lambda summed: to_kernel(tf.transpose(summed)))
    return squares, _weighted_rows_sum(rows, terms.g_rows, num_views, to_kernel)


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
    if height is None or width is None or not (sh == sw and (sh == 1 or dh == dw == 1)):
        return Rows((lambda: tf.image.extract_patches(
            inputs, sizes=[1, kh, kw, 1], strides=[1, sh, sw, 1], rates=[1, dh, dw, 1],
            padding=padding.upper()),), fan_in, None)
    if padding.lower() == "same":
        pad_h = _same_padding(height, kh, sh, dh)
        pad_w = _same_padding(width, kw, sw, dw)
        inputs = tf.pad(inputs, [[0, 0], pad_h, pad_w, [0, 0]])
        height, width = height + sum(pad_h), width + sum(pad_w)
    out_h = (height - (kh - 1) * dh - 1) // sh + 1
    out_w = (width - (kw - 1) * dw - 1) // sw + 1
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
    return Rows(tuple(block(row) for row in slices), fan_in, order)


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
      `(squares, weighted_sum)`: float64 `[batch]`; `weighted_sum(factors)`
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

    The projection removes most of h on a nearly constant input (h is then
    nearly parallel to 1), so its norm must not be taken as a difference of
    float32 terms (issue 18). Everything here is float64, with the rounding
    bound of the module's "Rounding" section added. Held per-example
    gradients (small kernels, direct form) are projected one by one, and the
    squared norm is that of the projection itself, which cannot cancel.
    Otherwise `|P_o h_o|^2 = |h_o|^2 - (1.h_o)^2 / F - (u_o.h_o)^2`, each term
    from h (direct form) or from the rows (Gram form: `1.h_o = sum_r
    (sum_k a_rk) g_ro`, `u_o.h_o = sum_r (a_r . u_o) g_ro`), and the weighted
    sum is projected once, in float64.

    Args:
      rows: the rows `a` (`Rows.of(inputs)` or `conv2d_patches`), F columns.
      output_grads: float32 `[batch * K, ..., filters]`, `dL/dz` of `z = a @ U`
        (before any gain or bias).
      kernel: the variable W, float32 `[..., filters]` with `prod(shape[:-1]) = F`.
      epsilon: the layer's lower bound on |c_o|^2.
      num_views: K.

    Returns:
      `(squares, weighted_sum)`: float64 `[batch]`; `weighted_sum(factors)`
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
    w = _wide(tf.reshape(tf.convert_to_tensor(kernel), [fan_in, fan_out]))
    if rows.order is not None:
        w = tf.gather(w, rows.order)  # W's rows in the order of a's columns
    centered = w - tf.reduce_mean(w, axis=0, keepdims=True)
    variance = tf.reduce_sum(tf.square(centered), axis=0)  # F var_o, [fan_out]
    scale = tf.math.rsqrt(tf.maximum(variance, epsilon))
    on_sphere = tf.cast(variance >= epsilon, NORM_DTYPE)
    unit = centered * scale * on_sphere  # u_o, or 0 below epsilon; [F, fan_out]
    terms = _kernel_terms(rows, output_grads, num_views, scale=scale, unit=unit)
    rounding_terms = _kernel_rounding_terms(fan_in, fan_out, _static_rows(output_grads, num_views))

    def project(h):  # P_o h_o for every o; h float64 [..., fan_out, F]
        h -= tf.reduce_mean(h, axis=-1, keepdims=True)
        unit_t = tf.transpose(unit)  # [fan_out, F]
        return h - unit_t * tf.reduce_sum(unit_t * h, axis=-1, keepdims=True)

    def to_kernel(summed):  # float [fan_out, F], a's column order -> kernel.shape
        summed = rows.to_kernel_rows(tf.transpose(tf.cast(summed, tf.float32)))
        return tf.reshape(summed, kernel.shape)

    if terms.per_example is not None:
        projected = project(terms.per_example)  # [batch, fan_out, F]
        squares = _with_rounding_bound(_sum_of_squares(projected), terms.bound_sum,
                                       rounding_terms)
        return squares, _summer(tf.cast(projected, tf.float32), squares, to_kernel)
    removed = tf.square(terms.along_ones) / fan_in + tf.square(terms.along_unit)
    squares = _with_rounding_bound(terms.squares - tf.reduce_sum(removed, axis=1),
                                   terms.bound_sum, rounding_terms)
    return squares, _weighted_rows_sum(
        rows, terms.g_rows, num_views,
        lambda summed: to_kernel(project(_wide(tf.transpose(summed)))))


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
      `(squares, weighted_sum)`: float64 `[batch]` (the sums over positions
      cancel too: float64, with the rounding bound of the module's "Rounding"
      section); `weighted_sum(factors)` gives float32 `parameter_shape`.
    """
    terms = _wide(output_grads) if inputs is None else _wide(inputs) * _wide(output_grads)
    size = math.prod(parameter_shape)
    batch = tf.shape(terms)[0] // num_views
    terms = tf.reshape(terms, [batch, -1, size])  # [batch, R, size]
    per_example = tf.reduce_sum(terms, axis=1)
    bound_sum = tf.reduce_sum(tf.sqrt(tf.reduce_sum(tf.square(terms), axis=2)), axis=1)
    rows = terms.shape[1]
    squares = _with_rounding_bound(_sum_of_squares(per_example), bound_sum,
                                   size + 2 * (rows if rows is not None else 2**20) + 8)
    return squares, _summer(tf.cast(per_example, tf.float32), squares,
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
      `(squares, weighted_sum)`: float64 `[batch]`; `weighted_sum(factors)`
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
    keep = tf.reshape(factors > 0, [-1] + [1] * (per_example.shape.rank - 1))
    weights = tf.reshape(tf.cast(factors, per_example.dtype), keep.shape)
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
      `(squares, weighted_sum)`: float64 `[batch]`; `weighted_sum(factors)`
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
    time, and HELD: its squared norm is summed in float64 and the weighted
    sum adds exactly these gradients (the direct form of the module's
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
      `(squares, weighted_sum)`: float64 `[batch]`; `weighted_sum(factors)`
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
        return tf.einsum("brkgc,brgf->bkgcf", a, g)

    h = tf.concat(_one_block_at_a_time(rows, num_views, block), axis=1)  # a's offset order
    if rows.order is not None:  # the same offset for all channels: the order of offsets
        h = tf.gather(h, np.argsort(rows.order[::channels] // channels), axis=1)
    # [batch, kh kw, G, Cg, Fg] -> the kernel's [kh, kw, Cg, G Fg]
    shape = [*kernel_size, per_group, filters]
    h = tf.reshape(tf.transpose(h, [0, 1, 3, 2, 4]), [-1, *shape])
    squares = _sum_of_squares(_wide(h))
    squares = _with_rounding_bound(squares, tf.sqrt(squares), math.prod(shape) + 8)
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
    shapes, so XLA compiles it). Its squared norm is a float64 sum of squares
    (no cancellation) and the weighted sum scatters exactly these rows back
    into the table (the direct form of the module's "Rounding").

    Args:
      ids: int (or float, truncated as `keras.layers.Embedding` does)
        `[batch * K, ...]`, the layer's input; a negative id is row
        `id + vocabulary_size`, as `keras.ops.take` reads it.
      output_grads: float32 `[batch * K, ..., dim]`, `dL/dz`.
      vocabulary_size: the table's number of rows.
      num_views: K.

    Returns:
      `(squares, weighted_sum)`: float64 `[batch]`; `weighted_sum(factors)`
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
    h = tf.matmul(same * first, g)  # [batch, R, dim], nonzero at first occurrences
    squares = _sum_of_squares(_wide(h))
    squares = _with_rounding_bound(squares, tf.sqrt(squares),
                                   (h.shape[1] or 2**20) * dim + 8)

    def weighted_sum(factors):
        weighted = _held_sum(h, factors)
        return tf.math.unsorted_segment_sum(tf.reshape(weighted, [-1, dim]),
                                            tf.reshape(ids, [-1]), vocabulary_size)

    return squares, weighted_sum
