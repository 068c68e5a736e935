"""Tests for tfdp.dp.precision: every stated error bound holds, on CPU and emulated devices."""

import math

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings, strategies as st

from tfdp import process_settings
from tfdp.dp import device_arithmetic
from tfdp.dp import precision

U = precision.UNIT_ROUNDOFF
RNG = np.random.default_rng(0)


def _exact_sum(x, axis=-1):
    return np.sum(np.asarray(x, np.longdouble), axis=axis)


# -- Device rounding and its emulation ------------------------------------------------


def test_this_host_keeps_float32_matmul_inputs():
    assert device_arithmetic.device_inputs() == device_arithmetic.FLOAT32
    assert not device_arithmetic.splits()


def test_onednn_lower_precision_modes_count_as_rounding(monkeypatch):
    # oneDNN's fpmath mode BF16 lets an AMX or AVX-512 BF16 CPU round matmul inputs.
    monkeypatch.setenv("ONEDNN_DEFAULT_FPMATH_MODE", "BF16")
    assert device_arithmetic.device_inputs() == device_arithmetic.BF16
    monkeypatch.setenv("ONEDNN_DEFAULT_FPMATH_MODE", "STRICT")
    # oneDNN may have read BF16: kept.
    assert device_arithmetic.device_inputs() == device_arithmetic.BF16
    process_settings._seen_since_import.clear()  # a new process
    assert device_arithmetic.device_inputs() == device_arithmetic.FLOAT32


def test_emulation_says_what_the_rules_plan_for():
    with device_arithmetic.emulate(device_arithmetic.BF16):
        assert device_arithmetic.device_inputs() == device_arithmetic.BF16
        assert device_arithmetic.planned_inputs() == device_arithmetic.BF16
        assert device_arithmetic.splits()
    with device_arithmetic.emulate(device_arithmetic.TF32, handled=False):
        assert device_arithmetic.device_inputs() == device_arithmetic.TF32
        assert device_arithmetic.planned_inputs() == device_arithmetic.FLOAT32
        assert not device_arithmetic.splits()
    assert device_arithmetic.device_inputs() == device_arithmetic.FLOAT32


@pytest.mark.parametrize("bits", [8, 11])
def test_emulated_rounding_is_round_to_nearest_even(bits):
    # 1 + k 2^-(bits - 1 + 2): quarter steps of the kept precision's unit in the last place.
    step = 2.0**(1 - bits)
    x = np.array([1 + step / 4, 1 + step / 2, 1 + 3 * step / 2, 1 + 3 * step / 4, -1 - step / 4,
                  2.0**-9 * (1 + step / 2 + 2.0**-22)], np.float32)
    # Ties go to the even neighbour (1, 1 + 2 step); above a tie, up; below, down.
    expected = [1.0, 1.0, 1 + 2 * step, 1 + step, -1.0, 2.0**-9 * (1 + step)]
    rounded = device_arithmetic.round_mantissa(tf.constant(x), bits).numpy()
    np.testing.assert_array_equal(rounded, np.float32(expected))
    # Exactly representable with `bits` significant bits:
    mantissa, _ = np.frexp(rounded.astype(np.float64))
    np.testing.assert_array_equal(mantissa * 2**bits, np.round(mantissa * 2**bits))


def _bits(values):
    return np.asarray(values, np.float32).view(np.uint32)


def test_bf16_rounding_equals_a_cast_on_every_kind_of_float_and_keeps_non_finite_values():
    # Random magnitudes from 2^-149 to 2^127, ties, the largest float32 (rounds to inf, as a
    # cast does), subnormals, and inf and NaN with any payload: a NaN whose magnitude bits
    # are 0x7FFFFFFF would carry into the sign bit (-0.0) if it were rounded as a number.
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    finite = raw[(raw & 0x7F800000) != 0x7F800000]
    ties = (finite & 0xFFFF0000) | 0x8000
    special = np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80008000, 0x00018000, 0x7F800000,
                        0xFF800000, 0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000],
                       np.uint32)
    x = np.concatenate([finite, ties, special]).view(np.float32)
    rounded = device_arithmetic.round_mantissa(tf.constant(x), 8).numpy()
    cast = tf.cast(tf.cast(tf.constant(x), tf.bfloat16), tf.float32).numpy()
    is_finite = np.isfinite(x)
    np.testing.assert_array_equal(_bits(rounded[is_finite]), _bits(cast[is_finite]))
    np.testing.assert_array_equal(_bits(rounded[~is_finite]), _bits(x[~is_finite]))
    assert np.isposinf(rounded[x == np.float32(3.4028235e38)]).all()


def test_split_pieces_are_rounded_by_integer_operations_no_compiler_can_drop():
    # XLA's SimplifyFPConversions removes a float32 -> bfloat16 -> float32 chain (on GPUs under
    # xla_allow_excess_precision, on by default; this CPU build keeps it): the pieces would
    # then be the unrounded value and zeros, and the device would round their products.
    # The compiled pieces hold no bfloat16 at all, and still add up to the input.
    x = tf.constant(RNG.normal(size=64) * 10.0**RNG.uniform(-20, 20, 64), tf.float32)
    pieces = tf.function(lambda t: tf.stack(precision.bf16_pieces(t)), jit_compile=True)
    hlo = pieces.experimental_get_compiler_ir(x)(stage="optimized_hlo")
    assert "bf16[" not in hlo and " convert(" not in hlo, hlo  # no bf16 value, no conversion
    graph = tf.function(precision.bf16_pieces).get_concrete_function(x).graph
    assert not [op for op in graph.get_operations()
                if op.type == "Cast" and op.get_attr("DstT") == tf.bfloat16]
    values = pieces(x).numpy()
    np.testing.assert_array_equal(
        values, tf.cast(tf.cast(tf.constant(values), tf.bfloat16), tf.float32).numpy())
    total = values.astype(np.float64).sum(axis=0)
    assert np.all(np.abs(total - x.numpy()) <= 2.0**-24 * np.abs(x.numpy()))


def test_bf16_pieces_are_exact_bf16_and_add_up_to_the_input():
    x = tf.constant(RNG.normal(size=1000) * 10.0**RNG.uniform(-20, 20, 1000), tf.float32)
    pieces = precision.bf16_pieces(x)
    for piece in pieces:
        np.testing.assert_array_equal(piece.numpy(),
                                      tf.cast(tf.cast(piece, tf.bfloat16), tf.float32).numpy())
    total = sum(np.asarray(p.numpy(), np.float64) for p in pieces)
    assert np.all(np.abs(total - x.numpy()) <= 2.0**-24 * np.abs(x.numpy()))


# -- Products ------------------------------------------------------------------------------


def _gram_case(rows, length, level):
    """Rows near a constant `level` (the ghost norms' cancelling case) and random rows."""
    x = level + RNG.normal(size=(3, rows, length)) * RNG.choice([1.0, 1e-3], size=(3, rows, 1))
    return tf.constant(x, tf.float32)


def _gram_error(x, computed):
    exact = np.einsum("brk,bsk->brs", *(2 * [np.asarray(x.numpy(), np.longdouble)]))
    mass = np.einsum("brk,bsk->brs", *(2 * [np.abs(np.asarray(x.numpy(), np.longdouble))]))
    return np.max(np.abs(np.asarray(computed.numpy(), np.longdouble) - exact) / mass)


@pytest.mark.parametrize("device", [device_arithmetic.BF16, device_arithmetic.TF32])
def test_split_products_hold_their_bound_where_one_rounded_pass_does_not(device):
    # A Gram of 96-long rows near 255: one bf16 or TF32 pass is off by ~2^-bits of the
    # terms, far beyond the float32 bound; the six bf16-piece passes stay inside it. The
    # rows sit 0.06 above 255 (rounded to 255 by both devices: errors of one sign), with
    # their own seed: the shared RNG's draw made this test pass or fail by test order.
    rng = np.random.default_rng(34)
    x = tf.constant(255.06 + rng.normal(size=(3, 4, 96)) * 1e-3, tf.float32)
    with device_arithmetic.emulate(device):
        split = precision.einsum("brk,bsk->brs", x, x, exact=True)
        bound = precision.contraction_error(96)
    assert _gram_error(x, split) <= bound
    assert bound < 8e-5  # good to float32: 6 x 96 terms chained at most, plus 4 u
    with device_arithmetic.emulate(device, handled=False):
        rounded = precision.einsum("brk,bsk->brs", x, x, exact=True)
        believed = precision.contraction_error(96)
    assert believed < 1e-5
    assert _gram_error(x, rounded) > 10 * believed


def test_a_split_contraction_over_the_first_axis_folds_the_passes_into_it():
    # "brf,bro->fo": the batch axis b is contracted; the six passes lengthen it.
    x = _gram_case(5, 7, 1.0)
    y = _gram_case(5, 4, -3.0)
    exact = np.einsum("brf,bro->fo", np.asarray(x.numpy(), np.longdouble),
                      np.asarray(y.numpy(), np.longdouble))
    mass = np.einsum("brf,bro->fo", np.abs(np.asarray(x.numpy(), np.longdouble)),
                     np.abs(np.asarray(y.numpy(), np.longdouble)))
    with device_arithmetic.emulate(device_arithmetic.BF16):
        computed = precision.einsum("brf,bro->fo", x, y, exact=True)
        bound = precision.contraction_error(15)
    assert np.max(np.abs(computed.numpy() - exact) / mass) <= bound


def test_one_pass_on_this_host_holds_the_float32_bound():
    x = _gram_case(6, 128, 255.0)
    assert _gram_error(x, precision.einsum("brk,bsk->brs", x, x, exact=True)) <= (
        precision.contraction_error(128))


def _hlo_shapes(hlo):
    """`{instruction name: shape}` of an HLO module's text."""
    import re
    shapes = {}
    for line in hlo.splitlines():
        match = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = f32\[([0-9,]*)\]", line)
        if match:
            shapes[match.group(1)] = [int(d) for d in match.group(2).split(",") if d]
    return shapes


def test_a_chunked_contraction_keeps_its_chunks_in_the_compiled_hlo():
    # The error bound of a chunked Gram assumes each dot contracts at most CHUNK terms
    # and the chunks are summed after: XLA must not fold them back into one long dot.
    def gram(x):
        chunks = precision.chunk_last_axis(x)  # [3, R, C, c]
        flat = tf.reshape(tf.transpose(chunks, [0, 2, 1, 3]), [-1, 8, precision.CHUNK])
        grams = precision.einsum("nrf,nsf->nrs", flat, flat, exact=True)
        return precision.staged_sum(tf.transpose(tf.reshape(grams, [3, -1, 8, 8]), [0, 2, 3, 1]))

    spec = tf.TensorSpec([3, 8, 6 * precision.CHUNK], tf.float32)
    hlo = tf.function(gram, jit_compile=True).experimental_get_compiler_ir(spec)(
        stage="optimized_hlo")
    import re
    shapes = _hlo_shapes(hlo)
    dots = [line for line in hlo.splitlines() if " dot(" in line]
    assert dots
    for line in dots:
        lhs = re.search(r"dot\(%([\w.\-]+)", line).group(1)
        contracting = int(re.search(r"lhs_contracting_dims=\{(\d+)\}", line).group(1))
        assert shapes[lhs][contracting] <= precision.CHUNK, line
        assert f"f32[{3 * 6},8,8]" in line, line  # the 6 chunks of each example: a batch axis


# -- Sums ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 31, 32, 33, 100, 1024, 4097, 7919, 590_000])
def test_staged_sum_holds_its_bound(n):
    x = RNG.normal(size=(2, n)) * 10.0**RNG.uniform(-3, 3, (2, n)) + 1e3
    x = tf.constant(x, tf.float32)
    computed = precision.staged_sum(x).numpy()
    exact = _exact_sum(x.numpy())
    mass = _exact_sum(np.abs(x.numpy()))
    assert np.all(np.abs(computed - exact) <= precision.sum_error(n) * mass)
    assert precision.sum_chain(n) <= precision.STAGE * max(1, math.ceil(math.log(n, 32))) or n < 2


def test_sum_chains_stay_short():
    assert precision.sum_chain(32) == 31
    assert precision.sum_chain(590_000) <= 4 * precision.STAGE  # a WRN-16-4 kernel per example
    assert precision.sum_chain(2**21) <= 5 * precision.STAGE


def test_compiled_reductions_are_no_longer_than_a_stage():
    # XLA merges consecutive reductions and re-cuts them into windows of 32 on CPU (its
    # tree reduction): no reduction in the compiled sum may chain more than STAGE terms.
    summed = tf.function(lambda t: precision.staged_sum(t), jit_compile=True)
    hlo = summed.experimental_get_compiler_ir(tf.TensorSpec([4, 590_000], tf.float32))(
        stage="optimized_hlo")
    import re
    shapes = _hlo_shapes(hlo)
    reductions = 0
    for line in hlo.splitlines():
        window = re.search(r"window=\{size=([0-9x]+)", line)
        if window:
            reductions += 1
            assert max(int(k) for k in window.group(1).split("x")) <= precision.STAGE, line
        if " reduce(" in line:
            reductions += 1
            operand = re.search(r"reduce\(%([\w.\-]+)", line).group(1)
            dims = re.search(r"dimensions=\{([0-9,]+)\}", line)
            size = math.prod(shapes[operand][int(d)] for d in dims.group(1).split(","))
            assert size <= precision.STAGE, line
    assert reductions >= 3


@pytest.mark.parametrize("compile_mode", ["eager", "graph", "xla"])
def test_two_sum_is_error_free_in_every_mode(compile_mode):
    a = tf.constant([1e8, 1.0, 3.0e-8, -7.5], tf.float32)
    b = tf.constant([1.0, 1e8, 1.0, 7.5 + 2.0**-20], tf.float32)
    fn = precision.two_sum
    if compile_mode != "eager":
        fn = tf.function(fn, jit_compile=compile_mode == "xla")
    s, e = fn(a, b)
    exact = np.asarray(a.numpy(), np.float64) + np.asarray(b.numpy(), np.float64)
    np.testing.assert_array_equal(np.asarray(s.numpy(), np.float64)
                                  + np.asarray(e.numpy(), np.float64), exact)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.integers(1, 70), st.sampled_from([0.0, 255.0, 1e6]), st.integers(0, 2**16))
def test_compensated_sum_is_as_good_as_rounding_the_exact_sum(rows, level, seed):
    # Terms that cancel: +-level pairs and jitter, as sum_r g_r after a group norm.
    rng = np.random.default_rng(seed)
    x = np.where(np.arange(rows) % 2 == 0, level, -level)[None, :, None] * np.ones((2, 1, 3))
    x = (x + rng.normal(size=(2, rows, 3)) * 10.0**rng.uniform(-6, 0)).astype(np.float32)
    computed = precision.compensated_sum(tf.constant(x), axis=1).numpy()
    exact = _exact_sum(x, axis=1)
    mass = _exact_sum(np.abs(x), axis=1)
    depth = max(1, math.ceil(math.log2(max(rows, 2))))
    assert np.all(np.abs(computed - exact)
                  <= 2 * U * np.abs(exact) + (2 * depth * U)**2 * mass)


# -- Bounds and the clipped sum's products ----------------------------------------------------


def test_upper_is_never_below_its_target():
    x = np.float32(RNG.uniform(0, 1e6, 10_000))
    for relative in (0.0, 1e-7, 3e-6, 1e-2):
        up = precision.upper(tf.constant(x), relative).numpy()
        assert np.all(np.asarray(up, np.float64) >= np.asarray(x, np.float64) * (1 + relative))


def test_sum_of_squares_bound_is_never_below_the_exact_sum():
    x = tf.constant(RNG.normal(size=(8, 3, 999)) * 10.0**RNG.uniform(-5, 5, (8, 3, 999)),
                    tf.float32)
    bound = precision.sum_of_squares_bound(x).numpy()
    exact = _exact_sum(np.asarray(x.numpy(), np.longdouble).reshape(8, -1) ** 2)
    assert np.all(bound >= exact)
    assert np.all(bound <= exact * (1 + 1e-5))


@pytest.mark.parametrize("device", [None, device_arithmetic.BF16])
def test_weighted_sum_rounds_each_product_once(device):
    factors = tf.constant([0.0, 0.31, 0.0], tf.float32)
    held = tf.constant(RNG.normal(size=(3, 500)), tf.float32)
    context = device_arithmetic.emulate(device or device_arithmetic.FLOAT32)
    with context:
        summed = precision.weighted_sum(factors, held).numpy()
    exact = float(np.float32(0.31)) * np.asarray(held.numpy()[1], np.float64)
    assert np.all(np.abs(summed - exact) <= U * np.abs(exact) + 1e-45)


def test_a_rounded_weighted_sum_would_add_more_than_the_norm():
    # What a TPU's bf16 pass would do to sum_i f_i h_i if the rules did not know.
    factors = tf.constant([0.0, 0.3, 0.0], tf.float32)
    held = tf.constant(RNG.normal(size=(3, 500)), tf.float32)
    with device_arithmetic.emulate(device_arithmetic.BF16, handled=False):
        summed = precision.weighted_sum(factors, held).numpy()
    exact = float(np.float32(0.3)) * np.asarray(held.numpy()[1], np.float64)
    assert np.max(np.abs(summed - exact) / np.abs(exact)) > 1e-3


def test_a_staged_sum_over_a_size_known_at_run_time_holds_its_bound():
    # A held vector of a sequence of unknown length (an Embedding's rows): the stages
    # are padded at run time; the chain is that of DYNAMIC_LEVELS stages.
    summed = tf.function(lambda t: precision.sum_of_squares_bound(t),
                         input_signature=[tf.TensorSpec([None, None, 3])])
    for length in (1, 7, 33, 2000):
        x = RNG.normal(size=(2, length, 3)) * 10.0**RNG.uniform(-3, 3, (2, length, 3))
        x = np.float32(x)
        bound = summed(tf.constant(x)).numpy()
        exact = _exact_sum(np.asarray(x, np.longdouble).reshape(2, -1) ** 2)
        assert np.all(bound >= exact)
        assert np.all(bound <= exact * (1 + 2e-5))
    assert precision.sum_chain(None) == precision.DYNAMIC_LEVELS * (precision.STAGE - 1)
