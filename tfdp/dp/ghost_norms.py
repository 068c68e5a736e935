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

import math
from typing import Any, Callable, Optional, Sequence

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


def _static_rows(tensor: tf.Tensor, num_views: int) -> Optional[int]:
    inner = tensor.shape[1:-1]
    if not inner.is_fully_defined():
        return None
    return num_views * math.prod(inner.as_list())


def choose_form(rows: Optional[int], fan_in: int, fan_out: int) -> str:
    """`GRAM` when fan_in * fan_out > 2 R (fan_in + fan_out), else `DIRECT`.

    The direct form costs R fan_in fan_out per example, and its per-example
    gradients then also give the clipped sum, replacing the weight-gradient
    backward pass of that cost; the Gram form costs R^2 (fan_in + fan_out)
    on top of that backward pass. So the direct form is the faster one; what
    it costs is memory: the per-example gradients, fan_in * fan_out floats
    per example, are held until the clip factors are known. They are kept
    only where they are at most twice the example's rows and output
    gradients, R (fan_in + fan_out) floats, which the step materializes
    anyway; larger kernels over few positions (WRN-16-4's last stage:
    590k vs 164k) take the Gram form, whose R x R matrices are transient.
    An unknown R (dynamic positions) takes the direct form.
    """
    if rows is not None and fan_in * fan_out > 2 * rows * (fan_in + fan_out):
        return GRAM
    return DIRECT


# -- Kernels --------------------------------------------------------------------


def _summer(per_example, finish=None):
    """`weighted_sum(factors)` over `per_example` [batch, ...], then `finish`."""

    def weighted_sum(factors):
        summed = clipping.weighted_sum(factors, per_example)
        return summed if finish is None else finish(summed)

    return weighted_sum


def kernel_sq_norms(a_rows: tf.Tensor, g_rows: tf.Tensor, form: str):
    """Squared Frobenius norms of `sum_r a_r g_r^T`, one per example.

    Args:
      a_rows: float32 `[batch, R, fan_in]`, the example's input rows.
      g_rows: float32 `[batch, R, fan_out]`, the loss gradients of its output rows.
      form: `DIRECT` or `GRAM` (same norms, different cost; see module doc).

    Returns:
      `(squares, per_example)`: float32 `[batch]`, and the per-example
      gradients TRANSPOSED, float32 `[batch, fan_out, fan_in]` (direct form;
      this product is 20-40% faster than the other on CPU), or None (Gram).
    """
    if form == GRAM:
        a_gram = tf.matmul(a_rows, a_rows, transpose_b=True)
        g_gram = tf.matmul(g_rows, g_rows, transpose_b=True)
        return tf.reduce_sum(a_gram * g_gram, axis=[1, 2]), None
    per_example = tf.matmul(g_rows, a_rows, transpose_a=True)
    return tf.reduce_sum(tf.square(per_example), axis=[1, 2]), per_example


def dense_kernel_sq_norms(inputs: tf.Tensor, output_grads: tf.Tensor, *, num_views: int = 1,
                          order=None):
    """Per-example squared norm of a dense kernel's gradient.

    `z = a @ W` with `W` `[fan_in, fan_out]`; every axis of `a` between the
    first and the last is a position (sequence step) of the example.

    Args:
      inputs: float32 `[batch * K, ..., fan_in]`, the layer input `a`.
      output_grads: float32 `[batch * K, ..., fan_out]`, `dL/dz`.
      num_views: K, the augmult views of each example (consecutive rows).
      order: None, or the order of `inputs`' last axis in W's rows (the
        patch order of `conv2d_patches`).

    Returns:
      `(squares, weighted_sum)`; `weighted_sum(factors)` gives
      float32 `[fan_in, fan_out]` in W's row order.
    """
    form = choose_form(_static_rows(inputs, num_views), inputs.shape[-1], output_grads.shape[-1])
    squares, per_example = kernel_sq_norms(example_rows(inputs, num_views),
                                           example_rows(output_grads, num_views), form)
    if per_example is None:
        return squares, None
    return squares, _summer(per_example,
                            lambda summed: _to_kernel_rows(tf.transpose(summed), order))


def _same_padding(size, kernel, stride, dilation):
    """TensorFlow's "SAME" padding (before, after) of one spatial axis."""
    out = -(-size // stride)
    total = max((out - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)
    return total // 2, total - total // 2


def conv2d_patches(inputs: tf.Tensor, *, kernel_size, strides, dilation_rate, padding: str):
    """The input patch of every output position of a 2D convolution (NHWC).

    Built from one slice of the (padded) input per kernel offset, which on
    CPU is several times faster than `tf.image.extract_patches`. A stride s
    > 1 is first folded into the channels with `tf.nn.space_to_depth`, so that
    every slice is contiguous (TensorFlow's strided slices are slow). When s
    divides the kernel size (Tramer & Boneh's 8x8 and 4x4 kernels with stride
    2) whole s x s blocks are sliced, which takes s^2 times fewer slices; the
    patch's entries then come in another order, which `order` gives.

    Args:
      inputs: float32 `[n, height, width, channels]`.
      kernel_size, strides, dilation_rate: pairs of ints, as the convolution's.
      padding: "same" or "valid" (TensorFlow's padding rule, as `tf.nn.conv2d`).

    Returns:
      `(patches, order)`: float32 `[n, out_height, out_width, F]` with
      F = kh * kw * channels, and None if the entries are in the (kh, kw,
      channels) order of a `[kh, kw, channels, filters]` kernel, else an int
      array `[F]`: entry f of a patch is entry `order[f]` of the flattened kernel.
    """
    (kh, kw), (sh, sw), (dh, dw) = kernel_size, strides, dilation_rate
    height, width, channels = inputs.shape[1:]
    folded = sh == sw and (sh == 1 or dh == dw == 1)
    if height is None or width is None or not folded:
        patches = tf.image.extract_patches(
            inputs, sizes=[1, kh, kw, 1], strides=[1, sh, sw, 1], rates=[1, dh, dw, 1],
            padding=padding.upper())
        return patches, None
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
    if s > 1 and kh % s == 0 and kw % s == 0:
        blocks = [inputs[:, i:i + out_h, j:j + out_w, :]
                  for i in range(kh // s) for j in range(kw // s)]
        # Patch entry (i, j, a, b, c) is kernel entry (i * s + a, j * s + b, c).
        i, j, a, b, c = np.meshgrid(np.arange(kh // s), np.arange(kw // s), np.arange(s),
                                    np.arange(s), np.arange(channels), indexing="ij")
        order = (((i * s + a) * kw + (j * s + b)) * channels + c).ravel()
        return tf.concat(blocks, axis=-1), order
    # Kernel offset (y, x) reads block (y // s, x // s), channels of (y % s, x % s).
    slices = []
    for y in range(0, kh * dh, dh):
        for x in range(0, kw * dw, dw):
            first = (y % s * s + x % s) * channels
            slices.append(inputs[:, y // s:y // s + out_h, x // s:x // s + out_w,
                                 first:first + channels])
    return tf.concat(slices, axis=-1), None


def _to_kernel_rows(tensor: tf.Tensor, order) -> tf.Tensor:
    """Rows of `tensor` [F, ...] in patch `order` -> in kernel order."""
    return tensor if order is None else tf.gather(tensor, np.argsort(order), axis=0)


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
    patches, order = conv2d_patches(inputs, kernel_size=kernel_size, strides=strides,
                                    dilation_rate=dilation_rate, padding=padding)
    squares, weighted_sum = dense_kernel_sq_norms(patches, output_grads, num_views=num_views,
                                                  order=order)
    if weighted_sum is None:
        return squares, None
    shape = [*kernel_size, inputs.shape[-1], output_grads.shape[-1]]
    return squares, lambda factors: tf.reshape(weighted_sum(factors), shape)


def ws_kernel_sq_norms(
    inputs: tf.Tensor,
    outputs: tf.Tensor,
    output_grads: tf.Tensor,
    kernel: tf.Tensor,
    *,
    epsilon: float,
    num_views: int = 1,
    order=None,
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

    Direct form: h is built, and the three terms are reductions of it; the
    projection is linear, so it is applied once, to the weighted sum. Gram
    form: |h|^2 comes from the Gram matrices of the rows scaled by s_o;
    `u_o.h_o = sum_r z_ro g_ro` (z is the layer's output) and
    `1.h_o = sum_r (sum_k a_rk) g_ro`.

    Args:
      inputs: float32 `[batch * K, ..., F]`, the rows `a` (conv patches or dense inputs).
      outputs: float32 `[batch * K, ..., filters]`, `z = a @ U` (before any gain or bias).
      output_grads: float32, `dL/dz`, shaped as `outputs`.
      kernel: the variable W, float32 `[..., filters]` with `prod(shape[:-1]) = F`.
      epsilon: the layer's lower bound on |c_o|^2.
      num_views: K.
      order: None, or the patch order of `inputs` (`conv2d_patches`).

    Returns:
      `(squares, weighted_sum)`; `weighted_sum(factors)` gives the weighted
      sum of the per-example gradients wrt W, float32 `kernel.shape`, or is
      None (Gram form).

    Reference: Qiao et al. 2019 (weight standardization); De et al. 2022, App. C.1.
    """
    fan_out = kernel.shape[-1]
    fan_in = math.prod(kernel.shape[:-1])
    w = tf.reshape(tf.convert_to_tensor(kernel), [fan_in, fan_out])
    if order is not None:
        w = tf.gather(w, order)  # the rows of `inputs` in patch order
    centered = w - tf.reduce_mean(w, axis=0, keepdims=True)
    squares = tf.reduce_sum(tf.square(centered), axis=0)  # F var_o, [fan_out]
    scale = tf.math.rsqrt(tf.maximum(squares, epsilon))
    on_sphere = tf.cast(squares >= epsilon, scale.dtype)
    unit = centered * scale * on_sphere  # u_o, or 0 below epsilon
    a_rows = example_rows(inputs, num_views)
    g_rows = example_rows(output_grads, num_views) * scale  # s_o g_ro
    form = choose_form(_static_rows(inputs, num_views), fan_in, fan_out)
    if form == DIRECT:
        total, h = kernel_sq_norms(a_rows, g_rows, DIRECT)  # s_o h_o^T, [batch, fan_out, F]
        along_ones = tf.reduce_sum(h, axis=2)
        along_u = tf.reduce_sum(h * tf.transpose(unit), axis=2)
    else:
        total, h = kernel_sq_norms(a_rows, g_rows, GRAM)
        along_ones = tf.einsum("br,bro->bo", tf.reduce_sum(a_rows, axis=-1), g_rows)
        along_u = tf.reduce_sum(example_rows(outputs, num_views) * g_rows, axis=1) * on_sphere
    removed = tf.square(along_ones) / fan_in + tf.square(along_u)
    squares = tf.maximum(total - tf.reduce_sum(removed, axis=1), 0.0)
    if h is None:
        return squares, None

    def project(summed):  # (I - 1 1^T / F - u u^T), column by column
        summed = tf.transpose(summed)  # [F, fan_out]
        summed -= tf.reduce_mean(summed, axis=0, keepdims=True)
        summed -= unit * tf.reduce_sum(unit * summed, axis=0, keepdims=True)
        return tf.reshape(_to_kernel_rows(summed, order), kernel.shape)

    return squares, _summer(h, project)


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
    return squares, _summer(per_example, lambda summed: tf.reshape(summed, parameter_shape))
