"""Weight-standardized kernels (WSConv2D, ScaledWSConv2D): the gradient wrt W through WS.

The chain rule through the standardization is a projection of the
per-example kernel gradient (Qiao et al. 2019; De et al. 2022, App. C.1),
in the direct form held and projected per example, in the Gram form
bounded from the centred rows (`ws_kernel_sq_norms`). Tap rules:
`tfdp.training.ghost_taps.conv`.
"""

import math

import tensorflow as tf

from tfdp.dp import precision
from tfdp.dp.ghost_norms import forms
from tfdp.dp.ghost_norms.gram import _Gram, _gram_form
from tfdp.dp.ghost_norms.rows import Rows, _static_rows

_U = precision.UNIT_ROUNDOFF


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
    centred rows' products (`forms`, "Rounding") is projected once, and

        |P h|^2 = |h|^2 - sum_o (1.h_o)^2 / F - sum_o (u_o.h_o)^2
                  + sum_o (|u_o|^2 - 1)(u_o.h_o)^2 + 2 sum_o (1.h_o)(1.u_o)(u_o.h_o) / F

    (the last two: P_o is built from the float32 u_o), each term from the
    rows (`1.h_o = sum_r (sum_k x_rk) y_ro`, `u_o.h_o = sum_r (x_r.u_o) y_ro`),
    with a bound on the rounding of each; the norm returned also covers the
    projection's own rounding in the weighted sum. The Gram form first
    centres every row over its F columns (`Rows.row_means`): the same P_o h_o,
    with nearly no component along 1 left for the bound to cancel.

    Args:
      rows: the rows `a` (`Rows.of(inputs)` or `conv.conv2d_patches`), F columns.
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
        return (tf.zeros([batch], forms.NORM_DTYPE),
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
    form = forms.choose_form(_static_rows(output_grads, num_views), fan_in, fan_out, True)
    if form == forms.DIRECT:  # held: its float32 projection's rounding is in the vector added
        chunks = forms._recompute_chunks(rows, output_grads, num_views)
        if chunks:
            return forms._recomputed(rows, output_grads, num_views, chunks,
                               lambda h: project(h * scale[:, None]), to_kernel)
        held = project(tf.concat(forms._direct_products(rows, output_grads, num_views), axis=-1)
                       * scale[:, None])
        squares = forms.held_squares(held)
        return squares, forms._summer(held, squares, to_kernel)

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
    unit_norm = forms._root(precision.upper(unit_sq, 2.0 * precision.square_sum_error(fan_in)))
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
    norm = forms._root(projected) + stretch * slack + rounding * (forms._root(whole) + slack)
    return precision.upper(norm, 8 * _U)
