"""Tap rules of convolutions: Conv2D (grouped too), WSConv2D, ScaledWSConv2D, DepthwiseConv2D.

Norms: `tfdp.dp.ghost_norms.conv` (plain, grouped and depthwise kernels),
`tfdp.dp.ghost_norms.weight_standardized` (WS kernels) and, for a ScaledWSConv2D's gain,
`tfdp.dp.ghost_norms.broadcast`.
"""

import keras
from keras import ops

from tfdp.dp.ghost_norms import broadcast as broadcast_norms
from tfdp.dp.ghost_norms import conv as conv_norms
from tfdp.dp.ghost_norms import weight_standardized as ws_norms
from tfdp.models.scaled_ws_conv2d import ScaledWSConv2D
from tfdp.models.ws_conv2d import WSConv2D
from tfdp.training.ghost_taps.registry import bias_and_activation, register, require


def conv2d_geometry(layer, *, grouped=False):
    require(layer.data_format == "channels_last", "channels_first convolution")
    require(grouped or layer.groups == 1, "grouped convolution")
    require(not layer.lora_enabled, "LoRA convolution kernel")
    return dict(kernel_size=layer.kernel_size, strides=layer.strides,
                dilation_rate=layer.dilation_rate, padding=layer.padding)


@register(keras.layers.Conv2D)
def _conv2d(layer, inputs, recorder):
    """A convolution; grouped ones (ConvNeXt's `Conv2D(groups=C)`) by the grouped rule."""
    geometry = conv2d_geometry(layer, grouped=True)
    if layer.groups == 1:
        norms = lambda ins, out, g, k: conv_norms.conv2d_kernel_sq_norms(  # noqa: E731
            ins[0], g, num_views=k, **geometry)
    else:
        norms = lambda ins, out, g, k: conv_norms.grouped_conv2d_kernel_sq_norms(  # noqa: E731
            ins[0], g, groups=layer.groups, num_views=k, **geometry)
    z = recorder.site(
        layer, [layer.kernel], [inputs], lambda x: layer.convolution_op(x, layer.kernel), norms)
    return bias_and_activation(layer, z, recorder)


@register(WSConv2D, ScaledWSConv2D)
def _ws_conv2d(layer, inputs, recorder):
    """Weight-standardized conv; a ScaledWSConv2D's gain becomes its own site.

    `conv(x, gain * WS(W)) = gain * conv(x, WS(W))` per output channel, so the
    kernel site is the gain-free WS convolution (whose norm is chained through
    the standardization) and the gain a per-channel scale of its output.
    """
    geometry = conv2d_geometry(layer)

    def convolve(x):  # the standardization without the gain, for both classes
        standardized = WSConv2D.standardize_kernel(layer, layer.kernel)
        return keras.layers.Conv2D.convolution_op(layer, x, standardized)

    def norms(ins, out, g, k):
        return ws_norms.ws_kernel_sq_norms(conv_norms.conv2d_patches(ins[0], **geometry),
                                           g, layer.kernel, epsilon=layer.epsilon,
                                           num_views=k)

    z = recorder.site(layer, [layer.kernel], [inputs], convolve, norms)
    if isinstance(layer, ScaledWSConv2D):
        z = recorder.site(
            layer, [layer.gain], [z], lambda z: z * layer.gain,
            lambda ins, out, g, k: broadcast_norms.broadcast_sq_norms(
                g, layer.gain.shape, inputs=ins[0], num_views=k))
    return bias_and_activation(layer, z, recorder)


@register(keras.layers.DepthwiseConv2D)
def _depthwise_conv2d(layer, inputs, recorder):
    require(layer.data_format == "channels_last", "channels_first depthwise convolution")
    geometry = dict(kernel_size=layer.kernel_size, strides=layer.strides,
                    dilation_rate=layer.dilation_rate, padding=layer.padding,
                    depth_multiplier=layer.depth_multiplier)
    z = recorder.site(
        layer, [layer.kernel], [inputs],
        lambda x: ops.depthwise_conv(x, layer.kernel, strides=layer.strides,
                                     padding=layer.padding, dilation_rate=layer.dilation_rate,
                                     data_format=layer.data_format),
        lambda ins, out, g, k: conv_norms.depthwise_kernel_sq_norms(
            ins[0], g, num_views=k, **geometry))
    return bias_and_activation(layer, z, recorder)
