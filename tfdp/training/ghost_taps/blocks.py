"""Tap rules of blocks: ConvNeXt's LayerScale, and NFResBlock replayed with its convolutions tapped.

Norms: `tfdp.dp.ghost_norms.broadcast` (`broadcast_sq_norms`: LayerScale's gamma, the skip
gain); the block's convolutions are the `conv` taps'.
"""

from tfdp.dp.ghost_norms import broadcast as broadcast_norms
from tfdp.models.nf_res_block import NFResBlock, scaled_relu
from tfdp.training.ghost_taps.registry import register, require


try:  # ConvNeXt's LayerScale: Keras exports no name for it (keras.applications.convnext)
    from keras.src.applications.convnext import LayerScale as _ConvNeXtLayerScale
except ImportError:  # another Keras: the layer has no rule and keeps the vectorized path
    _ConvNeXtLayerScale = None


def _layer_scale(layer, inputs, recorder):
    """ConvNeXt's LayerScale, `x * gamma` with gamma `[projection_dim]`: a scale site.

    The class is Keras' own (`keras.applications.ConvNeXt*` build it; a saved
    model loads it back as the same class). `LayerScale.call` is `x * gamma`
    (keras/src/applications/convnext.py); `tests/training/ghost_backbones_test.py`
    checks that this replay equals the layer, so that a Keras that changes
    it fails there.
    """
    require([v.path for v in layer.trainable_variables] == [layer.gamma.path]
             and tuple(layer.gamma.shape) == (inputs.shape[-1],),
             "LayerScale whose variables are not one gamma over the last axis")
    return recorder.site(
        layer, [layer.gamma], [inputs], lambda x: x * layer.gamma,
        lambda ins, out, g, k: broadcast_norms.broadcast_sq_norms(
            g, layer.gamma.shape, inputs=ins[0], num_views=k))


if _ConvNeXtLayerScale is not None:
    register(_ConvNeXtLayerScale)(_layer_scale)


@register(NFResBlock)
def _nf_res_block(block, inputs, recorder):
    """Replays `NFResBlock.call` with its convolutions tapped and the skip gain a site.

    `tests/training/ghost_clipping_test.py` checks that this replay equals the block.
    """
    out = scaled_relu(inputs) * (1.0 / block.beta)
    shortcut = inputs if block.conv_shortcut is None else recorder.call(block.conv_shortcut, out)
    out = recorder.call(block.conv0, out)
    out = recorder.call(block.conv1, scaled_relu(out))
    out = recorder.call(block.conv2, scaled_relu(out))
    branch = recorder.site(
        block, [block.skip_gain], [out * block.alpha], lambda r: r * block.skip_gain,
        lambda ins, out, g, k: broadcast_norms.broadcast_sq_norms(
            g, (), inputs=ins[0], num_views=k))
    return shortcut + branch
