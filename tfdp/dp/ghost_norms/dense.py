"""Dense kernels: a kernel W in `z = a @ W` (Dense, and any rows), and EinsumDense's.

`kernel_sq_norms` is the rule every kernel product shares: a convolution's
is the same rule over its patches (`tfdp.dp.ghost_norms.conv`). It takes
the direct form or the Gram form (`forms.choose_form`; Li et al. 2022,
Bu et al. 2022's mixed ghost clipping). Tap rules:
`tfdp.training.ghost_taps.dense`.
"""

import math
from typing import Sequence, Tuple

import tensorflow as tf

from tfdp.dp.ghost_norms import forms
from tfdp.dp.ghost_norms.gram import _gram_form
from tfdp.dp.ghost_norms.registry import UnsupportedLayer
from tfdp.dp.ghost_norms.rows import Rows, _static_rows


def kernel_sq_norms(rows: Rows, output_grads: tf.Tensor, *, num_views: int = 1):
    """Per-example squared norm of the gradient of a kernel W in `z = a @ W`.

    Every axis of `a` between the first and the last is a position (sequence
    step, conv patch) of the example, and so are its K views: the example's
    gradient is `sum_r a_r g_r^T` over all of them. `forms.choose_form` picks the
    direct form (held per-example gradients) or the centred Gram form; either
    way the squares are an upper bound on the squared norm of what the
    weighted sum adds for the example (`forms`, "Rounding"), in float32.

    Args:
      rows: the input rows `a`, `[batch * K, ..., F]` (`Rows.of(inputs)` for a
        dense layer, `conv.conv2d_patches` for a convolution).
      output_grads: float32 `[batch * K, ..., fan_out]`, `dL/dz`.
      num_views: K, the augmult views of each example (consecutive rows).

    Returns:
      `(squares, weighted_sum)`: float32 `[batch]`; `weighted_sum(factors)`
      gives float32 `[F, fan_out]` in W's row order.
    """
    fan_out = output_grads.shape[-1]
    form = forms.choose_form(_static_rows(output_grads, num_views), rows.fan_in, fan_out)
    if form == forms.DIRECT:
        finish = lambda s: rows.to_kernel_rows(tf.transpose(s))  # noqa: E731
        chunks = forms._recompute_chunks(rows, output_grads, num_views)
        if chunks:
            return forms._recomputed(rows, output_grads, num_views, chunks, lambda h: h, finish)
        held = forms._direct_products(rows, output_grads, num_views)
        squares = forms.held_squares(held)
        return squares, forms._summer(held, squares, lambda s: rows.to_kernel_rows(tf.transpose(s)))
    gram = _gram_form(rows, output_grads, num_views)
    norm = forms._root(gram.bound()) + gram.weighted_error * gram.support + gram.floor
    return gram.unscaled_squares(norm), gram.weighted_sum(num_views, rows.to_kernel_rows)


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
