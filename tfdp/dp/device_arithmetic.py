"""What the device does to a float32 matmul, and the settings that would change it unseen.

The error model of `tfdp.dp.precision` is stated per device class: what a
float32 matmul's inputs keep on the device that runs the step (`MatmulInputs`:
all 24 bits on a CPU, 11 under TF32 on an Ampere or newer GPU, 8 in a TPU's
one bf16 pass). This module says which class the step runs on
(`device_inputs`), lets a test emulate another on a CPU (`emulate`,
`device_rounded`), records what a traced step planned for (`step_plan`), and
refuses the settings that would rewrite the traced step's arithmetic after its
norms were planned (`refuse_precision_rewrites`: grappler's automatic mixed
precision, XLA's fast math, oneDNN's float16 fpmath). Design:
docs/design/ghost_norms_and_precision.md.
"""

import contextlib
import dataclasses
from typing import Iterator, Optional

import tensorflow as tf

from tfdp import process_settings
from tfdp.dp import compiler_checks


# -- Devices: what a float32 matmul's inputs keep -----------------------------------------


@dataclasses.dataclass(frozen=True)
class MatmulInputs:
    """How a device rounds the float32 inputs of a matmul at default precision.

    Attributes:
      name: "float32", "tf32" or "bf16".
      bits: significant bits kept (24, 11, 8): each input is rounded to
        nearest, a relative change of at most `2^-bits`.
    """

    name: str
    bits: int


FLOAT32 = MatmulInputs("float32", 24)
TF32 = MatmulInputs("tf32", 11)
BF16 = MatmulInputs("bf16", 8)


@dataclasses.dataclass(frozen=True)
class _Emulation:
    device: MatmulInputs  # what the emulated device does to matmul inputs
    handled: bool  # whether the rules are told (False: they plan for float32)


_emulation: Optional[_Emulation] = None


@contextlib.contextmanager
def emulate(device: MatmulInputs, *, handled: bool = True) -> Iterator[None]:
    """Emulates a device's matmul precision on any device, while the rules are traced.

    Inside, every one-pass `einsum` rounds its inputs to `device.bits`
    significant bits first, as the device would (the rules' own products;
    `tests/dp/device_emulation.py` rounds every matmul and convolution of a
    traced step, the model's included). With `handled`, the rules
    know it (`planned_inputs()` is `device`) and split the products that
    matter; with `handled=False` they plan for full float32 while the
    emulated device rounds: the norms of the old rules on that device (a
    test shows that the bound then fails). Read while a rule is traced (or
    run eagerly): a `tf.function` traced outside keeps its precision.

    Args:
      device: `FLOAT32`, `TF32` or `BF16`.
      handled: whether the rules see the emulated device.
    """
    global _emulation
    previous, _emulation = _emulation, _Emulation(device, handled)
    try:
        yield
    finally:
        _emulation = previous


def device_inputs() -> MatmulInputs:
    """What the device that runs the step does to a float32 matmul's inputs.

    `BF16` when a TPU is visible (or the current strategy is a TPUStrategy);
    `TF32` when a GPU is visible and TF32 execution is enabled (TensorFlow's
    default); `BF16` when oneDNN's fpmath mode allows lower precision under
    any of its spellings (`ONEDNN_DEFAULT_FPMATH_MODE`, the legacy
    `DNNL_DEFAULT_FPMATH_MODE`, `TF_SET_ONEDNN_FPMATH_MODE`), set when the
    process started, when tfdp was imported or now
    (`tfdp.process_settings.onednn_fpmath_modes`: oneDNN keeps a mode it has
    read); `BF16` or `TF32` when a CPU matmul is seen to round its inputs
    (`tfdp.dp.compiler_checks.observe_cpu_matmul_bits`: a mode set and
    removed before tfdp looked); otherwise `FLOAT32`. Errs towards
    rounding: a CPU step of a process that also sees a GPU is treated as
    TF32, and a mode oneDNN may never have read as BF16 (splitting costs
    time, never privacy).
    """
    if _emulation is not None:
        return _emulation.device
    strategy = tf.distribute.get_strategy()
    if tf.config.list_logical_devices("TPU") or "TPU" in type(strategy).__name__:
        return BF16
    if tf.config.list_logical_devices("GPU") and (
            tf.config.experimental.tensor_float_32_execution_enabled()):
        return TF32
    if process_settings.onednn_fpmath_modes():
        return BF16
    bits = compiler_checks.observe_cpu_matmul_bits()  # a mode oneDNN read before tfdp looked
    if bits < FLOAT32.bits:
        return BF16 if bits <= BF16.bits else TF32
    return FLOAT32


# -- What may not change after tracing ----------------------------------------------------

_AMP_OPTIONS = ("auto_mixed_precision", "auto_mixed_precision_mkl",
                "auto_mixed_precision_onednn_bfloat16", "auto_mixed_precision_cpu")
PrecisionRewrite = compiler_checks.PrecisionRewrite


def refuse_precision_rewrites() -> None:
    """Raises if a setting would rewrite the traced step's arithmetic behind the rules.

    Grappler's automatic mixed precision (`tf.config.optimizer.
    set_experimental_options({"auto_mixed_precision...": True})`, including
    Intel's `auto_mixed_precision_onednn_bfloat16` and the v1
    `enable_mixed_precision_graph_rewrite`) rewrites the traced graph to
    bf16/fp16 after the ghost rules have planned for float32, which no plan
    can cover (1.003 C seen). XLA's fast math may reassociate the
    error-free sums and hide non-finite norms: `tfdp.dp.compiler_checks.
    refuse_fast_math` reads what XLA was told and observes what it compiles.
    Keras mixed policies are refused by `tfdp.models.validate_float32`.

    Raises:
      PrecisionRewrite: naming the setting and how to turn it off
        (`compiler_checks.FastMath` for XLA's fast math).
    """
    options = tf.config.optimizer.get_experimental_options()
    on = [name for name in _AMP_OPTIONS if options.get(name)]
    if on:
        raise PrecisionRewrite(
            f"Grappler's automatic mixed precision is on ({', '.join(on)}): it rewrites the "
            "traced DP step to lower precision after its per-example norms were planned for "
            "float32, so a clipped contribution could exceed l2_clip_norm. Turn it off "
            f"before training: tf.config.optimizer.set_experimental_options("
            f"{ {name: False for name in on} }). DP training runs in float32.")
    compiler_checks.refuse_fast_math()
    compiler_checks.refuse_float16_fpmath()


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What a traced DP step planned for; a change after tracing needs a new trace.

    Attributes:
      inputs: `device_inputs().name` at trace time.
      tensor_float_32: whether TF32 execution was enabled.
      onednn_fpmath: the oneDNN fpmath modes seen (`process_settings.onednn_fpmath_modes`).

    The strategy is the model's own (fixed); a TPU is seen by `device_inputs`.
    """

    inputs: str
    tensor_float_32: bool
    onednn_fpmath: tuple


def step_plan() -> StepPlan:
    """The `StepPlan` of a step traced now (cheap: read before every train-function call)."""
    return StepPlan(device_inputs().name,
                    bool(tf.config.experimental.tensor_float_32_execution_enabled()),
                    tuple(process_settings.onednn_fpmath_modes()))


def planned_inputs() -> MatmulInputs:
    """The precision the rules plan for: `device_inputs()`, unless `emulate(handled=False)`."""
    if _emulation is not None and not _emulation.handled:
        return FLOAT32
    return device_inputs()


def splits() -> bool:
    """Whether `einsum(..., exact=True)` splits its operands (a device that rounds them)."""
    return planned_inputs().bits < FLOAT32.bits


def round_mantissa(t: tf.Tensor, bits: int) -> tf.Tensor:
    """`t` rounded to nearest (ties to even) to `bits` significant bits.

    Computed on the bits of `t` (integer operations), never as a cast: XLA's
    `SimplifyFPConversions` pass removes a float32 -> bfloat16 -> float32
    convert chain (its GPU compiler runs it whenever
    `xla_allow_excess_precision` is on, the default; oneDNN CPU builds with
    the contraction rewriter enabled run it too), and the split products
    (`tfdp.dp.precision.bf16_pieces`) are exact only if their pieces really
    are rounded. A finite value beyond the
    largest one `bits` can hold rounds to inf, as a cast does; inf and NaN
    (whatever their payload) are returned as they are.

    Args:
      t: float32 tensor, any shape.
      bits: significant bits kept, 1 to 24 (24: `t` itself; 8: bfloat16's).

    Returns:
      float32, `t`'s shape.
    """
    if bits >= 24:
        return t
    drop = 24 - bits
    ints = tf.bitcast(t, tf.int32)
    odd = tf.bitwise.bitwise_and(tf.bitwise.right_shift(ints, drop), 1)
    # A finite value's magnitude bits are at most 0x7F7FFFFF: adding under 2^drop cannot
    # carry into the sign. A NaN's could (0x7FFFFFFF would become -0.0): kept as it is.
    ints = tf.bitwise.bitwise_and(ints + ((1 << (drop - 1)) - 1) + odd, ~((1 << drop) - 1))
    return tf.where(compiler_checks.is_finite(t), tf.bitcast(ints, tf.float32), t)


def device_rounded(t: tf.Tensor) -> tf.Tensor:
    """What the device multiplies for the float32 matmul or convolution input `t`.

    `t` itself on a real device (which rounds by itself); inside `emulate`,
    `t` rounded to the emulated device's significant bits. Every one-pass
    product of the rules takes its inputs through this (`tfdp.dp.precision.einsum`,
    `matmul`, `weighted_sum`, and a grouped convolution in `tfdp.dp.ghost_norms`).

    Args:
      t: float32 tensor, any shape.

    Returns:
      float32, `t`'s shape.
    """
    if _emulation is None:
        return t  # the real device rounds by itself
    return round_mantissa(t, _emulation.device.bits)
