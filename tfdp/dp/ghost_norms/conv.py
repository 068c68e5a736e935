"""Convolution kernels: Conv2D (grouped too) and DepthwiseConv2D, NHWC.

A convolution is a dense layer applied to every input patch: its kernel's
rule is `dense.kernel_sq_norms` over the patches (`conv2d_patches`), which
on a GPU or TPU builds its direct form as one grouped convolution
(`conv2d_example_gradients`; Rochette et al. 2019) and may recompute it
(`forms.GROUPED_CONV_GRADIENTS`, `forms.RECOMPUTED_GRADIENTS`). Grouped and
depthwise kernels are held, group by group. Kong, Ribero & Velegkas 2024
for convolutions' ghost norms. A weight-standardized kernel:
`tfdp.dp.ghost_norms.weight_standardized`. Tap rules:
`tfdp.training.ghost_taps.conv`.
"""

import numpy as np
import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla  # TensorFlow's own XLA op wrappers
from tensorflow.compiler.xla import xla_data_pb2

from tfdp.dp import device_arithmetic
from tfdp.dp import precision
from tfdp.dp.ghost_norms import dense
from tfdp.dp.ghost_norms import forms
from tfdp.dp.ghost_norms.rows import (Rows, _largest_entry, _one_block_at_a_time,
                                      _times_per_image, example_rows)

# Patches larger than this many floats per example are built one kernel row
# at a time (a WRN-16-4 stage-1 conv has 590k: 150 MB at B = 64).
_BLOCK_FLOATS = 2**14


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
    gradient (Rochette et al. 2019). A stride s takes one such convolution
    per phase of the kernel offsets (at most s^2), each over its input phase
    `a[r::s, t::s]`. The K views of an example are summed, one view at a
    time. One pass at the device's precision, like any held vector
    (`forms._direct_products`). `forms.per_example_convs()` may take one
    convolution per example instead (`_one_convolution_per_example`) or
    batch groups (`_batch_grouped_correlation`).

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
    if (forms.per_example_convs() == "per_example" and inputs.shape[0] is not None
            and channels >= forms.PER_EXAMPLE_MIN_CHANNELS):
        return _one_convolution_per_example(inputs, output_grads, kernel_size=kernel_size,
                                            strides=strides, dilation_rate=dilation_rate,
                                            num_views=num_views)
    s = sh
    # Stride s: offset y = s * alpha + r reads input row (p + alpha) s + r, row p + alpha of
    # the input's phase r (`a[r::s]`): one stride-1 correlation per phase (r, t), each of
    # the offsets it owns only (a dilated filter would compute every phase for every
    # offset: 4x the work of a strided 1x1 convolution), interleaved afterwards.
    phases_h, phases_w = range(min(s, kh)), range(min(s, kw))
    # (batch groups need a static batch: an unknown one keeps the depthwise convolution)
    batch_grouped = forms.per_example_convs() == "batch_grouped" and inputs.shape[0] is not None
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
                # Offset (y, x) reads input (p s + y d): the input strided by d.
                if batch_grouped:
                    out[r, t] = _batch_grouped_correlation(phase, kernel, dh)
                    continue
                # [C, H, W, n]
                lhs = device_arithmetic.device_rounded(tf.transpose(phase, [3, 1, 2, 0]))
                out[r, t] = tf.nn.depthwise_conv2d(lhs, kernel, strides=[1, dh, dh, 1],
                                                   padding="VALID")  # [C, ka_r, kb_t, n O]
        if s > 1:
            out = _interleave_phases(out, s, kh, kw)
        else:
            out = out[0, 0]
        total = out if total is None else total + out  # [channels, kh, kw, batch * filters]
    total = tf.reshape(total, [channels, kh, kw, -1, filters])
    return tf.transpose(total, [3, 1, 2, 0, 4])


def _batch_grouped_correlation(phase: tf.Tensor, kernel: tf.Tensor, stride: int) -> tf.Tensor:
    """`[C, ka, kb, n O]`: each example's input phase correlated with its own output gradient.

    One XLA convolution with `batch_group_count` = n (`tf2xla`'s `XlaConvV2`,
    compiled on demand outside `jit_compile`): the examples' channels are
    the batch `[n C, H, W, 1]`, example-major, and the output gradients the
    filter `[oh, ow, 1, n O]`; group i pairs example i's C rows with its O
    output features. XLA may lower it with products of one example's output
    gradients and zeros standing for another's (XLA's CPU backend does,
    outside a loop): 0 * inf would put NaN in other examples' gradients. So
    an example whose phase or output gradients hold a non-finite value
    enters as zeros and gets NaN gradients (its squares are then not
    finite: factor 0, and the example-at-a-time fallback), and every
    example's gradient depends on its own operands only, however XLA lowers
    the convolution. A TPU's compiler lowers it at about the plain kernel
    gradient's multiply-adds (1.0-1.2x for WRN-16-4's 3x3 layers, against n
    times them for a convolution of n < 128 feature groups), but the whole
    step moves 1.5-1.6x the grouped route's bytes (docs/performance.md,
    "Batch groups"). The result's layout is `tf.nn.depthwise_conv2d`'s.

    Args:
      phase: float32 `[n, H, W, C]`, the input phase the offsets read.
      kernel: float32 `[oh, ow, n, O]`, the output gradients, rounded as the
        device's.
      stride: the window stride on the input (the convolution's dilation).
    """
    n, height, width, channels = phase.shape
    oh, ow, _, filters = kernel.shape
    finite = tf.logical_and(tf.reduce_all(tf.math.is_finite(phase), axis=[1, 2, 3]),
                            tf.reduce_all(tf.math.is_finite(kernel), axis=[0, 1, 3]))  # [n]
    phase = tf.where(finite[:, None, None, None], phase, 0.0)
    kernel = tf.where(finite[None, None, :, None], kernel, 0.0)
    lhs = tf.reshape(tf.transpose(phase, [0, 3, 1, 2]), [n * channels, height, width, 1])
    lhs = device_arithmetic.device_rounded(lhs)
    rhs = tf.reshape(kernel, [oh, ow, 1, n * filters])
    out = xla.conv(lhs, rhs, window_strides=[stride, stride], padding=[(0, 0), (0, 0)],
                   lhs_dilation=[1, 1], rhs_dilation=[1, 1],
                   dimension_numbers=_nhwc_hwio_numbers(), batch_group_count=n, use_v2=True)
    # (the op's shape function leaves the spatial sizes unknown)
    out = tf.ensure_shape(out, [channels, (height - oh) // stride + 1,
                                (width - ow) // stride + 1, n * filters])
    return tf.where(tf.repeat(finite, filters)[None, None, None, :], out, float("nan"))


def _nhwc_hwio_numbers():
    """XLA's ConvolutionDimensionNumbers for NHWC inputs and outputs, HWIO kernels."""
    numbers = xla_data_pb2.ConvolutionDimensionNumbers(
        input_batch_dimension=0, input_feature_dimension=3,
        kernel_input_feature_dimension=2, kernel_output_feature_dimension=3,
        output_batch_dimension=0, output_feature_dimension=3)
    numbers.input_spatial_dimensions.extend([1, 2])
    numbers.kernel_spatial_dimensions.extend([0, 1])
    numbers.output_spatial_dimensions.extend([1, 2])
    return numbers


def _one_convolution_per_example(inputs: tf.Tensor, output_grads: tf.Tensor, *, kernel_size,
                                 strides, dilation_rate, num_views: int) -> tf.Tensor:
    """`conv2d_example_gradients` as one kernel-gradient convolution per example.

    Example i's gradient is the plain step's kernel gradient of a batch of
    its K views alone (`tf.nn.conv2d` differentiated with respect to its
    filter: the convolution a compiler emits for a layer's kernel gradient),
    unrolled over the examples: no groups (a TPU's compiler makes a
    convolution of fewer than 128 groups one dense convolution against a
    masked kernel, n times the multiply-adds) and no patches. Operands are
    rounded as the device's (`device_arithmetic.device_rounded`), as the
    grouped route's.

    Args:
      inputs: float32 `[batch * K, height, width, channels]`, padded, with a
        static batch.
      output_grads: float32 `[batch * K, out_height, out_width, filters]`.
      kernel_size, strides, dilation_rate: pairs of ints, the convolution's.
      num_views: K; example i's views are rows `i K .. i K + K - 1`.

    Returns:
      float32 `[batch, kh, kw, channels, filters]`.
    """
    filter_shape = [*kernel_size, inputs.shape[-1], output_grads.shape[-1]]
    a = device_arithmetic.device_rounded(inputs)
    g = device_arithmetic.device_rounded(output_grads)
    return tf.stack([
        tf.compat.v1.nn.conv2d_backprop_filter(
            a[i:i + num_views], filter_shape, g[i:i + num_views],
            strides=[1, *strides, 1], padding="VALID", dilations=[1, *dilation_rate, 1])
        for i in range(0, inputs.shape[0], num_views)])


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
    squares, weighted_sum = dense.kernel_sq_norms(rows, output_grads, num_views=num_views)
    shape = [*kernel_size, inputs.shape[-1], output_grads.shape[-1]]
    return squares, lambda factors: tf.reshape(weighted_sum(factors), shape)


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
    the weighted sum adds exactly these gradients (the direct form of
    `forms`' "Rounding"). G = 1 is an ordinary convolution, which `conv2d_kernel_sq_norms`
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
    squares = forms.held_squares(h)
    return squares, forms._summer(h, squares)
