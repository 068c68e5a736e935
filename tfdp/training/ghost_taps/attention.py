"""Tap rule of MultiHeadAttention: its `call` replayed with every sub-layer tapped.

Norms: none of its own; its four projections are EinsumDense layers, whose tap
(`ghost_taps.dense`) takes `tfdp.dp.ghost_norms.dense`'s.
"""

import keras
from keras import ops

from tfdp.training.ghost_taps.registry import register, require


@register(keras.layers.MultiHeadAttention)
def _multi_head_attention(layer, inputs, recorder, use_causal_mask=False):
    """Replays `MultiHeadAttention.call` with its four EinsumDense projections tapped.

    Covers the plain layer: `(query, value[, key])` without masks, dropout,
    gate or sliding window, attention over the sequence axis of rank-3 inputs,
    with or without `use_causal_mask` (query position i attends to key
    positions j <= i, the layer's `_compute_causal_mask`, which is
    `dot_product_attention`'s `is_causal`). The attention itself is
    `ops.dot_product_attention` with the layer's 1/sqrt(key_dim) scale, as the
    layer computes it; it has no variables.
    `tests/training/ghost_clipping_test.py` checks that the replay equals the layer.
    """
    query, value, key = (list(inputs) + [None, None])[:3] if isinstance(
        inputs, (list, tuple)) else (inputs, None, None)
    require(value is not None, "MultiHeadAttention called without a value")
    key = value if key is None else key
    config = layer.get_config()
    require(len(query.shape) == 3 and tuple(config["attention_axes"] or (1,)) == (1,),
             "MultiHeadAttention over other axes than a rank-3 input's sequence")
    require(not config["dropout"] and not config.get("use_gate")
             and config.get("sliding_window") is None,
             "MultiHeadAttention with dropout, a gate or a sliding window")
    require(isinstance(use_causal_mask, bool), "MultiHeadAttention's use_causal_mask a tensor")
    attended = ops.dot_product_attention(
        recorder.call(layer.query_dense, query), recorder.call(layer.key_dense, key),
        recorder.call(layer.value_dense, value), scale=1.0 / float(layer.key_dim) ** 0.5,
        is_causal=use_causal_mask)
    return recorder.call(layer.output_dense, attended)


_multi_head_attention.takes_several_inputs = True  # (query, value[, key]): `_call_layer`
_multi_head_attention.call_options = ("use_causal_mask",)  # passed through `_call_layer`
