"""A device's matmul precision on EVERY matmul and convolution a traced step runs.

Not a test module. `tfdp.dp.device_arithmetic.emulate` rounds only the inputs of
`precision.einsum` and `precision.matmul`, the products the ghost rules
themselves choose. A real TF32 GPU or a TPU rounds the inputs of every
float32 matmul and convolution: the model's forward pass, its backward pass
(the gradient kernels), the rules' products and the weighted sums (a
`tensordot`). `every_matmul_rounded(device)` does that while a step is
traced: the TensorFlow op wrappers that create those ops (`MatMul`,
`BatchMatMul*`, `Einsum`, `Conv2D` and its two backprops, the depthwise
convolution and its two backprops, XLA's `XlaConvV2`) round each float32 input to the
device's significant bits first (round to nearest even), wherever
TensorFlow's own modules hold a reference to them. The rounding passes the
gradient straight through, so the backward pass is built as for the
unrounded op, and its own ops are rounded in turn.

Test-only: it replaces module attributes of TensorFlow for the duration of
the context (single-threaded tracing; nothing else may trace meanwhile).
It does not model a device's algorithms (Winograd or FFT convolutions,
split-K reductions), which the clip margin covers
(`tfdp.dp.precision.CLIP_MARGINS`).
"""

import contextlib
import sys

import numpy as np
import tensorflow as tf
from tensorflow.compiler.tf2xla.ops import gen_xla_ops
from tensorflow.python.ops import gen_linalg_ops
from tensorflow.python.ops import gen_math_ops
from tensorflow.python.ops import gen_nn_ops

from tfdp.dp import device_arithmetic

_OPS = {
    gen_math_ops: ("mat_mul", "batch_mat_mul", "batch_mat_mul_v2", "batch_mat_mul_v3"),
    gen_linalg_ops: ("einsum",),
    gen_nn_ops: ("conv2d", "conv2d_backprop_input", "conv2d_backprop_filter",
                 "depthwise_conv2d_native", "depthwise_conv2d_native_backprop_input",
                 "depthwise_conv2d_native_backprop_filter"),
    gen_xla_ops: ("xla_conv_v2",),
}

_count = {"ops": 0}  # how many op inputs were rounded (a test checks that it saw them)


def rounded_ops() -> int:
    """How many float32 op inputs the emulation has rounded so far in this process."""
    return _count["ops"]


def _rounder(bits):
    def round_one(value):
        if isinstance(value, (list, tuple)):
            return type(value)(round_one(v) for v in value)
        if isinstance(value, (tf.Tensor, tf.Variable, np.ndarray)):
            tensor = tf.convert_to_tensor(value)
            if tensor.dtype != tf.float32:
                return value
            _count["ops"] += 1
            # The value rounded, the gradient passed straight through: x + (r - x) is r
            # exactly (r - x is exact: r is within 2^-bits of x).
            rounded = device_arithmetic.round_mantissa(tensor, bits)
            return tensor + tf.stop_gradient(rounded - tensor)
        return value

    return round_one


def _wrap(original, round_one):
    def wrapped(*args, **kwargs):
        return original(*[round_one(a) for a in args],
                        **{k: round_one(v) for k, v in kwargs.items()})

    wrapped.__wrapped__ = original
    return wrapped


@contextlib.contextmanager
def every_matmul_rounded(device: device_arithmetic.MatmulInputs, *, handled: bool = True):
    """Inside, traced matmuls and convolutions round their float32 inputs as `device` does.

    Also enters `device_arithmetic.emulate(device, handled=handled)`: with `handled`
    the rules plan for the device (`device_arithmetic.device_inputs()` is `device`),
    without it they plan for float32 while every product rounds: the old
    float32 plan on that device. Trace the step inside.

    Args:
      device: `device_arithmetic.TF32` or `device_arithmetic.BF16`.
      handled: whether the rules see the emulated device.
    """
    round_one = _rounder(device.bits)
    originals = {id(getattr(module, name)): getattr(module, name)
                 for module, names in _OPS.items() for name in names}
    replaced = []  # (module, attribute, original)
    for module in list(sys.modules.values()):
        if module is None or not getattr(module, "__name__", "").startswith("tensorflow"):
            continue
        for attribute, value in list(vars(module).items()):
            if callable(value) and id(value) in originals:
                replaced.append((module, attribute, value))
    try:
        for module, attribute, value in replaced:
            setattr(module, attribute, _wrap(value, round_one))
        with device_arithmetic.emulate(device, handled=handled):
            yield
    finally:
        for module, attribute, value in replaced:
            setattr(module, attribute, value)
