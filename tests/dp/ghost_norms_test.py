"""Tests for tfdp.dp.ghost_norms: each rule against per-example gradients taken one by one."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import example, given, settings, strategies as st

from tfdp.dp import ghost_norms
from tfdp.dp.ghost_norms import conv as conv_norms
from tfdp.dp.ghost_norms import forms
from tfdp.dp import device_arithmetic
from tfdp.dp import precision

import os
RNG = np.random.default_rng(int(os.environ.get("GSEED", "0")))


def _normal(*shape, scale=1.0):
    return tf.constant(RNG.normal(size=shape) * scale, tf.float32)


def _counted(monkeypatch, module, name, calls, replacement=None):
    """`module.name` replaced by `replacement` (or kept), its calls counted in `calls[name]`."""
    called = replacement or getattr(module, name)
    calls[name] = 0

    def counting(*args, **kwargs):
        calls[name] += 1
        return called(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)


@pytest.fixture(params=[ghost_norms.DIRECT, ghost_norms.GRAM])
def form(request, monkeypatch):
    """Runs a test once per kernel form, whatever the shapes would choose.

    Fails if no rule read the form: set on a module the rules do not read, it would not take.
    """
    calls = {}
    _counted(monkeypatch, forms, "choose_form", calls, lambda *_: request.param)
    yield request.param
    assert calls["choose_form"], "no kernel rule read the form set on `forms`"


CONV_FORMS = ["direct", "direct_grouped", "direct_recomputed", "gram"]


@pytest.fixture(params=CONV_FORMS)
def conv_form(request, monkeypatch):
    """As `form`, for convolutions: the direct form from patches, or from one grouped
    convolution (`conv2d_example_gradients`, a GPU's or a TPU's route), held or recomputed
    chunk by chunk (`_recomputed`, one example per chunk), or the Gram form.

    Fails if a rule did not take the route set: where a kernel has a grouped route (it asks
    `grouped_conv_gradients()`), the grouped and recomputed params build its gradients by
    grouped convolutions, the recomputed one chunk by chunk, the others neither.
    """
    form = ghost_norms.GRAM if request.param == "gram" else ghost_norms.DIRECT
    grouped = request.param in ("direct_grouped", "direct_recomputed")
    calls = {}
    _counted(monkeypatch, forms, "choose_form", calls, lambda *_: form)
    monkeypatch.setattr(forms, "GROUPED_CONV_GRADIENTS", grouped)
    monkeypatch.setattr(forms, "RECOMPUTED_GRADIENTS", request.param == "direct_recomputed")
    monkeypatch.setattr(forms, "RECOMPUTE_CHUNK_EXAMPLES", 1)
    for module, name in ((forms, "grouped_conv_gradients"), (forms, "_recomputed"),
                         (conv_norms, "conv2d_example_gradients")):
        _counted(monkeypatch, module, name, calls)
    yield form
    assert calls["choose_form"], "no kernel rule read the form set on `forms`"
    routed = calls["grouped_conv_gradients"] > 0
    assert bool(calls["conv2d_example_gradients"]) == (grouped and routed), calls
    assert bool(calls["_recomputed"]) == (request.param == "direct_recomputed" and routed), calls


def _per_example(loss_of_example, variable, batch):
    """Gradient of `loss_of_example(i)` wrt `variable`, for each i, by an explicit loop."""
    grads = []
    for i in range(batch):
        with tf.GradientTape() as tape:
            loss = loss_of_example(i)
        grads.append(tf.convert_to_tensor(tape.gradient(loss, variable)).numpy())  # or slices
    return np.stack(grads)


# The contract: the
# vector a rule adds for an example (`weighted_sum` at that example's one-hot factors,
# as the device computes it) has a squared norm no larger than the rule's `squares`.
# Against the exact (float64) gradient the rule may differ by float32 rounding: a held
# vector is a float32 sum, which on a cancelling example (a square 1e-4 of the batch's
# largest) comes out 2.4e-5 below the exact square (found with another draw of these
# normals; the vector added is what the clipping must bound, and it does). Above, the
# squares may over-count: by at most 2e-3 (1e-3 on the norm, the target's 99th
# percentile) in any one case; the median over-count on real images is measured by
# benchmarks/ghost_overcount.py (docs/design/ghost_norms_and_precision.md). A Gram-form WS
# kernel of these 3-example draws over-counts its square by up to 2.5e-4 (seeds 0-8).
OVERCOUNT_RTOL = 2e-3
EXACT_RTOL = 1e-4


def _check(result, per_example, factors):
    """`(squares, weighted_sum)` against the explicit per-example gradients."""
    squares, weighted_sum = result
    assert squares.dtype == tf.float32
    batch = len(per_example)
    for i in range(batch):  # the contract: the vector added is within its square
        added = weighted_sum(tf.one_hot(i, batch, dtype=tf.float32)).numpy()
        added_square = np.sum(added.astype(np.float64) ** 2)
        assert squares.numpy()[i] >= added_square * (1 - 1e-6), (i, squares, added_square)
    expected = np.sum(per_example.reshape(batch, -1) ** 2, axis=1)
    # The rule adds its rounding bound: where the gradient cancels to nearly 0 that
    # is absolutely tiny next to the batch's largest square.
    atol = 1e-9 * max(1.0, float(np.max(expected)))
    assert np.all(squares.numpy() >= expected * (1 - EXACT_RTOL) - atol), (squares, expected)
    assert np.all(squares.numpy() <= expected * (1 + OVERCOUNT_RTOL) + atol), (squares, expected)
    summed = weighted_sum(tf.constant(factors, tf.float32))
    # A float32 sum over examples: an entry that cancels is off by about 2^-24 of the
    # terms summed, not of the result.
    scale = np.tensordot(np.abs(factors), np.abs(per_example), 1)
    np.testing.assert_allclose(summed.numpy(), np.tensordot(factors, per_example, 1),
                               rtol=1e-5, atol=1e-6 * max(1.0, float(np.max(scale))))


# -- Patches ---------------------------------------------------------------------

PATCH_CASES = [
    # (input shape, kernel, strides, dilation, padding)
    ((2, 28, 28, 3), (8, 8), (2, 2), (1, 1), "valid"),  # Tramer CNN: space-to-depth blocks
    ((2, 12, 12, 4), (4, 4), (2, 2), (1, 1), "same"),
    ((2, 9, 9, 3), (3, 3), (2, 2), (1, 1), "same"),  # stride 2, kernel 3: per-offset slices
    ((2, 8, 8, 3), (1, 1), (2, 2), (1, 1), "same"),  # 1x1 strided shortcut
    ((2, 10, 11, 2), (3, 2), (1, 2), (2, 1), "same"),  # unequal strides: extract_patches
    ((2, 9, 9, 2), (3, 3), (1, 1), (2, 2), "valid"),  # dilation
    ((2, 7, 7, 2), (2, 2), (2, 2), (1, 1), "same"),  # odd size, padded to the stride
    ((2, 32, 32, 64), (3, 3), (1, 1), (1, 1), "same"),  # large: one block per kernel row
]


@pytest.mark.parametrize("shape, kernel, strides, dilation, padding", PATCH_CASES)
def test_patches_equal_extract_patches(shape, kernel, strides, dilation, padding):
    x = _normal(*shape)
    rows = ghost_norms.conv2d_patches(x, kernel_size=kernel, strides=strides,
                                      dilation_rate=dilation, padding=padding)
    patches = tf.concat([block() for block in rows.blocks], axis=-1)
    if rows.order is not None:
        patches = tf.gather(patches, np.argsort(rows.order), axis=-1)
    expected = tf.image.extract_patches(x, [1, *kernel, 1], [1, *strides, 1],
                                        [1, *dilation, 1], padding.upper())
    np.testing.assert_array_equal(patches.numpy(), expected.numpy())
    assert rows.fan_in == kernel[0] * kernel[1] * shape[-1]


def test_large_patches_come_in_one_block_per_kernel_row():
    # 32 * 32 positions * 576 entries > 2**16 floats per example: 3 rows of 3 offsets.
    rows = ghost_norms.conv2d_patches(_normal(1, 32, 32, 64), kernel_size=(3, 3),
                                      strides=(1, 1), dilation_rate=(1, 1), padding="same")
    assert [block().shape[-1] for block in rows.blocks] == [192, 192, 192]


# -- Kernels ---------------------------------------------------------------------


@pytest.mark.parametrize("num_views", [1, 3])
def test_dense_kernel_with_positions_and_views(form, num_views):
    # Example i's rows are its K views x 4 positions; its gradient is their sum.
    batch, fan_in, fan_out = 3, 5, 4
    a = _normal(batch * num_views, 4, fan_in)
    g = _normal(batch * num_views, 4, fan_out)
    kernel = tf.Variable(_normal(fan_in, fan_out))

    def loss(i):  # sum over the example's rows of z . g, z = a @ W: dL/dz = g
        rows = slice(i * num_views, (i + 1) * num_views)
        return tf.reduce_sum(tf.matmul(a[rows], kernel) * g[rows])

    result = ghost_norms.kernel_sq_norms(ghost_norms.Rows.of(a), g, num_views=num_views)
    _check(result, _per_example(loss, kernel, batch), factors=[0.5, 0.0, 2.0])


CONV_CASES = [  # (kernel, strides, padding, input size)
    ((3, 3), (1, 1), "same", 6),
    ((4, 4), (2, 2), "same", 8),  # space-to-depth patch order
    ((3, 3), (2, 2), "same", 7),
    ((1, 1), (2, 2), "valid", 6),
    ((3, 2), (2, 1), "same", 7),  # unequal strides: patches on every route (no grouped one)
]


@pytest.mark.parametrize("kernel_size, strides, padding, size", CONV_CASES)
@pytest.mark.parametrize("num_views", [1, 2])
def test_conv2d_kernel(conv_form, kernel_size, strides, padding, size, num_views):
    batch, channels, filters = 3, 3, 5
    x = _normal(batch * num_views, size, size, channels)
    kernel = tf.Variable(_normal(*kernel_size, channels, filters))
    out = tf.nn.conv2d(x, kernel, [1, *strides, 1], padding.upper())
    g = _normal(*out.shape)

    def loss(i):
        rows = slice(i * num_views, (i + 1) * num_views)
        return tf.reduce_sum(tf.nn.conv2d(x[rows], kernel, [1, *strides, 1], padding.upper())
                             * g[rows])

    result = ghost_norms.conv2d_kernel_sq_norms(x, g, kernel_size=kernel_size, strides=strides,
                                                dilation_rate=(1, 1), padding=padding,
                                                num_views=num_views)
    _check(result, _per_example(loss, kernel, batch), factors=[1.0, 0.25, 0.0])


def _standardize(kernel, epsilon):
    """tfdp.models.WSConv2D.standardize_kernel, written out for the test."""
    fan_in = int(np.prod(kernel.shape[:-1]))
    mean = tf.reduce_mean(kernel, axis=(0, 1, 2), keepdims=True)
    var = tf.math.reduce_variance(kernel, axis=(0, 1, 2), keepdims=True)
    return (kernel - mean) * tf.math.rsqrt(tf.maximum(var * fan_in, epsilon))


@pytest.mark.parametrize("kernel_size, strides, padding, size", CONV_CASES[:3])
@pytest.mark.parametrize("num_views", [1, 2])
def test_ws_kernel_chains_through_the_standardization(conv_form, kernel_size, strides, padding,
                                                      size, num_views):
    # The gradient wrt the VARIABLE W, not wrt the standardized kernel U = WS(W).
    batch, channels, filters, epsilon = 3, 3, 4, 1e-4
    x = _normal(batch * num_views, size, size, channels)
    kernel = tf.Variable(_normal(*kernel_size, channels, filters))

    def conv(inputs):
        return tf.nn.conv2d(inputs, _standardize(kernel, epsilon), [1, *strides, 1],
                            padding.upper())

    out = conv(x)
    g = _normal(*out.shape)

    def loss(i):
        rows = slice(i * num_views, (i + 1) * num_views)
        return tf.reduce_sum(conv(x[rows]) * g[rows])

    rows = ghost_norms.conv2d_patches(x, kernel_size=kernel_size, strides=strides,
                                      dilation_rate=(1, 1), padding=padding)
    result = ghost_norms.ws_kernel_sq_norms(rows, g, kernel, epsilon=epsilon,
                                            num_views=num_views)
    per_example = _per_example(loss, kernel, batch)
    _check(result, per_example, factors=[0.3, 1.0, 0.0])
    # Not the norm of the gradient wrt U (that would differ by the projection and 1/s).
    u_norms = ghost_norms.conv2d_kernel_sq_norms(
        x, g, kernel_size=kernel_size, strides=strides, dilation_rate=(1, 1), padding=padding,
        num_views=num_views)[0]
    assert not np.allclose(u_norms.numpy(), result[0].numpy(), rtol=1e-2)


def test_ws_kernel_below_epsilon_has_no_sphere_term(form):
    # Output channel 0 is nearly constant (|c_0|^2 < epsilon), channel 1 is not: the
    # first has scale epsilon^-1/2 and no u-term, the second the full projection.
    epsilon = 1e-2
    kernel = tf.Variable(tf.stack([1.0 + 1e-3 * _normal(3, 3, 2), _normal(3, 3, 2)], axis=-1))
    x = _normal(2, 5, 5, 2)

    def conv(inputs):
        return tf.nn.conv2d(inputs, _standardize(kernel, epsilon), 1, "SAME")

    out = conv(x)
    g = _normal(*out.shape)
    rows = ghost_norms.conv2d_patches(x, kernel_size=(3, 3), strides=(1, 1),
                                      dilation_rate=(1, 1), padding="same")
    result = ghost_norms.ws_kernel_sq_norms(rows, g, kernel, epsilon=epsilon)
    per_example = _per_example(lambda i: tf.reduce_sum(conv(x[i:i + 1]) * g[i:i + 1]),
                               kernel, 2)
    _check(result, per_example, factors=[1.0, 0.5])


# -- Einsum, depthwise and embedding kernels --------------------

EINSUM_CASES = [  # (equation, input shape without batch, kernel shape)
    ("abc,cde->abde", (4, 6), (6, 2, 3)),  # attention's query/key/value projections
    ("abcd,cde->abe", (4, 2, 3), (2, 3, 5)),  # attention's output projection
    ("ab,bc->ac", (5,), (5, 3)),  # Dense
    ("abcd,de->abce", (2, 3, 4), (4, 2)),  # two position axes
]


@pytest.mark.parametrize("equation, in_shape, kernel_shape", EINSUM_CASES)
@pytest.mark.parametrize("num_views", [1, 2])
def test_einsum_kernel(form, equation, in_shape, kernel_shape, num_views):
    batch = 3
    x = _normal(batch * num_views, *in_shape)
    kernel = tf.Variable(_normal(*kernel_shape))
    g = _normal(*tf.einsum(equation, x, kernel).shape)

    def loss(i):
        rows = slice(i * num_views, (i + 1) * num_views)
        return tf.reduce_sum(tf.einsum(equation, x[rows], kernel) * g[rows])

    result = ghost_norms.einsum_kernel_sq_norms(x, g, equation, kernel_shape,
                                                num_views=num_views)
    _check(result, _per_example(loss, kernel, batch), factors=[0.5, 0.0, 2.0])


@pytest.mark.parametrize("equation", [
    "abc,dce->abde",  # the kernel does not contract its leading axes
    "abc,cde->abed",  # the output's kernel axes reordered
    "abc,acd->abd",  # the batch axis in the kernel
    "...b,bc->...c",  # an ellipsis
    "abc,cd->ad",  # a position axis summed away
])
def test_einsum_equations_outside_the_rule_are_refused(equation):
    with pytest.raises(ghost_norms.UnsupportedLayer, match="einsum equation"):
        ghost_norms.einsum_kernel_geometry(equation, len(equation.split(",")[1].split("-")[0]))


def test_einsum_contracting_several_trailing_axes_is_a_flattened_dense():
    assert ghost_norms.einsum_kernel_geometry("abc,bcd->ad", 3) == (1, 2)


DEPTHWISE_CASES = [  # (kernel, strides, dilation, padding, size, depth_multiplier)
    ((3, 3), (1, 1), (1, 1), "same", 6, 1),
    ((3, 3), (2, 2), (1, 1), "same", 7, 2),
    ((4, 4), (2, 2), (1, 1), "valid", 8, 1),  # space-to-depth patch order
    ((3, 3), (1, 1), (2, 2), "valid", 7, 2),  # dilation
    ((2, 3), (1, 2), (1, 1), "same", 6, 1),  # unequal strides: extract_patches
]


def _depthwise_by_patches(inputs, kernel, strides, dilation, padding):
    """A depthwise conv as patches x kernel: TensorFlow's own CPU kernel takes unequal
    strides only with oneDNN on (off, it raises "only supports equal length strides")."""
    kh, kw, channels, multiplier = kernel.shape
    patches = tf.image.extract_patches(inputs, [1, kh, kw, 1], [1, *strides, 1],
                                       [1, *dilation, 1], padding.upper())
    patches = tf.reshape(patches, [*patches.shape[:3], kh, kw, channels])
    out = tf.einsum("bhwijc,ijcm->bhwcm", patches, kernel)
    return tf.reshape(out, [*out.shape[:3], channels * multiplier])


def test_the_patch_reference_is_tensorflow_s_depthwise_conv():
    x, kernel = _normal(2, 6, 6, 3), tf.Variable(_normal(2, 3, 3, 2))
    for strides, padding in (((1, 1), "same"), ((2, 2), "valid"), ((1, 2), "same")):
        try:
            expected = tf.nn.depthwise_conv2d(x, kernel, [1, *strides, 1], padding.upper())
        except tf.errors.InvalidArgumentError:  # unequal strides without oneDNN
            assert strides[0] != strides[1]
            continue
        np.testing.assert_allclose(
            _depthwise_by_patches(x, kernel, strides, (1, 1), padding), expected,
            rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel_size, strides, dilation, padding, size, multiplier",
                         DEPTHWISE_CASES)
@pytest.mark.parametrize("num_views", [1, 2])
def test_depthwise_kernel(kernel_size, strides, dilation, padding, size, multiplier,
                          num_views):
    batch, channels = 3, 3
    x = _normal(batch * num_views, size, size, channels)
    kernel = tf.Variable(_normal(*kernel_size, channels, multiplier))

    def conv(inputs):
        if strides[0] != strides[1]:
            return _depthwise_by_patches(inputs, kernel, strides, dilation, padding)
        return tf.nn.depthwise_conv2d(inputs, kernel, [1, *strides, 1], padding.upper(),
                                      dilations=dilation)

    g = _normal(*conv(x).shape)

    def loss(i):
        rows = slice(i * num_views, (i + 1) * num_views)
        return tf.reduce_sum(conv(x[rows]) * g[rows])

    result = ghost_norms.depthwise_kernel_sq_norms(
        x, g, kernel_size=kernel_size, strides=strides, dilation_rate=dilation,
        padding=padding, depth_multiplier=multiplier, num_views=num_views)
    _check(result, _per_example(loss, kernel, batch), factors=[1.0, 0.25, 0.0])


@pytest.mark.parametrize("num_views", [1, 2])
def test_embedding_table_with_repeated_ids(num_views):
    # Example 0 repeats id 2 (its two output gradients add in row 2), example 1 has
    # distinct ids, example 2 one id everywhere.
    batch, vocabulary, dim = 3, 6, 4
    ids = np.array([[2, 5, 2, 0], [1, 3, 4, 0], [5, 5, 5, 5]])
    ids = tf.constant(np.repeat(ids, num_views, axis=0)[:, :, None] * np.ones((1, 1, 2), int))
    table = tf.Variable(_normal(vocabulary, dim))
    g = _normal(batch * num_views, 4, 2, dim)

    def loss(i):
        rows = slice(i * num_views, (i + 1) * num_views)
        return tf.reduce_sum(tf.gather(table, ids[rows]) * g[rows])

    per_example = _per_example(loss, table, batch)
    result = ghost_norms.embedding_sq_norms(ids, g, vocabulary, num_views=num_views)
    _check(result, per_example, factors=[0.5, 0.0, 2.0])


def test_embedding_negative_ids_are_the_rows_keras_takes():
    # keras.ops.take maps id -1 to row vocabulary - 1: ids -1 and 5 of a 6-row table are
    # the same row, so their output gradients add before the norm (taken apart, the norm
    # would be |g_0|^2 + |g_1|^2, too small when they point the same way).
    vocabulary = 6
    ids = tf.constant([[-1, 5], [-2, 0]])
    table = tf.Variable(_normal(vocabulary, 3))
    g = tf.constant([[[1.0, 2.0, 0.0], [1.0, 2.0, 0.0]], [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]])

    def loss(i):
        from keras import ops
        return tf.reduce_sum(ops.take(table, ids[i], axis=0) * g[i])

    result = ghost_norms.embedding_sq_norms(ids, g, vocabulary)
    _check(result, _per_example(loss, table, 2), factors=[1.0, 0.5])
    assert result[0].numpy()[0] == pytest.approx(20.0, rel=1e-5)  # |(2, 4, 0)|^2, not 5 + 5
    assert result[0].numpy()[0] >= 20.0


# -- Broadcast parameters ------------------------------------------------------


@pytest.mark.parametrize("num_views", [1, 2])
@pytest.mark.parametrize("shape", [(), (4,)])
def test_scale_and_bias(shape, num_views):
    batch = 3
    x = _normal(batch * num_views, 5, 5, 4)
    g = _normal(batch * num_views, 5, 5, 4)
    # The gradients of z = x * scale + bias, in float64: sum over an example's positions
    # and views of x * g (scale) and of g (bias), summed over the channels for a scalar.
    # (A float32 reference cancels in these sums more than the rule, which is float64.)
    rows = lambda t: t.numpy().astype(np.float64).reshape(batch, -1, 4)  # noqa: E731
    per_channel = {"scale": (rows(x) * rows(g)).sum(axis=1), "bias": rows(g).sum(axis=1)}
    if shape == ():
        per_channel = {k: v.sum(axis=1) for k, v in per_channel.items()}
    factors = [2.0, 0.0, 1.0]
    _check(ghost_norms.broadcast_sq_norms(g, shape, inputs=x, num_views=num_views),
           per_channel["scale"], factors)
    _check(ghost_norms.broadcast_sq_norms(g, shape, num_views=num_views),
           per_channel["bias"], factors)


def test_a_zero_factor_drops_a_non_finite_gradient():
    # Example 1's gradient is inf: its squared norm is inf, and with factor 0 the
    # weighted sum is example 0's alone (clip_factors gives 0 to non-finite norms).
    g = tf.constant([[[1.0, 2.0]], [[np.inf, 0.0]]])
    squares, weighted_sum = ghost_norms.broadcast_sq_norms(g, (2,))
    assert np.isinf(squares.numpy()[1])
    np.testing.assert_array_equal(weighted_sum(tf.constant([0.5, 0.0])).numpy(), [0.5, 1.0])


# -- Choices -------------------------------------------------------------------


WRN_16_4_KERNELS = [  # (R, fan_in, fan_out, weight-standardized) of WRN-16-4 at 32x32
    (1024, 27, 16, True), (1024, 144, 64, True), (1024, 16, 64, True), (1024, 576, 64, True),
    (256, 576, 128, True), (256, 64, 128, True), (256, 1152, 128, True),
    (64, 1152, 256, True), (64, 128, 256, True), (64, 2304, 256, True), (1, 256, 10, False)]


def test_form_choice_follows_the_costs():
    # CPU (float32 plan, one pass per product): WRN-16-4's stage 3 (R = 64, 3x3x256 ->
    # 256) was Gram by the textbook count (590k > 2 * 64 * 2560), but its Grams alone
    # are 64^2 * 2560 = 10.5M per example against the direct form's extra 2 * 590k:
    # direct. A dense layer on one row (R = 1): Gram (it holds 266 floats, not 2,560).
    assert ghost_norms.choose_form(1024, 576, 64) == ghost_norms.DIRECT
    assert ghost_norms.choose_form(64, 2304, 256) == ghost_norms.DIRECT
    assert ghost_norms.choose_form(64, 2304, 256, True) == ghost_norms.DIRECT
    assert ghost_norms.choose_form(1, 256, 10) == ghost_norms.GRAM
    assert ghost_norms.choose_form(4, 512, 512) == ghost_norms.GRAM  # 16k vs 8 * 262k
    assert ghost_norms.choose_form(None, 2304, 256) == ghost_norms.DIRECT
    assert not ghost_norms.grouped_conv_gradients()  # patches on a CPU


@pytest.mark.parametrize("device", [device_arithmetic.TF32, device_arithmetic.BF16])
def test_form_choice_counts_the_split_passes(device):
    # On a GPU or a TPU every Gram product is six passes: R = 4 (16k x 6 + 5 x 4 x 262k
    # = 5.3M > 8 x 262k) becomes direct, and every WRN-16-4 kernel but the dense head
    # is direct (XLA: 1.05x the plain step's flops instead of 3.4x: step_cost.md). A large
    # head on one row stays Gram: the direct form would hold 2M floats per example.
    with device_arithmetic.emulate(device):
        assert ghost_norms.choose_form(4, 512, 512) == ghost_norms.DIRECT
        assert ghost_norms.choose_form(1, 2048, 1000) == ghost_norms.GRAM
        assert ghost_norms.choose_form(1, 2048, 1000, True) == ghost_norms.DIRECT
        forms = [ghost_norms.choose_form(*kernel) for kernel in WRN_16_4_KERNELS]
        assert forms == [ghost_norms.DIRECT] * 10 + [ghost_norms.GRAM]
        assert ghost_norms.grouped_conv_gradients()  # grouped convolutions there


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(1, 4096), st.integers(1, 5000), st.integers(1, 5000), st.booleans(),
       st.sampled_from([device_arithmetic.FLOAT32, device_arithmetic.TF32]))
def test_the_gram_form_holds_less_and_costs_at_most_4x_more(rows, fan_in, fan_out,
                                                            standardized, device):
    # What the docstring promises, against the work the rules do, counted here
    # independently: a Gram pick never holds more per example than the direct form,
    # nor does more than 4x its extra work; a direct pick fails one of the two.
    passes = 6 if device is device_arithmetic.TF32 else 1
    with device_arithmetic.emulate(device):
        form = ghost_norms.choose_form(rows, fan_in, fan_out, standardized)
    grams = passes * rows**2 * (fan_in + fan_out)
    sums = (passes - 1 + (passes if standardized else 0)) * rows * fan_in * fan_out
    fits = (rows * (fan_in + fan_out) < fan_in * fan_out
            and grams + sums <= 8 * fan_in * fan_out)
    assert form == (ghost_norms.GRAM if fits else ghost_norms.DIRECT)


def test_rules_match_their_exact_class_only():
    class Base:
        pass

    class Derived(Base):
        pass

    ghost_norms.register_layer_rule(Base, "rule")
    assert ghost_norms.find_layer_rule(Base()) == "rule"
    assert ghost_norms.find_layer_rule(Derived()) is None


def test_the_per_example_convs_switch_defaults_to_grouped_and_refuses_other_values(
        monkeypatch):
    assert forms.per_example_convs() == "grouped"
    monkeypatch.setattr(forms, "PER_EXAMPLE_CONVS", "loop")
    with pytest.raises(ValueError, match="PER_EXAMPLE_CONVS='loop'"):
        forms.per_example_convs()


@pytest.mark.parametrize("route", ["grouped", "batch_grouped"])
def test_one_examples_non_finite_gradient_leaves_the_others_bit_for_bit(monkeypatch, route):
    # XLA may lower batch groups with products of one example's output gradients and zeros
    # standing for another's (0 * inf = NaN): an inf or a NaN in example 1's output gradients
    # or its input must leave the other examples' gradients as they were, eagerly, in a graph
    # and under XLA, and make example 1's not finite (factor 0, the fallback). A batch
    # unknown at trace time keeps the depthwise convolution.
    monkeypatch.setattr(forms, "PER_EXAMPLE_CONVS", route)
    x, g = _normal(3, 8, 8, 2).numpy(), _normal(3, 3, 3, 4).numpy()

    def gradients(x, g):
        return conv_norms.conv2d_example_gradients(x, g, kernel_size=(3, 3), strides=(2, 2),
                                                   dilation_rate=(1, 1))

    runs = [gradients, tf.function(gradients), tf.function(gradients, jit_compile=True)]
    for run in runs:
        clean = run(tf.constant(x), tf.constant(g)).numpy()
        for bad in (np.inf, -np.inf, np.nan):
            for which in ("g", "x"):
                xb, gb = x.copy(), g.copy()
                (gb if which == "g" else xb)[1, 1, 1, 0] = bad
                dirty = run(tf.constant(xb), tf.constant(gb)).numpy()
                np.testing.assert_array_equal(dirty[[0, 2]], clean[[0, 2]])
                assert not np.all(np.isfinite(dirty[1])), (run, bad, which)
    dynamic = tf.function(gradients, input_signature=[tf.TensorSpec([None, 8, 8, 2]),
                                                      tf.TensorSpec([None, 3, 3, 4])])
    np.testing.assert_allclose(dynamic(x, g).numpy(), clean, rtol=1e-5, atol=1e-5)


def test_per_example_convs_keep_a_stem_of_few_channels_grouped(monkeypatch):
    # "per_example": one kernel-gradient convolution per example, except below
    # PER_EXAMPLE_MIN_CHANNELS input channels (an image stem), which keeps the grouped one.
    monkeypatch.setattr(forms, "PER_EXAMPLE_CONVS", "per_example")

    def op_types(channels):
        a = tf.TensorSpec([4, 6, 6, channels], tf.float32)
        g = tf.TensorSpec([4, 4, 4, 5], tf.float32)
        graph = tf.function(lambda x, y: conv_norms.conv2d_example_gradients(
            x, y, kernel_size=(3, 3), strides=(1, 1), dilation_rate=(1, 1))
        ).get_concrete_function(a, g).graph
        return [op.type for op in graph.get_operations()]

    stem = op_types(forms.PER_EXAMPLE_MIN_CHANNELS - 1)
    wide = op_types(forms.PER_EXAMPLE_MIN_CHANNELS)
    assert "DepthwiseConv2dNative" in stem and "Conv2DBackpropFilter" not in stem
    assert wide.count("Conv2DBackpropFilter") == 4 and "DepthwiseConv2dNative" not in wide


def test_a_switch_set_on_the_package_raises_and_on_forms_reaches_the_rules(monkeypatch):
    # The rules read the switches and `choose_form` from `forms`: set on the package they would
    # reach no rule, so the package refuses them (and every name it re-exports).
    for name in ("choose_form", "GROUPED_CONV_GRADIENTS", "PER_EXAMPLE_CONVS",
                 "PER_EXAMPLE_MIN_CHANNELS", "RECOMPUTED_GRADIENTS", "RECOMPUTE_CHUNKS", "RECOMPUTE_CHUNK_EXAMPLES",
                 "kernel_sq_norms"):
        with pytest.raises(AttributeError, match="set it on the module that defines it"):
            monkeypatch.setattr(ghost_norms, name, None, raising=False)  # undone if it took
    assert ghost_norms.choose_form is forms.choose_form  # nothing was set
    a, g = _normal(4, 3, 6), _normal(4, 3, 5)
    picked = []
    monkeypatch.setattr(forms, "choose_form", lambda *args: picked.append(args) or forms.GRAM)
    ghost_norms.kernel_sq_norms(ghost_norms.Rows.of(a), g)
    ghost_norms.ws_kernel_sq_norms(ghost_norms.Rows.of(a), g, _normal(6, 5), epsilon=1e-4)
    assert picked == [(3, 6, 5), (3, 6, 5, True)]


# -- Rounding: norms never come out too small ------------------------

import contextlib  # noqa: E402
from unittest import mock  # noqa: E402


@contextlib.contextmanager
def _forced_form(form):
    """Every kernel rule within takes `form`; fails unless one read it (a patch that took)."""
    calls = []
    with mock.patch.object(forms, "choose_form", lambda *_: calls.append(form) or form):
        yield
    assert calls, "no kernel rule read the form set on `forms`"


def _exact_sq_norms(a, g, num_views, unit=None, scale=None):
    """|h|^2 (or |P h|^2 for WS) per example in long double from the float32 a, g, and
    S = sum_r |a_r| |g_r|, the size of the terms that cancel."""
    a = a.numpy().astype(np.longdouble).reshape(-1, num_views * a.shape[1], a.shape[2])
    g = g.numpy().astype(np.longdouble).reshape(-1, num_views * g.shape[1], g.shape[2])
    if scale is not None:
        g = g * scale
    h = np.einsum("brf,bro->bof", a, g)
    if unit is not None:
        h = h - h.mean(axis=-1, keepdims=True)
        h = h - unit.T * np.sum(unit.T * h, axis=-1, keepdims=True)
    terms = np.sum(np.sqrt(np.sum(a ** 2, axis=-1) * np.sum(g ** 2, axis=-1)), axis=1)
    return np.sum(h.reshape(len(h), -1) ** 2, axis=1), terms


@st.composite
def _cancelling_rows(draw):
    """Near-constant rows a (one pixel off a level in [0, 255]) and output gradients whose
    sum over the rows nearly cancels: the Gram and WS terms are then up to 1e10 times the
    squared norm, which float32 lost (a 3x3 conv at 255: 1.52 C)."""
    batch, views = draw(st.integers(1, 3)), draw(st.sampled_from([1, 3]))
    rows, fan_in, fan_out = draw(st.sampled_from([2, 4, 6])), draw(st.integers(3, 27)), \
        draw(st.integers(2, 12))
    level = draw(st.sampled_from([0.0, 1.0, 254.0, 255.0, 1e4]))
    off = draw(st.sampled_from([1.0, 1e-2, 0.0]))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    a = np.full((batch * views, rows, fan_in), level)
    a[np.arange(batch * views), rng.integers(0, rows, batch * views),
      rng.integers(0, fan_in, batch * views)] -= off
    signs = np.where(np.arange(rows) % 2 == 0, 1.0, -1.0)  # pairs cancel exactly
    base = rng.normal(size=(batch * views, 1, fan_out))
    jitter = draw(st.sampled_from([0.0, 1e-6, 1e-3, 1.0]))
    g = signs[None, :, None] * base + jitter * rng.normal(size=(batch * views, rows, fan_out))
    return (tf.constant(a, tf.float32), tf.constant(g, tf.float32), views,
            draw(st.sampled_from([ghost_norms.DIRECT, ghost_norms.GRAM])), seed)


def _assert_never_too_small(squares, exact, terms, weighted_sum, batch, *, held=False,
                            rows=None, projection=0):
    """Gram form: never below the exact squared norm of the gradient (a, g) define, and
    above it by at most 1e-2 relative, or 1e-4 of the cancelling terms' size S where the
    gradient is (nearly) zero (the contract: these inputs are adversarial, where
    the float32 bound may over-count; float64 rules would keep 1e-6). Direct form
    (`held`): the float32 per-example gradient is what the sum adds, so the bound is on
    it (below); it is within float32 rounding of the exact one (2^-24 (R + projection)
    S, `projection` the float32 WS projection's rounding). Both: the vector each example
    adds has at most the norm computed."""
    squares = squares.numpy().astype(np.longdouble)
    excess = np.sqrt(squares) - np.sqrt(exact)
    if held:
        assert np.all(np.abs(excess) <= 1e-6 * np.sqrt(exact)
                      + 2.0**-24 * (rows + projection) * terms)
    else:
        assert np.all(squares >= exact), (squares, exact)
        assert np.all(excess <= 1e-2 * np.sqrt(exact) + 1e-4 * terms), (excess, exact, terms)
    for i in range(batch):
        factors = np.zeros(batch, np.float32)
        factors[i] = 1.0
        added = weighted_sum(tf.constant(factors)).numpy().astype(np.longdouble)
        assert np.sqrt(np.sum(added ** 2)) <= np.sqrt(squares[i]) * (1 + 2.0**-22)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(_cancelling_rows())
def test_kernel_norms_never_come_out_too_small(case):
    a, g, views, form, _ = case
    with mock.patch.object(forms, "choose_form", lambda *_: form):
        squares, weighted_sum = ghost_norms.kernel_sq_norms(ghost_norms.Rows.of(a), g,
                                                            num_views=views)
    exact, terms = _exact_sq_norms(a, g, views)
    _assert_never_too_small(squares, exact, terms, weighted_sum, a.shape[0] // views,
                            held=form == ghost_norms.DIRECT, rows=views * a.shape[1])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(_cancelling_rows())
def test_ws_kernel_norms_never_come_out_too_small(case):
    a, g, views, form, seed = case
    fan_in, fan_out = a.shape[-1], g.shape[-1]
    kernel = tf.Variable(np.random.default_rng(seed).normal(size=(fan_in, fan_out)),
                         dtype=tf.float32)
    with mock.patch.object(forms, "choose_form", lambda *_: form):
        squares, weighted_sum = ghost_norms.ws_kernel_sq_norms(
            ghost_norms.Rows.of(a), g, kernel, epsilon=1e-4, num_views=views)
    w = kernel.numpy().astype(np.longdouble)
    centered = w - w.mean(axis=0)
    norms = np.sqrt(np.sum(centered ** 2, axis=0))
    exact, terms = _exact_sq_norms(a, g, views, unit=centered / norms, scale=1 / norms)
    # The held gradients are projected in float32: two staged sums over the fan-in.
    _assert_never_too_small(squares, exact, terms, weighted_sum, a.shape[0] // views,
                            held=form == ghost_norms.DIRECT, rows=views * a.shape[1],
                            projection=2 * precision.sum_chain(fan_in) + 16)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(_cancelling_rows(), st.booleans())
def test_scale_and_bias_norms_never_come_out_too_small(case, scale):
    a, g, views, _, _ = case
    g = g[..., :1] * tf.ones_like(a)  # a per-channel parameter of a's width
    squares, weighted_sum = ghost_norms.broadcast_sq_norms(
        g, (a.shape[-1],), inputs=a if scale else None, num_views=views)
    terms = (a * g if scale else g).numpy().astype(np.longdouble)
    terms = terms.reshape(-1, views * a.shape[1], a.shape[2])
    _assert_never_too_small(squares, np.sum(terms.sum(axis=1) ** 2, axis=1),
                            np.sum(np.sqrt(np.sum(terms ** 2, axis=-1)), axis=1), weighted_sum,
                            a.shape[0] // views)


def test_ws_kernel_with_one_input_has_no_gradient():
    # With fan-in 1, W - mean(W) = 0 whatever W is: the gradient is exactly 0, and so is
    # the norm (the rounding bound, relative to |h| * epsilon^-1/2, used to add 7e-5).
    kernel = tf.Variable(_normal(1, 1, 1, 3))
    x = 255.0 * tf.ones([2, 5, 5, 1])
    g = _normal(2, 5, 5, 3)
    rows = ghost_norms.conv2d_patches(x, kernel_size=(1, 1), strides=(1, 1),
                                      dilation_rate=(1, 1), padding="same")
    result = ghost_norms.ws_kernel_sq_norms(rows, g, kernel, epsilon=1e-4)
    per_example = _per_example(
        lambda i: tf.reduce_sum(tf.nn.conv2d(x[i:i + 1], _standardize(kernel, 1e-4), 1, "SAME")
                                * g[i:i + 1]), kernel, 2)
    np.testing.assert_array_equal(per_example, 0.0)
    np.testing.assert_array_equal(result[0].numpy(), [0.0, 0.0])
    np.testing.assert_array_equal(result[1](tf.constant([1.0, 1.0])).numpy(), 0.0)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(_cancelling_rows())
def test_depthwise_kernel_norms_never_come_out_too_small(case):
    # A 1x1 depthwise kernel over a's rows as pixels: channel c's gradient is
    # sum_r a_rc g_rc, whose terms cancel (held float32 per-example gradients).
    a, g, views, _, _ = case
    g = g[..., :1] * tf.ones_like(a)  # one output gradient per channel (M = 1)
    squares, weighted_sum = ghost_norms.depthwise_kernel_sq_norms(
        a[:, :, None, :], g[:, :, None, :], kernel_size=(1, 1), strides=(1, 1),
        dilation_rate=(1, 1), padding="valid", depth_multiplier=1, num_views=views)
    terms = (a * g).numpy().astype(np.longdouble).reshape(-1, views * a.shape[1], a.shape[2])
    _assert_never_too_small(squares, np.sum(terms.sum(axis=1) ** 2, axis=1),
                            np.sum(np.sqrt(np.sum(terms ** 2, axis=-1)), axis=1), weighted_sum,
                            a.shape[0] // views, held=True, rows=views * a.shape[1])


@settings(max_examples=40, deadline=None, derandomize=True)
@given(_cancelling_rows(), st.integers(1, 4))
def test_embedding_norms_never_come_out_too_small(case, vocabulary):
    # Few distinct ids, so that the output gradients of equal ids (which cancel) add up.
    a, g, views, _, seed = case
    ids = np.random.default_rng(seed).integers(0, vocabulary, a.shape[:2])
    squares, weighted_sum = ghost_norms.embedding_sq_norms(tf.constant(ids), g, vocabulary,
                                                           num_views=views)
    rows = views * a.shape[1]
    g64 = g.numpy().astype(np.longdouble).reshape(-1, rows, g.shape[-1])
    ids = ids.reshape(-1, rows)
    exact = np.array([sum(np.sum(g64[i][ids[i] == v].sum(axis=0) ** 2)
                          for v in range(vocabulary)) for i in range(len(ids))])
    terms = np.sum(np.sqrt(np.sum(g64 ** 2, axis=-1)), axis=1)
    _assert_never_too_small(squares, exact, terms, weighted_sum, len(ids), held=True, rows=rows)


# -- At the precision a GPU or TPU really uses ------------------------------------
#
# `device_arithmetic.emulate(device)` rounds the inputs of every matmul of the rules as a TPU
# (one bf16 pass) or an Ampere GPU (TF32) does. With the rules told (`handled`, as
# `device_arithmetic.device_inputs()` tells them on such a device), what each example adds is
# never more than its computed norm; without (the rules planning for float32 products),
# it is, on the cancelling rows.

EMULATED = [device_arithmetic.BF16, device_arithmetic.TF32]


def _rule_results(a, g, views, form, seed):
    """`(name, squares, weighted_sum)` of every rule on the rows `a` and gradients `g`."""
    fan_in, fan_out = a.shape[-1], g.shape[-1]
    kernel = tf.Variable(np.random.default_rng(seed).normal(size=(fan_in, fan_out)),
                         dtype=tf.float32)
    ids = tf.constant(np.random.default_rng(seed).integers(0, 3, a.shape[:2]))
    per_channel = g[..., :1] * tf.ones_like(a)
    images, image_grads = a[:, None], g[:, None]  # [n, 1, R, F]: a 1 x 3 conv over the rows
    conv = dict(kernel_size=(1, 3), strides=(1, 1), dilation_rate=(1, 1), padding="same")
    strided = dict(kernel_size=(1, 2), strides=(2, 2), dilation_rate=(1, 1), padding="same")
    conv_kernel = tf.Variable(np.random.default_rng(seed).normal(size=(1, 3, fan_in, fan_out)),
                              dtype=tf.float32)
    with _forced_form(form):
        yield "kernel", ghost_norms.kernel_sq_norms(ghost_norms.Rows.of(a), g, num_views=views)
        yield "ws", ghost_norms.ws_kernel_sq_norms(ghost_norms.Rows.of(a), g, kernel,
                                                   epsilon=1e-4, num_views=views)
        # Under `emulate` the direct form of these takes the grouped route (`splits()`).
        yield "conv", ghost_norms.conv2d_kernel_sq_norms(images, image_grads, **conv,
                                                         num_views=views)
        yield "ws conv", ghost_norms.ws_kernel_sq_norms(
            ghost_norms.conv2d_patches(images, **conv), image_grads, conv_kernel,
            epsilon=1e-4, num_views=views)
        yield "strided conv", ghost_norms.conv2d_kernel_sq_norms(
            images, image_grads[:, :, :-(-a.shape[1] // 2)], **strided, num_views=views)
        if form == ghost_norms.DIRECT:  # the same WS conv, recomputed chunk by chunk
            with mock.patch.object(forms, "RECOMPUTED_GRADIENTS", True), \
                    mock.patch.object(forms, "RECOMPUTE_CHUNK_EXAMPLES", 1):
                yield "recomputed ws conv", ghost_norms.ws_kernel_sq_norms(
                    ghost_norms.conv2d_patches(images, **conv), image_grads, conv_kernel,
                    epsilon=1e-4, num_views=views)
    yield "scale", ghost_norms.broadcast_sq_norms(per_channel, (fan_in,), inputs=a,
                                                  num_views=views)
    yield "depthwise", ghost_norms.depthwise_kernel_sq_norms(
        a[:, :, None, :], per_channel[:, :, None, :], kernel_size=(1, 1), strides=(1, 1),
        dilation_rate=(1, 1), padding="valid", depth_multiplier=1, num_views=views)
    yield "embedding", ghost_norms.embedding_sq_norms(ids, g, 3, num_views=views)


def _worst_excess(results, batch):
    """max over rules and examples of |what example i adds| / (f sqrt(squares_i)), f = 0.7."""
    worst = 0.0
    for _, (squares, weighted_sum) in results:
        squares = squares.numpy().astype(np.longdouble)
        for i in range(batch):
            factors = np.zeros(batch, np.float32)
            factors[i] = 0.7
            added = tf.nest.flatten(weighted_sum(tf.constant(factors)))[0].numpy()
            size = np.sqrt(np.sum(added.astype(np.longdouble) ** 2))
            bound = np.longdouble(np.float32(0.7)) * np.sqrt(squares[i])
            if size > 0:
                worst = max(worst, float(size / bound) if bound > 0 else np.inf)
    return worst


@pytest.mark.parametrize("device", [  # TF32 by default
    pytest.param(device_arithmetic.BF16, marks=pytest.mark.slow), device_arithmetic.TF32],
    ids=lambda d: d.name)
@settings(max_examples=15, deadline=None, derandomize=True)
@given(case=_cancelling_rows())
def test_no_rule_adds_more_than_its_norm_at_emulated_device_precision(device, case):
    a, g, views, form, seed = case
    with device_arithmetic.emulate(device):
        assert device_arithmetic.splits()
        worst = _worst_excess(list(_rule_results(a, g, views, form, seed)),
                              a.shape[0] // views)
    assert worst <= 1.0, worst


@pytest.mark.slow
@pytest.mark.parametrize("device", EMULATED, ids=lambda d: d.name)
def test_without_the_precision_handling_the_emulated_device_breaks_the_bound(device):
    # The same rules planning for float32 products on a device that rounds their inputs:
    # the vectors added exceed their norms (by ~2^-bits). 12 draws of the cancelling rows.
    found = 0.0
    for seed in range(12):
        rng = np.random.default_rng(seed)
        a = np.full((2, 6, 9), 255.0)
        a[np.arange(2), rng.integers(0, 6, 2), rng.integers(0, 9, 2)] -= 1.0
        g = np.where(np.arange(6) % 2 == 0, 1.0, -1.0)[None, :, None] * rng.normal(size=(2, 1, 5))
        g = g + 1e-3 * rng.normal(size=(2, 6, 5))
        a, g = tf.constant(a, tf.float32), tf.constant(g, tf.float32)
        for form in (ghost_norms.DIRECT, ghost_norms.GRAM):
            with device_arithmetic.emulate(device, handled=False):
                assert not device_arithmetic.splits()
                found = max(found, _worst_excess(list(_rule_results(a, g, 1, form, seed)), 2))
            with device_arithmetic.emulate(device):
                assert _worst_excess(list(_rule_results(a, g, 1, form, seed)), 2) <= 1.0
    print(f"{device.name}: worst |added| / norm without the handling: {found}")
    assert found > 1 + 2.0**-(device.bits + 2), found


@pytest.mark.parametrize("form", [ghost_norms.DIRECT,
                                  pytest.param(ghost_norms.GRAM, marks=pytest.mark.slow)])
def test_rules_trace_with_a_dynamic_batch(form):
    # The trainer's Poisson batches have no static size: the rows of each example must
    # keep theirs (the Gram form, the staged sums and WS need it). A README run failed
    # here before `example_rows` kept them.
    x = _normal(3, 4, 5)
    g = _normal(3, 4, 6)
    kernel = tf.Variable(_normal(5, 6))

    @tf.function(input_signature=[tf.TensorSpec([None, 4, 5]), tf.TensorSpec([None, 4, 6])])
    def rules(x, g):
        with _forced_form(form):
            plain = ghost_norms.kernel_sq_norms(ghost_norms.Rows.of(x), g)
            ws = ghost_norms.ws_kernel_sq_norms(ghost_norms.Rows.of(x), g, kernel, epsilon=1e-4)
        bias = ghost_norms.broadcast_sq_norms(g, (6,))
        factors = tf.ones([tf.shape(x)[0]])
        return [r[0] for r in (plain, ws, bias)], [r[1](factors) for r in (plain, ws, bias)]

    squares, sums = rules(x, g)
    eager = [ghost_norms.kernel_sq_norms(ghost_norms.Rows.of(x), g)[0]]
    assert all(s.shape == (3,) for s in squares)
    assert ghost_norms.example_rows(g).shape[1] == 4
    np.testing.assert_allclose(squares[0].numpy(), eager[0].numpy(), rtol=2e-4)


# Under -m slow: the Gram form without XLA; the direct routes run by default. Not run: the
# Gram form with XLA (a dynamic batch there: the direct routes; the Gram form's is above), and
# the recomputed route (a dynamic batch keeps the gradients held: the grouped route here;
# test_recomputed_where_the_gradient_holds_more_than_what_it_reads).
@pytest.mark.parametrize("conv_form, jit", [
    pytest.param(form, jit, marks=[pytest.mark.slow] if (form, jit) == ("gram", False) else [])
    for form in CONV_FORMS for jit in (False, True)
    if form != "direct_recomputed" and (form, jit) != ("gram", True)], indirect=["conv_form"])
def test_conv_rules_trace_with_a_dynamic_batch(conv_form, jit):
    # The same for convolutions, on each route (the grouped one takes the batch as its
    # channels): a stride-2 conv and a WS conv, against the static batch.
    x, g = _normal(3, 7, 6, 2), _normal(3, 4, 3, 5)
    kernel = tf.Variable(_normal(3, 3, 2, 5))
    geometry = dict(kernel_size=(3, 3), strides=(2, 2), dilation_rate=(1, 1), padding="same")

    def rules(x, g):
        plain = ghost_norms.conv2d_kernel_sq_norms(x, g, **geometry)
        ws = ghost_norms.ws_kernel_sq_norms(ghost_norms.conv2d_patches(x, **geometry), g,
                                            kernel, epsilon=1e-4)
        factors = tf.ones([tf.shape(x)[0]])
        return [plain[0], ws[0]], [plain[1](factors), ws[1](factors)]

    dynamic = tf.function(rules, jit_compile=jit, input_signature=[
        tf.TensorSpec([None, 7, 6, 2]), tf.TensorSpec([None, 4, 3, 5])])
    for got, expected in zip(tf.nest.flatten(dynamic(x, g)), tf.nest.flatten(rules(x, g))):
        # float32 sums in another order (XLA's, the static trace's): an entry's error scales
        # with the array's largest entries, not its own.
        scale = max(1.0, float(np.max(np.abs(expected.numpy()))))
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("jit", [False, True])
def test_grouped_route_isolates_non_finite_pixels(monkeypatch, jit):
    # On a GPU's or TPU's plan: an inf that no window reads (odd rows and columns under a
    # 1x1 stride-2 conv) changes nothing; an inf that one is read makes that example's
    # squares inf only, and with its factor 0 the others' sum is unchanged.
    monkeypatch.setattr(forms, "GROUPED_CONV_GRADIENTS", True)
    monkeypatch.setattr(forms, "choose_form", lambda *_: ghost_norms.DIRECT)
    calls = {}
    _counted(monkeypatch, conv_norms, "conv2d_example_gradients", calls)
    x, g = _normal(3, 6, 6, 2).numpy(), _normal(3, 3, 3, 4)
    geometry = dict(kernel_size=(1, 1), strides=(2, 2), dilation_rate=(1, 1), padding="valid")

    @tf.function(jit_compile=jit)
    def rule(x, factors):
        squares, weighted_sum = ghost_norms.conv2d_kernel_sq_norms(x, g, **geometry)
        return squares, weighted_sum(factors)

    factors = tf.constant([0.0, 1.0, 0.5])
    clean_squares, clean_sum = rule(tf.constant(x), factors)
    unread = x.copy()
    unread[0, 1::2] = np.inf
    unread[0, :, 1::2] = np.nan
    squares, summed = rule(tf.constant(unread), factors)
    np.testing.assert_array_equal(squares.numpy(), clean_squares.numpy())
    np.testing.assert_array_equal(summed.numpy(), clean_sum.numpy())
    read = x.copy()
    read[0, 2, 2] = np.inf
    squares, summed = rule(tf.constant(read), factors)
    assert np.isinf(squares[0]) and np.all(np.isfinite(squares[1:]))
    np.testing.assert_array_equal(squares.numpy()[1:], clean_squares.numpy()[1:])
    np.testing.assert_array_equal(summed.numpy(), clean_sum.numpy())
    assert calls["conv2d_example_gradients"]  # the grouped route ran (the switch took)


# -- Per-example conv gradients as one grouped convolution -------------------


@st.composite
def _conv_geometries(draw):
    """A convolution's geometry, its input and output gradients; adversarial levels: near-
    constant images at 0 and 255, huge and tiny ranges."""
    kh, kw = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    stride = draw(st.integers(1, 3))
    dilation = 1 if stride > 1 else draw(st.integers(1, 3))
    padding = draw(st.sampled_from(["same", "valid"]))
    smallest = 1 if padding == "same" else None  # "same" pads inputs smaller than the kernel
    height = draw(st.integers(smallest or (kh - 1) * dilation + 1, 13))
    width = draw(st.integers(smallest or (kw - 1) * dilation + 1, 13))
    batch, views = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    channels, filters = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    level = draw(st.sampled_from([0.0, 255.0, 1e-20, 1e20]))
    spread = draw(st.sampled_from([1.0, 1e-3, 1e-20, 1e20]))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    x = level + spread * rng.normal(size=(batch * views, height, width, channels))
    out_h = -(-height // stride) if padding == "same" else (height - (kh - 1) * dilation - 1) // stride + 1
    out_w = -(-width // stride) if padding == "same" else (width - (kw - 1) * dilation - 1) // stride + 1
    g = rng.normal(size=(batch * views, out_h, out_w, filters)) * draw(
        st.sampled_from([1.0, 1e-20, 1e15]))
    return ((kh, kw), (stride, stride), (dilation, dilation), padding, views,
            x.astype(np.float32), g.astype(np.float32))


def _conv_gradients_float64(x, g, kernel_size, strides, dilation, padding, views):
    """Each example's kernel gradient, a loop over offsets in float64 (numpy)."""
    (kh, kw), (s, _), (d, _) = kernel_size, strides, dilation
    if padding == "same":  # TensorFlow's rule: out = ceil(n / s), the extra pad after
        def same(n, k):
            total = max((-(-n // s) - 1) * s + (k - 1) * d + 1 - n, 0)
            return total // 2, total - total // 2
        pad = [(0, 0), same(x.shape[1], kh), same(x.shape[2], kw), (0, 0)]
        x = np.pad(x.astype(np.float64), pad)
    x, g = x.astype(np.float64), g.astype(np.float64)
    out_h, out_w = g.shape[1:3]
    result = np.zeros((len(x) // views, kh, kw, x.shape[-1], g.shape[-1]))
    for y in range(kh):
        for z in range(kw):
            window = x[:, y * d:y * d + (out_h - 1) * s + 1:s, z * d:z * d + (out_w - 1) * s + 1:s]
            per_image = np.einsum("npqc,npqo->nco", window, g)
            result[:, y, z] = per_image.reshape(-1, views, *per_image.shape[1:]).sum(axis=1)
    return result


def _near_constant_255_case():
    """A dilated "same" conv over 2 examples of 2 views, near-constant images at 255."""
    rng = np.random.default_rng(0)
    x = (255.0 + 1e-3 * rng.normal(size=(4, 7, 7, 2))).astype(np.float32)
    g = rng.normal(size=(4, 7, 7, 3)).astype(np.float32)
    return (3, 3), (1, 1), (2, 2), "same", 2, x, g


CONV_ROUTES = st.sampled_from(["grouped", "per_example", "batch_grouped"])


# 15 derandomized cases by default (30 took 12 s on the 2-core host, a compile per case under
# XLA), plus near-constant images at 255, which the 15 do not draw, on the three ways of
# building the gradients (one grouped convolution, one convolution per example, one
# convolution of batch groups); -m slow draws GROUPED_CONV_EXAMPLES (default 200) random ones.
@settings(max_examples=15, deadline=None, derandomize=True)
@given(_conv_geometries(), st.booleans(), CONV_ROUTES)
@example(_near_constant_255_case(), False, "grouped")
@example(_near_constant_255_case(), True, "per_example")
@example(_near_constant_255_case(), True, "batch_grouped")
def test_grouped_conv_gradients_are_the_per_example_gradients(case, jit, route):
    _check_grouped_conv_gradients(case, jit, route)


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("GROUPED_CONV_EXAMPLES", 200)), deadline=None)
@given(_conv_geometries(), st.booleans(), CONV_ROUTES)
def test_grouped_conv_gradients_are_the_per_example_gradients_long(case, jit, route):
    _check_grouped_conv_gradients(case, jit, route)


def _check_grouped_conv_gradients(case, jit, route):
    # The route a GPU or TPU takes for direct-form conv kernels, eagerly and under XLA,
    # against a float64 loop: the same gradients up to float32 rounding of their terms
    # (strides, dilations, both paddings, space-to-depth patch orders, views).
    kernel_size, strides, dilation, padding, views, x, g = case
    expected = _conv_gradients_float64(x, g, kernel_size, strides, dilation, padding, views)
    terms = _conv_gradients_float64(np.abs(x), np.abs(g), kernel_size, strides, dilation,
                                    padding, views)

    def grouped(x, g):
        rows = ghost_norms.conv2d_patches(x, kernel_size=kernel_size, strides=strides,
                                          dilation_rate=dilation, padding=padding)
        return rows.to_kernel_rows(tf.transpose(rows.gradients(g, views), [2, 0, 1]))

    # The geometries have 1-3 input channels: the per-example route takes them all here.
    with mock.patch.object(forms, "PER_EXAMPLE_CONVS", route), \
            mock.patch.object(forms, "PER_EXAMPLE_MIN_CHANNELS", 1), mock.patch.object(
            conv_norms, "_one_convolution_per_example",
            wraps=conv_norms._one_convolution_per_example) as per_example, mock.patch.object(
            conv_norms, "_batch_grouped_correlation",
            wraps=conv_norms._batch_grouped_correlation) as batch_grouped:
        got = tf.function(grouped, jit_compile=jit)(tf.constant(x), tf.constant(g)).numpy()
    assert per_example.called == (route == "per_example")  # the switch took
    assert batch_grouped.called == (route == "batch_grouped")
    got = np.transpose(got, [1, 0, 2]).reshape(expected.shape)  # [batch, kh, kw, c, o]
    finite = np.isfinite(terms) & (terms < 1e38)
    rounding = 2.0**-24 * (np.prod(g.shape[1:3]) * views + 2) * terms
    assert np.all(np.abs(got - expected)[finite] <= rounding[finite] + 1e-37)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(_conv_geometries(), st.booleans(), CONV_ROUTES)
@example(_near_constant_255_case(), True, "per_example")  # one example per trip
@example(_near_constant_255_case(), True, "batch_grouped")
def test_grouped_route_adds_no_more_than_its_norms(case, recompute, route):
    # The rule's contract on the grouped route, held or recomputed (chunks of one example):
    # the vector each example adds (one-hot factors) is within its squares (or
    # `NORM_FLOOR`, which the clipped sum counts for a square that flushes to 0:
    # `tfdp.dp.precision`, "Range"), on adversarial levels.
    kernel_size, strides, dilation, padding, views, x, g = case
    batch = len(x) // views
    with mock.patch.object(forms, "choose_form", lambda *_: ghost_norms.DIRECT), \
            mock.patch.object(forms, "GROUPED_CONV_GRADIENTS", True), \
            mock.patch.object(forms, "PER_EXAMPLE_CONVS", route), \
            mock.patch.object(forms, "PER_EXAMPLE_MIN_CHANNELS", 1), \
            mock.patch.object(forms, "RECOMPUTED_GRADIENTS", recompute), \
            mock.patch.object(forms, "RECOMPUTE_CHUNK_EXAMPLES", 1), \
            mock.patch.object(conv_norms, "conv2d_example_gradients",
                              wraps=conv_norms.conv2d_example_gradients) as grouped, \
            mock.patch.object(forms, "_recomputed", wraps=forms._recomputed) as recomputed:
        squares, weighted_sum = ghost_norms.conv2d_kernel_sq_norms(
            tf.constant(x), tf.constant(g), kernel_size=kernel_size, strides=strides,
            dilation_rate=dilation, padding=padding, num_views=views)
    assert grouped.called and recomputed.called == recompute  # the switches took
    squares = squares.numpy().astype(np.float64)
    for i in range(batch):
        added = weighted_sum(tf.one_hot(i, batch, dtype=tf.float32)).numpy().astype(np.float64)
        if np.isfinite(squares[i]):  # a square that flushes to 0 counts as NORM_FLOOR
            bound = max(np.sqrt(squares[i]) * (1 + 1e-6), precision.NORM_FLOOR)
            assert np.sqrt(np.sum(added ** 2)) <= bound, (i, squares)
        else:  # an inf square gets factor 0 (`clipping.clip_factors`): nothing is added
            assert np.all(weighted_sum(tf.zeros([batch])).numpy() == 0)


# -- Recomputed per-example gradients: book-keeping's memory for held vectors ----


def test_recompute_chunks_divide_the_batch_into_at_most_8_chunks_of_8_or_more():
    for batch in range(1, 1100):
        n = ghost_norms.recompute_chunk_count(batch)
        assert batch % n == 0 and 1 <= n <= forms.RECOMPUTE_CHUNKS
        assert n == 1 or batch // n >= forms.RECOMPUTE_CHUNK_EXAMPLES
    assert [ghost_norms.recompute_chunk_count(b) for b in (4, 32, 128, 512, 96, 17)] == [
        1, 4, 8, 8, 8, 1]


def test_recomputed_where_the_gradient_holds_more_than_what_it_reads():
    # WRN-16-4 on a GPU's plan: stage 1's 3x3 convs hold 37k floats per example, less than
    # their input region and output gradients (139k): held; stages 2 and 3 hold 147k and
    # 590k against 74k and 42k: recomputed. A dynamic batch keeps them held.
    def chunks(size, channels, filters, batch=32):
        x = tf.zeros([batch, size, size, channels])
        rows = ghost_norms.conv2d_patches(x, kernel_size=(3, 3), strides=(1, 1),
                                          dilation_rate=(1, 1), padding="same")
        return forms._recompute_chunks(rows, tf.zeros([batch, size, size, filters]), 1)

    assert chunks(16, 128, 128) == 0  # float32 plan: patches, held
    with device_arithmetic.emulate(device_arithmetic.TF32):
        assert ghost_norms.recomputed_gradients()
        assert chunks(32, 64, 64) == 0
        assert chunks(16, 128, 128) == 4 and chunks(8, 256, 256) == 4
        assert chunks(8, 256, 256, batch=512) == 8
        with mock.patch.object(forms, "PER_EXAMPLE_CONVS", "per_example"):
            # one example per trip: no chunk of gradients stacked; stage 1 stays held
            assert chunks(16, 128, 128) == 32 and chunks(8, 256, 256, batch=512) == 512
            assert chunks(32, 64, 64) == 0

        @tf.function(input_signature=[tf.TensorSpec([None, 8, 8, 256])])
        def dynamic(x):
            rows = ghost_norms.conv2d_patches(x, kernel_size=(3, 3), strides=(1, 1),
                                              dilation_rate=(1, 1), padding="same")
            return tf.constant(forms._recompute_chunks(rows, x, 1))

        assert int(dynamic(tf.zeros([4, 8, 8, 256]))) == 0


_FLOATS = st.one_of(st.sampled_from([0.0, 1e-45, 1e-39, 1.17e-38, 1.0, 3.4e38, np.inf, np.nan]),
                    st.floats(0.0, float(np.finfo(np.float32).max), width=32))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.tuples(_FLOATS, _FLOATS, st.floats(1e-30, 1e30)),
                min_size=1, max_size=8))
def test_reclip_factors_keep_what_is_added_within_the_first_norm(cases):
    # What a recomputed example adds is at most fl(f s) sqrt(again) (`held_squares`' bound
    # for any factor): never above f sqrt(first), the norm its factor came from, whatever
    # the second build returned (larger, 0, a denormal, inf, nan); the same squares give 1.
    first, again, f = (np.array(c, np.float32) for c in zip(*cases))
    first = np.where(np.isnan(first), np.float32(1.0), first)  # squares the clip accepted
    factor = ghost_norms.reclip_factors(tf.constant(f), tf.constant(first),
                                        tf.constant(again)).numpy()
    assert np.all((factor >= 0) & (factor <= f))
    assert np.all(factor[first == again] == f[first == again])
    s = factor / f
    factor = factor.astype(np.float64)
    added = factor * np.sqrt(again.astype(np.float64))
    # A square below float32's normals may be read as 0 (flushed): the clipped sum counts
    # every example's total as at least `NORM_FLOOR`^2 (`tfdp.dp.precision`, "Range").
    counted = np.maximum(first.astype(np.float64), precision.NORM_FLOOR**2)
    ok = (factor == 0) | (added <= f.astype(np.float64) * np.sqrt(counted))
    assert np.all(ok), (first, again, s)
    # A non-finite recompute adds nothing, unless the first squares were inf (factor 0).
    assert np.all((s == 0) | np.isfinite(again) | np.isinf(first))


@settings(max_examples=15, deadline=None, derandomize=True)
@given(_conv_geometries(), st.lists(st.sampled_from([1.0, 1.0 + 2.0**-20, 1.5, 1e30, -3.0,
                                                     0.0, np.inf, np.nan]),
                                    min_size=3, max_size=3), st.integers(0, 2**16))
def test_a_recompute_that_differs_adds_no_more_than_the_first_norm(case, scales, seed):
    # A device whose second build of a chunk's gradients is not its first (another conv
    # algorithm, a rewrite): scaled, shifted, inf or nan per chunk (one example each). What
    # each example adds stays within f sqrt(squares) of the FIRST build, and an example
    # whose recompute is not finite adds nothing (the others' sum stays finite).
    kernel_size, strides, dilation, padding, views, x, g = case
    batch = len(x) // views
    rows = ghost_norms.conv2d_patches(tf.constant(x), kernel_size=kernel_size, strides=strides,
                                      dilation_rate=dilation, padding=padding)
    calls = []

    def changed(output_grads, num_views, source=None):  # eager: one call per chunk
        h = rows.gradients(output_grads, num_views, source=source)
        calls.append(None)
        if len(calls) <= batch:
            return h
        chunk = (len(calls) - 1) % batch
        noise = np.random.default_rng(seed + chunk).normal(size=h.shape).astype(np.float32)
        return h * scales[chunk % 3] + tf.reduce_max(tf.abs(h)) * 1e-3 * noise

    lying = dataclasses.replace(rows, gradients=changed)
    with mock.patch.object(forms, "choose_form", lambda *_: ghost_norms.DIRECT), \
            mock.patch.object(forms, "GROUPED_CONV_GRADIENTS", True), \
            mock.patch.object(forms, "RECOMPUTED_GRADIENTS", True), \
            mock.patch.object(forms, "RECOMPUTE_CHUNK_EXAMPLES", 1):
        squares, weighted_sum = ghost_norms.kernel_sq_norms(lying, tf.constant(g),
                                                            num_views=views)
        squares = squares.numpy().astype(np.float64)
        for i in range(batch):
            if not np.isfinite(squares[i]):  # factor 0 (`clipping.clip_factors`): nothing added
                assert np.all(weighted_sum(tf.zeros([batch])).numpy() == 0)
                continue
            added = weighted_sum(0.7 * tf.one_hot(i, batch)).numpy().astype(np.float64)
            bound = np.float64(np.float32(0.7)) * max(np.sqrt(squares[i]), precision.NORM_FLOOR)
            assert np.sqrt(np.sum(added ** 2)) <= bound, (i, scales)
        assert np.all(np.isfinite(weighted_sum(tf.where(np.isfinite(squares), 0.5, 0.0))))
    assert len(calls) > batch  # built again for the weighted sums: the recompute took


# The per-example and batch-group routes' default checks are the contract fuzz above (their
# explicit examples), the per-example route's trip count on WRN-16-4's shapes and the
# batch-group route's non-finite isolation; here their cases are -m slow (5.6 s under XLA on
# the 2-core host).
@pytest.mark.parametrize("jit,route", [pytest.param(False, "grouped", marks=pytest.mark.slow),
                                       pytest.param(False, "per_example", marks=pytest.mark.slow),
                                       (True, "grouped"),
                                       pytest.param(True, "per_example", marks=pytest.mark.slow),
                                       pytest.param(True, "batch_grouped",
                                                    marks=pytest.mark.slow),
                                       pytest.param(False, "batch_grouped",
                                                    marks=pytest.mark.slow)])
def test_recomputed_chunks_of_several_examples_are_the_held_vectors(monkeypatch, jit, route):
    # Chunks of 2 examples of K = 2 views (6 examples, 3 chunks; on the per-example route one
    # example per trip, 6 trips), a stride-2 conv and a WS conv, eagerly and under XLA: the
    # recomputed route gives the held route's squares and, at one-hot factors, its vectors,
    # each within its norm; an inf pixel read by example 2 makes its squares inf and leaves
    # the others' squares and (factor 0 for it) the sum.
    monkeypatch.setattr(forms, "GROUPED_CONV_GRADIENTS", True)
    monkeypatch.setattr(forms, "PER_EXAMPLE_CONVS", route)
    monkeypatch.setattr(forms, "PER_EXAMPLE_MIN_CHANNELS", 1)  # the 3 channels here
    monkeypatch.setattr(forms, "choose_form", lambda *_: ghost_norms.DIRECT)
    monkeypatch.setattr(forms, "RECOMPUTE_CHUNK_EXAMPLES", 2)
    batch, views = 6, 2
    x, g = _normal(batch * views, 7, 7, 3).numpy(), _normal(batch * views, 4, 4, 5)
    kernel = tf.Variable(_normal(3, 3, 3, 5))
    geometry = dict(kernel_size=(3, 3), strides=(2, 2), dilation_rate=(1, 1), padding="same")
    factors = np.concatenate([0.7 * np.eye(batch), [[1.0, 0.5, 0.0, 1.0, 0.25, 1.0]]])

    def rules(recompute):
        @tf.function(jit_compile=jit)
        def run(x, factors):
            with mock.patch.object(forms, "RECOMPUTED_GRADIENTS", recompute), \
                    mock.patch.object(forms, "_recomputed", wraps=forms._recomputed) as loops:
                assert ghost_norms.recompute_chunk_count(batch) == 3
                plain = ghost_norms.conv2d_kernel_sq_norms(x, g, num_views=views, **geometry)
                ws = ghost_norms.ws_kernel_sq_norms(ghost_norms.conv2d_patches(x, **geometry),
                                                    g, kernel, epsilon=1e-4, num_views=views)
            # the trips each recomputed rule's loops take (`chunks`, the fourth argument)
            trips = {call.args[3] for call in loops.call_args_list}
            assert trips == ({batch if route == "per_example" else 3} if recompute else set())
            return ([plain[0], ws[0]],
                    [tf.stack([rule[1](f) for f in tf.unstack(factors)]) for rule in (plain, ws)])
        return lambda x: [[t.numpy() for t in part]
                          for part in run(tf.constant(x), tf.constant(factors, tf.float32))]

    held, recomputed = rules(False), rules(True)
    (held_squares, held_sums), (squares, sums) = held(x), recomputed(x)
    for h, r in zip(held_squares, squares):
        np.testing.assert_allclose(r, h, rtol=1e-6, atol=1e-30)
    for h, r in zip(held_sums, sums):  # one-hot rows; the full row sums chunks in float32
        # Under XLA one example's convolution sums in another order than the stacked ones
        # (1.6e-7 of the largest entry measured): rounding apart, not a different vector.
        atol = 1e-6 * np.abs(h[:batch]).max() if jit and route == "per_example" else 1e-30
        np.testing.assert_allclose(r[:batch], h[:batch], rtol=1e-6, atol=atol)
        np.testing.assert_allclose(r[batch], h[batch], rtol=0, atol=1e-6 * np.abs(h).max())
    for sq, summed in zip(squares, sums):
        for i in range(batch):
            size = np.sqrt(np.sum(summed[i].astype(np.float64) ** 2))
            assert size <= np.float32(0.7) * np.sqrt(np.float64(sq[i])), (i, size, sq[i])
    poisoned = x.copy()
    poisoned[2 * views + 1, 2, 2] = np.inf  # example 2, its second view: read by the conv
    squares_inf, sums_inf = recomputed(poisoned)
    for clean, dirty in zip(squares, squares_inf):  # inf or nan (inf - inf): factor 0
        assert not np.isfinite(dirty[2]) and np.all(np.isfinite(np.delete(dirty, 2)))
        np.testing.assert_array_equal(np.delete(dirty, 2), np.delete(clean, 2))
    assert factors[-1][2] == 0.0  # the last factor row drops example 2: the clean sum
    for clean_sum, dirty_sum in zip(sums, sums_inf):
        np.testing.assert_array_equal(dirty_sum[-1], clean_sum[-1])
