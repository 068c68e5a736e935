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

Every rule returns `(squares, weighted_sum)`: the squared norms, float32
`[batch]`, and, when the rule built the per-example gradients anyway
(direct-form kernels, biases, scales), a function `weighted_sum(factors)`
that returns `sum_i factors[i] * gradient_i` for each parameter; else None
(Gram form). A caller forms the clipped sum from those and needs a weighted
backward pass only through the Gram-form kernels (the mixed "book-keeping"
of Bu et al. 2022, Sec. 3.2). A zero factor drops its example even where
its gradient is inf or nan (as `tfdp.dp.clipping.weighted_sum`).

Pure TensorFlow on tensors: nothing here knows about Keras models. Which
layer has which rule is kept in a registry (`register_layer_rule`,
`find_layer_rule`) that `tfdp.training` fills with the Keras layer classes.
"""

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence, Tuple

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

    The direct form costs R fan_in fan_out per example, and its per-example
    gradients can also give the clipped sum (`holds_per_example`), replacing
    the weight-gradient backward pass of that cost; the Gram form costs
    R^2 (fan_in + fan_out) on top of that backward pass. So the direct form
    is the faster one unless the Gram form is more than twice cheaper, which
    happens for large kernels over few positions (WRN-16-4's last stage:
    590k vs 164k per example), where building the per-example gradients
    would also take the most memory. An unknown R (dynamic positions) takes
    the direct form.
    """
    if rows is not None and fan_in * fan_out > 2 * rows * (fan_in + fan_out):
        return GRAM
    return DIRECT


# Per-example gradients of at most this many floats are always held (64 KB).
_SMALL_GRADIENT = 2**14


def holds_per_example(fan_in: int, fan_out: int, held_instead: Optional[int]) -> bool:
    """Whether a direct-form kernel keeps its per-example gradients for the sum.

    Held, they give the clipped sum without a backward pass, but they stay in
    memory until every example's clip factor is known. They are held when
    small, or when no larger than what the weighted backward pass through
    the layer would hold instead (its input and output gradients,
    `held_instead` floats per example); WRN-16-4's 128-channel convolutions
    (147k vs 66k) take the backward pass.
    """
    size = fan_in * fan_out
    return size <= _SMALL_GRADIENT or held_instead is None or size <= held_instead


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
      input_floats: the size of one view of the layer input the rows come
        from (not of the patches), or None if not static.
    """

    blocks: Tuple[Callable[[], tf.Tensor], ...]
    fan_in: int
    order: Optional[np.ndarray] = None
    input_floats: Optional[int] = None

    @classmethod
    def of(cls, inputs: tf.Tensor) -> "Rows":
        """The rows of a dense layer's input `[batch * K, ..., fan_in]`, one block."""
        return cls((lambda: inputs,), inputs.shape[-1], None, _static_size(inputs))

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


def _sum_of_squares(t: tf.Tensor) -> tf.Tensor:
    """`sum(t[b]**2)` per example, as batched dot products (no temporary of t's size)."""
    flat = tf.reshape(t, [tf.shape(t)[0], 1, -1])
    return tf.reshape(tf.matmul(flat, flat, transpose_b=True), [-1])


def _kernel_terms(rows: Rows, g_rows: tf.Tensor, form: str, num_views: int, row_sums=False):
    """`(squares, per_example, sums)` of `sum_r a_r g_r^T` for each example.

    `squares`: float32 `[batch]`. `per_example`: direct form, the gradients
    TRANSPOSED, a list with one float32 `[batch, fan_out, F_k]` per block of
    `rows` (`g^T a` is 20-40% faster than `a^T g` on CPU, and the blocks are
    never concatenated); Gram form, None. `sums`: `sum_k a_rk`, float32
    `[batch, R]`, if `row_sums`.
    """
    def direct(a):
        product = tf.matmul(g_rows, a, transpose_a=True)
        return (product, tf.reduce_sum(a, axis=-1)) if row_sums else (product,)

    def gram(a):
        a_gram = tf.matmul(a, a, transpose_b=True)
        return (a_gram, tf.reduce_sum(a, axis=-1)) if row_sums else (a_gram,)

    parts = _one_block_at_a_time(rows, num_views, direct if form == DIRECT else gram)
    sums = tf.add_n([part[1] for part in parts]) if row_sums else None
    if form == DIRECT:
        per_example = [part[0] for part in parts]
        return tf.add_n([_sum_of_squares(p) for p in per_example]), per_example, sums
    a_gram = tf.add_n([part[0] for part in parts])
    g_gram = tf.matmul(g_rows, g_rows, transpose_b=True)
    return tf.reduce_sum(a_gram * g_gram, axis=[1, 2]), None, sums


def _summer(blocks, squares, finish=None):
    """`weighted_sum(factors)`: `sum_i factors[i] * blocks[i]`, then `finish`.

    `blocks`: per-example gradients, a tensor `[batch, ...]` or a list of
    them concatenated (after summing) along their last axis. A contraction,
    which needs no temporary of their size, when every example's `squares`
    is finite; otherwise `clipping.weighted_sum`, where a zero factor drops
    even an inf or nan gradient.
    """
    blocks = blocks if isinstance(blocks, list) else [blocks]

    def weighted_sum(factors):
        finite = tf.reduce_all(tf.math.is_finite(squares))
        summed = [tf.cond(finite, lambda b=b: tf.tensordot(factors, b, 1),
                          lambda b=b: clipping.weighted_sum(factors, b)) for b in blocks]
        summed = summed[0] if len(summed) == 1 else tf.concat(summed, axis=-1)
        return summed if finish is None else finish(summed)

    return weighted_sum


def _form(rows: Rows, output_grads: tf.Tensor, num_views: int) -> str:
    return choose_form(_static_rows(output_grads, num_views), rows.fan_in,
                       output_grads.shape[-1])


def _holds(rows: Rows, output_grads: tf.Tensor) -> bool:
    grads = _static_size(output_grads)
    instead = None if rows.input_floats is None or grads is None else rows.input_floats + grads
    return holds_per_example(rows.fan_in, output_grads.shape[-1], instead)


def kernel_sq_norms(rows: Rows, output_grads: tf.Tensor, *, num_views: int = 1):
    """Per-example squared norm of the gradient of a kernel W in `z = a @ W`.

    Every axis of `a` between the first and the last is a position (sequence
    step, conv patch) of the example, and so are its K views: the example's
    gradient is `sum_r a_r g_r^T` over all of them.

    Args:
      rows: the input rows `a`, `[batch * K, ..., F]` (`Rows.of(inputs)` for a
        dense layer, `conv2d_patches` for a convolution).
      output_grads: float32 `[batch * K, ..., fan_out]`, `dL/dz`.
      num_views: K, the augmult views of each example (consecutive rows).

    Returns:
      `(squares, weighted_sum)`: float32 `[batch]`; `weighted_sum(factors)`
      gives float32 `[F, fan_out]` in W's row order, or is None (Gram form).
    """
    g_rows = example_rows(output_grads, num_views)
    squares, per_example, _ = _kernel_terms(rows, g_rows, _form(rows, output_grads, num_views),
                                            num_views)
    if per_example is None or not _holds(rows, output_grads):
        return squares, None
    return squares, _summer(per_example, squares,
                            lambda summed: rows.to_kernel_rows(tf.transpose(summed)))


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
    input_floats = _static_size(inputs)
    if height is None or width is None or not (sh == sw and (sh == 1 or dh == dw == 1)):
        return Rows((lambda: tf.image.extract_patches(
            inputs, sizes=[1, kh, kw, 1], strides=[1, sh, sw, 1], rates=[1, dh, dw, 1],
            padding=padding.upper()),), fan_in, None, input_floats)
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
    return Rows(tuple(block(row) for row in slices), fan_in, order, input_floats)


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
      `(squares, weighted_sum)`; `weighted_sum(factors)` gives float32
      `[kh, kw, in_channels, filters]`, or is None (Gram form).
    """
    rows = conv2d_patches(inputs, kernel_size=kernel_size, strides=strides,
                          dilation_rate=dilation_rate, padding=padding)
    squares, weighted_sum = kernel_sq_norms(rows, output_grads, num_views=num_views)
    if weighted_sum is None:
        return squares, None
    shape = [*kernel_size, inputs.shape[-1], output_grads.shape[-1]]
    return squares, lambda factors: tf.reshape(weighted_sum(factors), shape)


def ws_kernel_sq_norms(
    rows: Rows,
    outputs: tf.Tensor,
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

    an orthogonal projection (u_o is a unit vector orthogonal to 1) when
    `|c_o|^2 >= epsilon`; below it the scale is the constant epsilon^(-1/2)
    and the u_o term drops out (the `maximum` passes no gradient to |c_o|^2).
    Hence

        |dL/dW_o|^2 = s_o^2 (|h_o|^2 - (1.h_o)^2 / F - [on sphere] (u_o.h_o)^2).

    |h|^2 comes from h (direct form) or from the Gram matrices of the rows
    scaled by s_o (Gram form); in both, `u_o.h_o = sum_r z_ro g_ro` (z is the
    layer's output) and `1.h_o = sum_r (sum_k a_rk) g_ro`, which are cheaper
    than reductions of h. The projection is linear, so in the direct form it
    is applied once, to the weighted sum.

    Args:
      rows: the rows `a` (`Rows.of(inputs)` or `conv2d_patches`), F columns.
      outputs: float32 `[batch * K, ..., filters]`, `z = a @ U` (before any gain or bias).
      output_grads: float32, `dL/dz`, shaped as `outputs`.
      kernel: the variable W, float32 `[..., filters]` with `prod(shape[:-1]) = F`.
      epsilon: the layer's lower bound on |c_o|^2.
      num_views: K.

    Returns:
      `(squares, weighted_sum)`; `weighted_sum(factors)` gives the weighted
      sum of the per-example gradients wrt W, float32 `kernel.shape`, or is
      None (Gram form).

    Reference: Qiao et al. 2019 (weight standardization); De et al. 2022, App. C.1.
    """
    fan_out = kernel.shape[-1]
    fan_in = math.prod(kernel.shape[:-1])
    w = tf.reshape(tf.convert_to_tensor(kernel), [fan_in, fan_out])
    if rows.order is not None:
        w = tf.gather(w, rows.order)  # W's rows in the order of a's columns
    centered = w - tf.reduce_mean(w, axis=0, keepdims=True)
    squares = tf.reduce_sum(tf.square(centered), axis=0)  # F var_o, [fan_out]
    scale = tf.math.rsqrt(tf.maximum(squares, epsilon))
    on_sphere = tf.cast(squares >= epsilon, scale.dtype)
    unit = centered * scale * on_sphere  # u_o, or 0 below epsilon
    g_rows = example_rows(output_grads, num_views) * scale  # s_o g_ro
    form = _form(rows, output_grads, num_views)
    total, h, row_sums = _kernel_terms(rows, g_rows, form, num_views, row_sums=True)
    along_ones = tf.einsum("br,bro->bo", row_sums, g_rows)
    along_u = tf.reduce_sum(example_rows(outputs, num_views) * g_rows, axis=1) * on_sphere
    removed = tf.square(along_ones) / fan_in + tf.square(along_u)
    squares = tf.maximum(total - tf.reduce_sum(removed, axis=1), 0.0)
    if h is None or not _holds(rows, output_grads):
        return squares, None

    def project(summed):  # (I - 1 1^T / F - u u^T), column by column
        summed = tf.transpose(summed)  # [F, fan_out]
        summed -= tf.reduce_mean(summed, axis=0, keepdims=True)
        summed -= unit * tf.reduce_sum(unit * summed, axis=0, keepdims=True)
        return tf.reshape(rows.to_kernel_rows(summed), kernel.shape)

    return squares, _summer(h, squares, project)


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
      `(squares, weighted_sum)`; `weighted_sum(factors)` gives float32
      `parameter_shape`.
    """
    terms = output_grads if inputs is None else inputs * output_grads
    size = math.prod(parameter_shape)
    batch = tf.shape(terms)[0] // num_views
    per_example = tf.reduce_sum(tf.reshape(terms, [batch, -1, size]), axis=1)
    squares = tf.reduce_sum(tf.square(per_example), axis=1)
    return squares, _summer(per_example, squares,
                            lambda summed: tf.reshape(summed, parameter_shape))
