"""Tap rules of dense layers: Dense and EinsumDense.

Norms: `tfdp.dp.ghost_norms.dense` (`kernel_sq_norms`, `einsum_kernel_sq_norms`).
"""

import keras
from keras import ops

from tfdp.dp.ghost_norms import dense as dense_norms
from tfdp.dp.ghost_norms.rows import Rows
from tfdp.training.ghost_taps.registry import bias_and_activation, register, require


@register(keras.layers.Dense)
def _dense(layer, inputs, recorder):
    require(not layer.lora_enabled and layer.quantization_mode is None,
             "LoRA or quantized Dense kernel")
    z = recorder.site(
        layer, [layer.kernel], [inputs], lambda x: ops.matmul(x, layer.kernel),
        lambda ins, out, g, k: dense_norms.kernel_sq_norms(Rows.of(ins[0]), g, num_views=k))
    return bias_and_activation(layer, z, recorder)


@register(keras.layers.EinsumDense)
def _einsum_dense(layer, inputs, recorder):
    """`einsum(equation, x, kernel)` as rows times a matrix, for the equations it covers.

    Multi-head attention's projections are covered (`dense_norms.einsum_kernel_geometry`).
    """
    require(not layer.lora_enabled and layer.quantization_mode is None,
             "LoRA or quantized EinsumDense kernel")
    kernel_shape = tuple(layer.kernel.shape)
    dense_norms.einsum_kernel_geometry(layer.equation, len(kernel_shape))  # or unsupported
    output_shape = ops.einsum(layer.equation, inputs, layer.kernel).shape
    require(layer.bias is None or tuple(layer.bias.shape) == tuple(
        output_shape[len(output_shape) - len(layer.bias.shape):]),
        "EinsumDense bias broadcast inside the output's trailing axes")
    z = recorder.site(
        layer, [layer.kernel], [inputs], lambda x: ops.einsum(layer.equation, x, layer.kernel),
        lambda ins, out, g, k: dense_norms.einsum_kernel_sq_norms(
            ins[0], g, layer.equation, kernel_shape, num_views=k))
    return bias_and_activation(layer, z, recorder)
