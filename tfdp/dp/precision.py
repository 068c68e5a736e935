"""Where privacy depends on float32 rounding: the one home of the ghost norms' arithmetic.

DP-SGD's guarantee needs every example's clipped contribution to have norm
<= C *as the device computes it*. The ghost-norm rules (`tfdp.dp.ghost_norms`)
compute each example's norm from sums and matrix products that can cancel, so
every sum and product whose rounding the norm must cover goes through this
module, which states what it computes on each device, and a bound on how far
that can be from the exact result. Which device class the step runs on, its
emulation on a CPU for tests (`emulate`) and the refusal of settings that
would rewrite the step's arithmetic live in `tfdp.dp.device_arithmetic`; a
reader can see here what each device computes.

What a device does to a float32 matmul (and convolution) at TensorFlow's
default settings, and what this module does about it:

| device               | float32 matmul inputs kept | `einsum(..., exact=True)` here            |
|----------------------|----------------------------|-------------------------------------------|
| CPU (Eigen, oneDNN)  | all 24 bits (`FLOAT32`)    | one pass                                  |
| GPU, Ampere or newer | 11 bits, TF32 (`TF32`)     | six passes of exact bf16 pieces (bf16x6)  |
| TPU, XLA DEFAULT     | 8 bits, one bf16 pass (`BF16`) | six passes of exact bf16 pieces (bf16x6) |

TensorFlow enables TF32 by default (`tf.config.experimental.
enable_tensor_float_32_execution`), and under XLA that is DEFAULT precision:
one bfloat16 pass on a TPU. A float32 operand is then rounded to 8 (TPU) or
11 (TF32) significant bits before it is multiplied. Where a product's
precision matters, `einsum(..., exact=True)` splits each operand into three
bfloat16 pieces `a = a1 + a2 + a3` (each piece exactly representable in
bfloat16, so the device's rounding leaves it unchanged; Henry et al. 2019,
"Leveraging the bfloat16 Artificial Intelligence Datatype For Higher-Precision
Computations", the split that XLA's HIGHEST precision also uses) and sums
the six products of the pieces whose orders add up to at most 4. Each piece
product is exact in float32 (8 x 8 bits), the three dropped products and
the remainders are below 4.01 * 2^-24 of `|a| |b|`, so the result is as good
as a float32 product. Only the few products that the norms depend on pay the
six passes; the model's own convolutions keep the device's speed.

Errors are stated, as in Higham 2002 ("Accuracy and Stability of Numerical
Algorithms", 2nd ed., Sec. 3.1), with `u = 2^-24` and `gamma(n) = n u / (1 - n u)`:
a sum of n terms computed in ANY order is within `gamma(n - 1) * sum |x_i|` of
the exact sum, and a contraction (dot product) of n products within
`gamma(n) * sum |a_i b_i|`. So the bound depends on how many terms one sum
can chain. Every sum here is STAGED: `staged_sum` sums at most `STAGE` terms
per op and sums the partial results again, and a contraction longer than
`STAGE` (`CHUNK` when split) is cut into chunks along its length, whose
results are staged sums. A sum of n terms then chains at most
`sum_chain(n) = STAGE * ceil(log_STAGE(n))` additions (384 for n <= 2M)
instead of n. This assumes that no compiler merges the stages into one
longer chain: XLA's CPU compiler merges consecutive reductions but then cuts
every reduction into windows of 32 (its tree reduction rewrite: a shorter
chain), and keeps a chunked contraction's chunks as a batch axis of its dot;
`tests/dp/precision_test.py` checks both on the compiled HLO. On an H200,
XLA's GPU compiler merged the stages into 1,024-wide reductions (errors
stayed at most 0.16 of the bound there); no TPU was checked. What the model
above does not cover (a compiler's rewrites, a device's own algorithms) the
clip margin does (`CLIP_MARGINS`): every example is clipped to C / (1 + kappa).

Range. The bounds above are relative (Higham's model without
underflow), and a float32 device may flush results and inputs below 2^-126
(1.18e-38) to zero: TensorFlow's CPU threads do, and so should a TPU. A norm
that is a product of a huge factor and a tiny one (a Gram form's
`(x . x)(y . y)` with |x| ~ 1e19 and |y| ~ 1e-19: an input column holding an
int64 ID, a LayerNormalization after a Dense) would then come out 0 while
the vector added is of order 1. So every rule whose norm multiplies two
factors first brings each factor into [1, 4) per example by an exact power
of two (`binary_exponent`, `times_power_of_two`), computes and bounds the
norm there, and scales the bound back; the weighted sum uses the same
scaled factors with the power of two folded into each example's weight.
What the bounds then cover, with the argument:
- In the scaled units every entry is at most 4 and the largest about 1, so
  a flushed operation changes its result by less than 2^-126 while the
  terms it feeds are at most `R^2 F O` (rows, fan-in, fan-out) in size: an
  ABSOLUTE error of at most `2^-117 R^2 (F + 1)(O + 1)` in the squared
  norm, which `underflow_slack` adds (2^-100 times that size, 10^5 times the
  argument's need), below 1e-15 relative on anything but a norm of 0.
- Scaling back is exact while the result is a normal float32. A norm
  above 3.4e38 becomes inf: its factor is 0 and its example is dropped,
  as a non-finite gradient is (`tfdp.dp.clipping.clip_factors`). A squared
  norm that underflows (norm below 2^-63) may come out 0; the clipped sum
  then counts each example's total at no less than `NORM_FLOOR`^2
  (`tfdp.training.ghost_clipping`), so that it stays an upper bound.
- Held vectors (direct forms, biases, scales, embeddings, the vectorized
  path) multiply nothing into their norm: a sum of squares that flushes
  loses at most 2^-126 per entry, which `NORM_FLOOR` covers for up to 2^36
  entries per example.
- The weighted sums' own products `weight * y` may flush in the output's
  units: at most 2^-126 per entry added, below 1e-20 of any clip norm
  >= `NORM_FLOOR`.
A non-finite largest entry (of the rows a Gram form reads, or of its output
gradients) makes that example's squares inf: factor 0, dropped. A conv's
largest entry is taken over the input region its patches read, so that
entries no patch reads (an inf, a 1e30) cannot set the scale.
"""

import math
from typing import Optional

import numpy as np
import tensorflow as tf

from tfdp.dp import compiler_checks
from tfdp.dp import device_arithmetic

UNIT_ROUNDOFF = 2.0**-24  # float32's u: |fl(x) - x| <= u |x| (round to nearest)
STAGE = 32  # at most this many terms per op of a staged sum (XLA's CPU tree reduction: 32 too)
CHUNK = 32  # chunk length of an exact contraction (its error bound vs GEMM efficiency)
SPLIT_CHUNK = 16  # the same for a split (six-pass) contraction: see `contraction_error`
ROW_CHUNK = 128  # rows of one example per contraction of a Gram-form weighted sum
_SPLIT_ERROR = 4.01 * UNIT_ROUNDOFF  # dropped piece products and remainders, per |a| |b|
_SPLIT_MASS = 1.02  # sum over the six passes of |a_i| |b_j| <= 1.02 |a| |b|


NORM_FLOOR = 2.0**-45  # every example's norm counts as at least this (about 2.8e-14)


def gamma(n: float) -> float:
    """Higham's `gamma(n) = n u / (1 - n u)` for float32 (u = 2^-24)."""
    if n * UNIT_ROUNDOFF >= 0.5:
        raise ValueError(f"gamma({n}) is not small: a sum of that many terms has no useful "
                         "float32 bound; stage it.")
    return n * UNIT_ROUNDOFF / (1.0 - n * UNIT_ROUNDOFF)


# -- The clip margin: error no op-by-op model covers -------------------------------------

# kappa per device class: every example is clipped to C / (1 + kappa) while the noise stays
# calibrated to C, so a contribution that the device computes up to (1 + kappa) times larger
# than the rules' bound is still within C. The rules' bounds are rigorous for the arithmetic
# `tfdp.dp.precision` models (round-to-nearest float32 and the device's matmul inputs, with
# flushing: "Range"); kappa covers what it cannot model, such as a compiler that turns an
# elementwise weighted sum into a rounded dot, or a convolution algorithm of its own choice.
# The worst excess seen (docs/design/ghost_norms_and_precision.md, "The clip margin κ"):
#   float32 (CPU): none (<= 0.999998 C in every fuzzer and the HLO replay); 1e-5 is 10x
#     the fuzzers' tolerance of 1e-6.
#   tf32 (Ampere+ GPU): 8.72e-5 on an H200 (one-hot replay, float32 plan; 7.42e-5 with the
#     split plan); 1e-3 is 11x that, and above the worst a TF32 rounding of both inputs of
#     a weighted sum can add ((1 + 2^-11)^2 - 1 = 9.8e-4).
#   bf16 (TPU, oneDNN bf16 fpmath): not measured on a TPU; 1e-2 is 14x the H200's excess
#     scaled by the 8x coarser rounding, and above a bf16 rounding of one input (3.9e-3).
CLIP_MARGINS = {"float32": 1e-5, "tf32": 1e-3, "bf16": 1e-2}


def clip_margin(device: Optional[str] = None) -> float:
    """kappa for `device` (a `MatmulInputs` name), or for `device_inputs()`: `CLIP_MARGINS`."""
    return CLIP_MARGINS[device or device_arithmetic.device_inputs().name]


def margined_clip_norm(l2_clip_norm: float) -> float:
    """`C / (1 + kappa)`: the norm every example is clipped to; the noise stays calibrated to C.

    Args:
      l2_clip_norm: C > 0, the sensitivity the accountant and the noise use.

    Returns:
      `l2_clip_norm`'s type (a Python float, or a tensor), with kappa read now,
      at trace time (the device class of `clip_margin`).
    """
    return l2_clip_norm / (1.0 + clip_margin())


def clip_margin_record(l2_clip_norm: float, device: Optional[str] = None) -> dict:
    """What the privacy card says of the clip margin (`tfdp.export.privacy_report`).

    Args:
      l2_clip_norm: C.
      device: the `MatmulInputs` name the step was traced for
        (`tfdp.training.DPModel.traced_matmul_inputs`); None: `device_inputs()`.
    """
    device = device or device_arithmetic.device_inputs().name
    kappa = clip_margin(device)
    return {"device_matmul_inputs": device, "kappa": kappa,
            "clipped_to": float(l2_clip_norm) / (1.0 + kappa),
            "why": ("every example is clipped to l2_clip_norm / (1 + kappa) and the noise is "
                    "calibrated to l2_clip_norm: kappa covers device arithmetic that the "
                    "per-example norm bounds do not model (README, 'What the guarantee "
                    "assumes')")}


def bf16_pieces(t: tf.Tensor):
    """`(t1, t2, t3)`, float32 tensors exactly representable in bfloat16, `t ~ t1 + t2 + t3`.

    `t1 = bf16(t)`, `t2 = bf16(t - t1)`, `t3 = bf16(t - t1 - t2)`, each
    rounded to nearest: `|t - t1 - t2 - t3| <= 2^-24 |t|` (each remainder is
    exact in float32 and at most 2^-8 of the previous one).
    """
    t1 = device_arithmetic.round_mantissa(t, 8)
    r1 = t - t1
    t2 = device_arithmetic.round_mantissa(r1, 8)
    t3 = device_arithmetic.round_mantissa(r1 - t2, 8)
    return t1, t2, t3


# -- Products ----------------------------------------------------------------------


def einsum(equation: str, a: tf.Tensor, b: tf.Tensor, *, exact: bool) -> tf.Tensor:
    """`tf.einsum(equation, a, b)` for float32 operands, at a stated precision.

    Args:
      equation: a two-operand einsum equation without an ellipsis, whose two
        operands start with the same label. Its batch (shared, kept) labels
        must have the same size on both sides: TensorFlow 2.21's oneDNN
        batch matmul computes broadcast batch axes wrongly
        (`tfdp.graph_checks.BROADCAST_MATMUL_BUG`); keep one batch axis
        (rank 3) where sizes are not static.
      a, b: float32 operands.
      exact: False: one pass at the device's precision (what any float32
        matmul of the model gets; use it where the result is held and its
        own norm is taken). True: products good to float32, on every device
        (`contraction_error` bounds the result): one pass where the device
        keeps float32 inputs, else the six bf16-piece passes of the module
        docstring, concatenated along the operands' first axis, in one
        einsum (so that no compiler rewrite can merge two passes into a
        product of rounded sums): a batch axis is then summed over the six
        passes, a contracted one is six times as long.

    Returns:
      float32, the einsum's shape.
    """
    if not (exact and device_arithmetic.splits()):
        return tf.einsum(equation, device_arithmetic.device_rounded(a),
                         device_arithmetic.device_rounded(b))
    inputs, output = equation.replace(" ", "").split("->")
    left, right = inputs.split(",")
    if left[0] != right[0]:
        raise ValueError(f"precision.einsum: {equation!r}: both operands must start with the "
                         "same label (the axis the six passes are concatenated along).")
    a1, a2, a3 = bf16_pieces(a)
    b1, b2, b3 = bf16_pieces(b)
    stacked_a = tf.concat([a1, a1, a2, a1, a2, a3], axis=0)
    stacked_b = tf.concat([b1, b2, b1, b3, b2, b1], axis=0)
    result = tf.einsum(equation, device_arithmetic.device_rounded(stacked_a),
                       device_arithmetic.device_rounded(stacked_b))
    if left[0] not in output:  # contracted: the passes' sum is part of the contraction
        return result
    axis = output.index(left[0])
    shape = tf.shape(result)
    parts = tf.reshape(result, tf.concat([shape[:axis], [6, shape[axis] // 6], shape[axis + 1:]],
                                         0))
    return tf.reduce_sum(parts, axis=axis)


def matmul(a: tf.Tensor, b: tf.Tensor, *, transpose_a: bool = False) -> tf.Tensor:
    """`tf.matmul(a, b, transpose_a=...)` at the device's precision (one pass).

    For products that are HELD, whose result's own norm is taken (the ghost
    rules' direct form), so that their rounding does not matter: `einsum(...,
    exact=False)` without an einsum's transposes. Same batch shape on both
    sides (see `einsum`).
    """
    return tf.matmul(device_arithmetic.device_rounded(a), device_arithmetic.device_rounded(b),
                     transpose_a=transpose_a)


def contraction_error(length: int, *, exact: bool = True) -> float:
    """e with `|computed - exact| <= e * sum_k |a_k| |b_k|` for one output of `einsum`.

    For a contraction of `length` products computed by `einsum(..., exact)`.
    When split, the six passes may be one contraction of `6 * length`
    products of exact bf16 pieces (`einsum`), whose dropped terms add
    4.01 u. With `exact=False` on a device that rounds, the inputs'
    rounding (about 2 * 2^-bits per product) is included. Keep `length` small
    by chunking long contractions (`chunked_contraction_error`).
    """
    if exact and device_arithmetic.splits():
        return _SPLIT_ERROR + _SPLIT_MASS * gamma(6 * length + 6)
    bits = device_arithmetic.FLOAT32.bits if exact else device_arithmetic.planned_inputs().bits
    product = (1.0 + 2.0**-bits)**2 - 1.0 if bits < device_arithmetic.FLOAT32.bits else 0.0
    return product + (1.0 + product) * gamma(length + 1)


def contraction_chunk() -> int:
    """Chunk length of an exact contraction on this device: `CHUNK`, or `SPLIT_CHUNK` when split.

    A split contraction may chain six times its length (`contraction_error`).
    """
    return SPLIT_CHUNK if device_arithmetic.splits() else CHUNK


def chunked_contraction_error(chunk: int, chunks: int) -> float:
    """`contraction_error` of `chunks` exact contractions of `chunk` products, then `staged_sum`.

    e = e_chunk + gamma(sum_chain(chunks)) (1 + e_chunk).
    """
    inner = contraction_error(chunk, exact=True)
    return inner + (1.0 + inner) * gamma(sum_chain(chunks))


def staged_contraction_error(length: int) -> float:
    """`chunked_contraction_error` of a contraction of `length` cut by `chunk_last_axis`."""
    chunk = min(length, contraction_chunk())
    return chunked_contraction_error(chunk, -(-length // chunk))


def chunk_last_axis(t: tf.Tensor, chunk: Optional[int] = None) -> tf.Tensor:
    """`t` [..., K] -> [..., C, c], zero-padded to C c >= K, with c = min(K, chunk)."""
    length = t.shape[-1]
    chunk = min(length, chunk or contraction_chunk())
    count = -(-length // chunk)
    if count * chunk != length:
        pad = [[0, 0]] * (t.shape.rank - 1) + [[0, count * chunk - length]]
        t = tf.pad(t, pad)  # zeros: exact
    return tf.reshape(t, tf.concat([tf.shape(t)[:-1], [count, chunk]], 0))


# -- Sums ----------------------------------------------------------------------------


def _stage_widths(n: int):
    """The widths that `staged_sum` sums `n` terms in: `(widths, padded)` per stage."""
    stages = []
    while n > STAGE:
        width = next((w for w in range(STAGE, STAGE // 2 - 1, -1) if n % w == 0), None)
        padded = width is None
        width = STAGE if padded else width
        stages.append((width, padded))
        n = -(-n // width)
    stages.append((n, False))
    return stages


DYNAMIC_LEVELS = 6  # stages of a staged sum over a size known only at run time (<= 32^6 terms)


def sum_chain(n: Optional[int]) -> int:
    """How many additions one result of `staged_sum` over `n` terms can chain (at most).

    `n` None: a size known only at run time, at most STAGE^DYNAMIC_LEVELS (about 1e9).
    """
    if n is None:
        return DYNAMIC_LEVELS * (STAGE - 1)
    return sum(width - 1 for width, _ in _stage_widths(n)) if n > 1 else 0


def sum_error(n: int) -> float:
    """e with `|staged_sum(x) - sum(x)| <= e * sum |x|` over `n` terms."""
    return gamma(sum_chain(n))


def staged_sum(t: tf.Tensor, axis: int = -1) -> tf.Tensor:
    """`sum(t, axis)` in stages of at most `STAGE` terms (static size along `axis`).

    Error `sum_error(n)`. The axis is reshaped (zero-padded where no divisor
    between STAGE/2 and STAGE exists) to `[n / w, w]` and summed over w,
    until at most STAGE terms are left: no transpose, whatever the axis.
    """
    t = tf.convert_to_tensor(t)
    axis = axis % t.shape.rank
    n = t.shape[axis]
    if n is None:  # DYNAMIC_LEVELS stages of STAGE, zero-padded at run time
        for _ in range(DYNAMIC_LEVELS):
            pad = [[0, 0]] * t.shape.rank
            pad[axis] = [0, tf.math.floormod(-tf.shape(t)[axis], STAGE)]
            t = tf.pad(t, pad)
            shape = tf.shape(t)
            t = tf.reshape(t, tf.concat([shape[:axis], [shape[axis] // STAGE, STAGE],
                                         shape[axis + 1:]], 0))
            t = tf.reduce_sum(t, axis=axis + 1)
        return tf.reduce_sum(t, axis=axis)
    for width, padded in _stage_widths(n)[:-1]:
        if padded:
            pad = [[0, 0]] * t.shape.rank
            pad[axis] = [0, -n % width]
            t = tf.pad(t, pad)
        n = -(-n // width)
        shape = tf.shape(t)
        t = tf.reshape(t, tf.concat([shape[:axis], [n, width], shape[axis + 1:]], 0))
        t = tf.reduce_sum(t, axis=axis + 1)
    return tf.reduce_sum(t, axis=axis)


def example_size(t: tf.Tensor) -> Optional[int]:
    """Entries per example of `t` [batch, ...], or None if not static."""
    inner = t.shape[1:]
    return math.prod(inner.as_list()) if inner.is_fully_defined() else None


def flat_examples(t: tf.Tensor) -> tf.Tensor:
    """`t` [batch, ...] -> [batch, n] (n static where `example_size` is)."""
    size = example_size(t)
    return tf.reshape(t, [tf.shape(t)[0], -1 if size is None else size])


def sum_of_squares(t: tf.Tensor) -> tf.Tensor:
    """`sum(t[i]**2)` per example i, float32 `[batch]`, staged; error `square_sum_error`."""
    return staged_sum(tf.square(flat_examples(t)))


def square_sum_error(n: Optional[int]) -> float:
    """Relative error of `sum_of_squares` over `n` entries (squares and sums both rounded)."""
    return gamma(sum_chain(n) + 1)


def square_sum_excess(n: Optional[int]) -> float:
    """r with `exact <= computed (1 + r)` for `sum_of_squares` over `n` entries (all >= 0).

    A sum of non-negative terms computed with relative error at most
    e = `square_sum_error(n)` is at least `exact (1 - e)`: r = e / (1 - e).
    """
    error = square_sum_error(n)
    return error / (1.0 - error)


def upper(value: tf.Tensor, relative: float) -> tf.Tensor:
    """A float32 value `>= value * (1 + relative)` (for `value >= 0`), whatever the rounding.

    `fl(v (1 + r + 3u)) >= v (1 + r + 3u)(1 - u) >= v (1 + r)` for r < 1.
    """
    return value * np.float32(1.0 + relative + 3.0 * UNIT_ROUNDOFF)


def sum_of_squares_bound(t: tf.Tensor) -> tf.Tensor:
    """An upper bound, float32 `[batch]`, on the exact `sum(t[i]**2)` of each example's entries."""
    return upper(sum_of_squares(t), square_sum_excess(example_size(t)))


def held_squares(blocks) -> tf.Tensor:
    """`squares` of held vectors: a bound on |fl(f * v)|^2 / f^2 per example, float32 `[batch]`.

    For per-example vectors v that a weighted sum adds as `fl(f * v)` (one
    rounding per product: `weighted_sum`, `tfdp.dp.clipping.weighted_sum`):
    a staged sum of squares, rounded up by its error bound and the product's.
    The ghost rules' held vectors and the vectorized path's per-example
    gradients (`tfdp.dp.clipping.global_l2_norms`) both use it.

    Args:
      blocks: a float32 tensor `[batch, ...]` or a list of them (the held
        vector's pieces).

    Returns:
      float32 `[batch]`, never below the exact `sum |fl(f v_i)|^2 / f^2`.
    """
    blocks = blocks if isinstance(blocks, list) else [blocks]
    sums = [sum_of_squares(b) for b in blocks]
    chain = max(sum_chain(example_size(b)) for b in blocks)
    error = gamma(chain + 1 + len(blocks) - 1)
    relative = error / (1.0 - error) + 3 * UNIT_ROUNDOFF  # (1 + u)^2 <= 1 + 3u: the product
    return upper(tf.add_n(sums), relative)


def two_sum(a: tf.Tensor, b: tf.Tensor):
    """`(s, e)` with `s = fl(a + b)` and `a + b = s + e` exactly (Knuth's TwoSum).

    Needs round-to-nearest float arithmetic that the compiler does not
    reassociate (TensorFlow and XLA without fast-math; tested under both).
    """
    s = a + b
    b_virtual = s - a
    a_virtual = s - b_virtual
    return s, (a - a_virtual) + (b - b_virtual)


def compensated_sum(t: tf.Tensor, axis: int = 1) -> tf.Tensor:
    """`sum(t, axis)` in float32 with error-free pairwise steps (TwoSum), static `axis` size.

    A pairwise tree of `two_sum`s whose exact errors are summed beside it:
    the result is within `u |sum| + gamma(L)^2 sum |t|` of the exact sum, L
    the tree's depth (Ogita, Rump & Oishi 2005, "Accurate sum and dot
    product", Sec. 4; here pairwise). A sum that cancels (sum_r g_r of a
    group-normalized layer) comes out as accurate as float64 would give it.
    """
    t = tf.convert_to_tensor(t)
    axis = axis % t.shape.rank
    perm = [axis] + [a for a in range(t.shape.rank) if a != axis]
    t = tf.transpose(t, perm)
    n = t.shape[0]
    if n is None:
        raise ValueError("compensated_sum needs a static size along its axis.")
    errors = tf.zeros_like(t)
    while n > 1:
        half = n // 2
        s, e = two_sum(t[:half], t[half:2 * half])
        e = errors[:half] + errors[half:2 * half] + e
        if n % 2:
            s = tf.concat([s, t[2 * half:]], 0)
            e = tf.concat([e, errors[2 * half:]], 0)
        t, errors, n = s, e, s.shape[0]
    return t[0] + errors[0]


# -- The clipped sum's contractions ----------------------------------------------------


def weighted_sum(factors: tf.Tensor, held: tf.Tensor) -> tf.Tensor:
    """`sum_i factors[i] * held[i]`, float32 `held.shape[1:]`, each product rounded once.

    The vector example i adds is then `fl(factors[i] * held[i])`, of norm at
    most `factors[i] |held[i]| (1 + u)`, on every device: a `tensordot`
    (one GEMV) where the device keeps float32 matmul inputs, elementwise
    products and a sum where it would round them (a TPU's bf16 pass would
    add up to 2^-8 to the norm). The sum over the batch is the float32 sum
    that every DP-SGD implementation shares.

    Args:
      factors: float32 `[batch]`, finite, >= 0.
      held: float32 `[batch, ...]`, finite.
    """
    factors = tf.cast(factors, held.dtype)
    if device_arithmetic.planned_inputs().bits >= device_arithmetic.FLOAT32.bits:
        return tf.tensordot(device_arithmetic.device_rounded(factors),
                            device_arithmetic.device_rounded(held), 1)
    return tf.reduce_sum(held * tf.reshape(factors, [-1] + [1] * (held.shape.rank - 1)), 0)


# -- Scale: exact powers of two (see "Range" in the module docstring) -----------------

MIN_EXPONENT = -126  # float32's smallest normal exponent
MAX_EXPONENT = 127


def binary_exponent(magnitude: tf.Tensor) -> tf.Tensor:
    """k with `magnitude / 2^k` in [1, 2), clipped to [-126, 126]; 0 where not finite or 0.

    Args:
      magnitude: float32, >= 0 (e.g. a maximum of absolute values).

    Returns:
      int32, `magnitude`'s shape. Read from the float's exponent bits, so
      exact on every device (no log2).
    """
    magnitude = tf.convert_to_tensor(magnitude, tf.float32)
    biased = tf.bitwise.bitwise_and(tf.bitwise.right_shift(tf.bitcast(magnitude, tf.int32), 23),
                                    0xFF)
    usable = tf.logical_and(magnitude > 0, compiler_checks.is_finite(magnitude))
    return tf.where(usable, tf.clip_by_value(biased - 127, MIN_EXPONENT, MAX_EXPONENT - 1), 0)


def power_of_two(k: tf.Tensor) -> tf.Tensor:
    """`2^k` as float32, exactly, for int32 k in [-126, 127] (built from its bits)."""
    k = tf.clip_by_value(tf.cast(k, tf.int32), MIN_EXPONENT, MAX_EXPONENT)
    return tf.bitcast(tf.bitwise.left_shift(k + 127, 23), tf.float32)


def times_power_of_two(x: tf.Tensor, k: tf.Tensor) -> tf.Tensor:
    """`x * 2^k` for int32 k in [-252, 254] (broadcast against float32 x), in two exact steps.

    Exact wherever the result is a normal float32. The two factors have the
    sign of k, so an intermediate overflow (underflow) means that the exact
    result overflows (underflows) too: inf (0 or a denormal) comes out
    where it should.
    """
    k = tf.cast(k, tf.int32)
    first = tf.clip_by_value(k, MIN_EXPONENT, MAX_EXPONENT)
    second = tf.clip_by_value(k - first, MIN_EXPONENT, MAX_EXPONENT)
    return x * power_of_two(first) * power_of_two(second)


def underflow_slack(rows: int, fan_in: int, fan_out: int) -> float:
    """An absolute bound, in the scaled units, on what flushing adds to a Gram-form |h|^2.

    `2^-100 R^2 (F + 1)(O + 1)`: see "Range" in the module docstring (the
    argument needs 2^-117 times the same size).
    """
    return 2.0**-100 * rows * rows * (fan_in + 1) * (fan_out + 1)
