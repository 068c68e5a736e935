"""Tap rule of Embedding.

Norms: `tfdp.dp.ghost_norms.embedding` (`embedding_sq_norms`).
"""

import keras
from keras import ops

from tfdp.dp.ghost_norms import embedding as embedding_norms
from tfdp.training.ghost_taps.registry import register, require


@register(keras.layers.Embedding)
def _embedding(layer, inputs, recorder):
    # A mask would have to reach the layers downstream, which the tapped call does not do.
    require(not layer.mask_zero, "Embedding with mask_zero")
    require(not layer.lora_enabled and layer.quantization_mode is None,
             "LoRA or quantized Embedding")
    table = layer.embeddings
    return recorder.site(
        layer, [table], [inputs], lambda ids: ops.take(table, ops.cast(ids, "int32"), axis=0),
        lambda ins, out, g, k: embedding_norms.embedding_sq_norms(ins[0], g, layer.input_dim,
                                                                 num_views=k))
