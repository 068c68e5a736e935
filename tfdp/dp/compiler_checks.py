"""Whether the compiler keeps IEEE float semantics: XLA's fast math, asked and observed.

The per-example clip relies on IEEE float32 arithmetic: error-free sums that
must not be reassociated (`tfdp.dp.precision`), and non-finite norms that
must stay visible so that their example is dropped (`tfdp.dp.clipping.
clip_factors`). XLA's fast math breaks both. With NaN handling off
(`--xla_cpu_fast_math_honor_nans=false`), `is_finite(nan)` compiles to true
and `nan * 0` to 0, so one example with a NaN feature could make the whole
released update non-finite: its presence would be visible with certainty.

Two checks, both before any step runs:
1. The settings (`tfdp.process_settings.unsafe_xla_settings`): every value
   `XLA_FLAGS` and `TF_XLA_FLAGS` had when the process started, when tfdp
   was imported and now, a flag file read as XLA reads it. Names the flag.
2. XLA's behaviour (`observe_xla`): a small function compiled by XLA on each
   kind of device the step may run on (CPU, and GPU where one is visible)
   must keep NaN and inf, NaN-propagating max/min, and unreassociated sums.
   XLA parses its flags once per process, so this sees what XLA was told
   whenever it was told, a variable removed after XLA read it included.
   A TPU is not observed (its compiler's flags come from libtpu); the
   release guard (`tfdp.dp.noise.finite_release`) holds there too.

What XLA does not compile (TensorFlow's own kernels) has no fast math.
"""

import logging
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf

from tfdp import process_settings

# What the probe computes, and what IEEE float32 gives for it.
_PROBE_INPUT = (float("nan"), float("inf"), 1.0, 2.0**30)
_EXPECTED = {
    "is_nan(nan)": 1.0,  # NaN handling on
    "is_inf(inf)": 1.0,  # inf handling on
    "nan * 0": float("nan"),  # no `x * 0 -> 0`
    "max(nan, 1)": float("nan"),  # NaN-propagating max (no fast min/max)
    "min(nan, 1)": float("nan"),
    "(1 + 2^30) - 2^30": 0.0,  # no reassociation: 1 + 2^30 rounds to 2^30
    "max(1, nan)": float("nan"),
}

_observed: Dict[str, List[str]] = {}  # device type -> what differed (empty: IEEE kept)


_EXPONENT_BITS = {tf.float32: (tf.int32, 0x7F800000), tf.float64: (tf.int64, 0x7FF0000000000000)}


def is_finite(x: tf.Tensor) -> tf.Tensor:
    """`tf.math.is_finite(x)` computed on the bits of `x`.

    A float is inf or NaN exactly when its exponent bits are all ones (IEEE
    754). In TensorFlow's own kernels this is exact whatever XLA was told.
    Inside code XLA compiles with fast math, it is not: LLVM may treat a NaN
    made by an op it was told has none as undefined, and fold even this test
    (seen with NaN handling off). So fast math is refused (`refuse_fast_math`),
    and `tfdp.training.DPModel` checks the model's state after every step
    outside XLA.

    Args:
      x: float32 or float64 tensor (or variable).

    Returns:
      bool tensor of `x`'s shape.

    Raises:
      TypeError: for another dtype.
    """
    x = tf.convert_to_tensor(x)  # a variable's value
    if x.dtype not in _EXPONENT_BITS:
        raise TypeError(f"is_finite takes float32 or float64, got {x.dtype.name}.")
    int_type, exponent = _EXPONENT_BITS[x.dtype]
    bits = tf.bitcast(x, int_type)
    return tf.not_equal(tf.bitwise.bitwise_and(bits, tf.constant(exponent, int_type)),
                        tf.constant(exponent, int_type))


class PrecisionRewrite(ValueError):
    """Something would change the step's float32 arithmetic after the rules were traced."""


class FastMath(PrecisionRewrite):
    """XLA may compile the DP step without IEEE float semantics."""


def _probe(x):
    nan, inf, one, big = x[0], x[1], x[2], x[3]
    return tf.stack([tf.cast(tf.math.is_nan(nan), tf.float32),
                     tf.cast(tf.math.is_inf(inf), tf.float32),
                     nan * 0.0, tf.maximum(nan, one), tf.minimum(nan, one), (one + big) - big,
                     tf.maximum(one, nan)])


def _differences(values) -> List[str]:
    wrong = []
    for (name, expected), got in zip(_EXPECTED.items(), values):
        same = (got != got) if expected != expected else got == expected
        if not same:
            wrong.append(f"{name} gave {got:g} (IEEE: {expected:g})")
    return wrong


def observe_xla(device_type: str = "CPU") -> Optional[List[str]]:
    """What XLA's compiled code on `device_type` gets wrong of IEEE float32 (empty: nothing).

    Compiled and run once per device type and process (XLA's flags do not
    change once it has read them); later calls return the first answer.
    Runs eagerly even while a function is being traced (`tf.init_scope`).

    Args:
      device_type: "CPU" or "GPU".

    Returns:
      A list of the differences (`"is_nan(nan) gave 0 (IEEE: 1)"`), empty when
      XLA keeps IEEE semantics; None when XLA cannot compile on that device
      (then nothing of the step is compiled by XLA there either).
    """
    if device_type not in _observed:
        with tf.init_scope():
            try:
                with tf.device(f"/{device_type}:0"):
                    out = tf.function(_probe, jit_compile=True)(
                        tf.constant(_PROBE_INPUT, tf.float32))
                _observed[device_type] = _differences(out.numpy().tolist())
            except (tf.errors.ResourceExhaustedError, tf.errors.UnavailableError,
                    tf.errors.AbortedError):
                raise  # passing: asked again at the next check
            except (tf.errors.OpError, ValueError, RuntimeError) as error:
                logging.info("XLA does not compile on %s (%s): the DP step runs there "
                             "without XLA.", device_type, str(error).splitlines()[0][:200])
                _observed[device_type] = None
    return _observed[device_type]


_matmul_bits: Optional[int] = None


def observe_cpu_matmul_bits() -> int:
    """The significant bits a float32 matmul on the CPU keeps of its inputs: 24, 11 or 8.

    oneDNN's fpmath mode, once read, holds for the process, whatever its
    environment says later; on a CPU with AMX or AVX512-BF16 a bf16 mode
    rounds every matmul input to 8 bits. So the CPU's matmul is asked, by
    behaviour: `[1 + 2^-12] x I` keeps 2^-12 with 13 bits or more, and
    `[1 + 2^-9] x I` keeps 2^-9 with 10 or more. Run once per process (the
    mode does not change once read), eagerly (`tf.init_scope`).
    """
    global _matmul_bits
    if _matmul_bits is None:
        with tf.init_scope(), tf.device("/CPU:0"):
            eye = tf.eye(64, dtype=tf.float32)
            kept = [float(tf.reduce_min(tf.linalg.matmul(
                        tf.fill([64, 64], np.float32(1 + 2.0**-k)), eye)).numpy())
                    == np.float32(1 + 2.0**-k) for k in (12, 9)]
        _matmul_bits = 24 if kept[0] else 11 if kept[1] else 8
    return _matmul_bits


def refuse_float16_fpmath() -> None:
    """Raises if oneDNN was told it may compute float32 matmuls in float16.

    oneDNN's `F16` and `ANY` fpmath modes may convert float32 inputs to
    float16, whose exponent range (6e-5 to 65504) is not float32's: a piece
    of an exact product (`tfdp.dp.precision.einsum`) could flush to zero or
    overflow, and no bound of tfdp's covers that. `BF16` and `TF32` keep
    float32's range and are planned for (`device_arithmetic.device_inputs`).

    Raises:
      PrecisionRewrite: naming the variable, where it was seen and the fix.
    """
    f16 = [f"{variable}={value} ({where})"
           for variable, where, value in process_settings.onednn_fpmath_modes()
           if value.strip().upper() not in process_settings.ONEDNN_FPMATH_PLANNED]
    if f16:
        raise PrecisionRewrite(
            f"oneDNN may compute float32 matmuls in float16 ({', '.join(f16)}): float16's "
            "range cannot hold what the per-example norms compute. Use STRICT (the default), "
            "BF16 or TF32 in the environment the process starts with.")


def refuse_fast_math() -> None:
    """Raises before a DP step runs if XLA may compile it without IEEE float semantics.

    Raises:
      FastMath: (a `PrecisionRewrite`, a ValueError) naming the flag, where
        it was seen (at the process's start, at tfdp's import, now; a flag
        file), or what XLA's compiled code was seen to do, and how to turn
        it off; or `XLA_FLAGS` names a flag file that cannot be read.
    """
    try:
        flags = process_settings.unsafe_xla_settings()
    except process_settings.UnknowableSetting as error:
        raise FastMath(str(error)) from None
    if flags:
        raise FastMath(
            "XLA is told to use fast math, dropping IEEE float semantics ("
            + "; ".join(flags) + "). XLA may "
            "then reorder the error-free sums that bound each example's norm, and with NaN "
            "or inf handling off, one example with a NaN or inf feature makes the whole "
            "released update non-finite. Remove these flags from XLA_FLAGS (and from the "
            "file it names) in the environment the process starts with: XLA reads them "
            "once, so removing them from os.environ later does not turn them off.")
    devices = ["CPU"] + (["GPU"] if tf.config.list_logical_devices("GPU") else [])
    for device_type in devices:
        wrong = observe_xla(device_type)
        if wrong:
            raise FastMath(
                f"XLA's compiled code on {device_type} does not keep IEEE float semantics "
                f"({'; '.join(wrong)}): it was told to use fast math, though no such flag "
                "is in XLA_FLAGS now (XLA reads its flags once per process, so a flag "
                "removed from os.environ after that still holds). One example with a NaN "
                "or inf feature could then make the whole released update non-finite. "
                "Start a new process without fast-math flags in XLA_FLAGS.")
