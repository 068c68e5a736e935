"""Tap rules: how each layer class computes its output in sites, one module per layer family.

A rule `(layer, inputs, recorder) -> outputs` computes the layer's output
from its variables in explicit pieces ("sites"), each with the ghost-norm
function of `tfdp.dp.ghost_norms` that gives its per-example squared norms
(`registry.register`). Importing this package registers every rule. Each
module imports the norms module of its family (`tfdp.dp.ghost_norms`):

- `dense`: Dense, EinsumDense (norms: `ghost_norms.dense`).
- `conv`: Conv2D (grouped too), WSConv2D, ScaledWSConv2D, DepthwiseConv2D (norms:
  `ghost_norms.conv`, `ghost_norms.weight_standardized`).
- `normalization`: GroupNormalization, LayerNormalization (scale and offset; norms:
  `ghost_norms.broadcast`).
- `embedding`: Embedding (norms: `ghost_norms.embedding`).
- `attention`: MultiHeadAttention, replayed with every sub-layer tapped (its
  projections through `dense`).
- `blocks`: ConvNeXt's LayerScale, NFResBlock (norms: `ghost_norms.broadcast`).
- `registry`: the registry (`ghost_norms.registry`) and every bias (`ghost_norms.broadcast`).
"""

from tfdp.training.ghost_taps import attention  # noqa: F401  (registers its rule)
from tfdp.training.ghost_taps import blocks  # noqa: F401
from tfdp.training.ghost_taps import conv  # noqa: F401
from tfdp.training.ghost_taps import dense  # noqa: F401
from tfdp.training.ghost_taps import embedding  # noqa: F401
from tfdp.training.ghost_taps import normalization  # noqa: F401
from tfdp.training.ghost_taps.registry import register

__all__ = ["register"]
