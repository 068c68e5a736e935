"""Per-example gradient norms without per-example gradients ("ghost norms").

A layer computes its output `z` from its input activations `a` and its
variables; the gradient of example i's loss with respect to a variable
depends only on `a_i` and on `g_i = dL_i / dz_i`, which one ordinary
backward pass of the summed loss gives for the whole batch at once. The rules
here compute each example's SQUARED L2 norm of that gradient from `(a, g)`
alone, without materializing it where a cheaper form exists (Goodfellow
2015; Li et al. 2022, Sec. 4, "ghost clipping"; Bu et al. 2022, mixed ghost
clipping; Kong, Ribero & Velegkas 2024 for convolutions):

| parameter                    | per-example gradient                 | rule                         |
|------------------------------|--------------------------------------|------------------------------|
| dense / conv kernel          | sum_r a_r g_r^T over rows r          | `kernel_sq_norms`            |
| conv kernel (rows: patches)  | the above                            | `conv2d_kernel_sq_norms`     |
| weight-standardized kernel   | the above, chained through WS        | `ws_kernel_sq_norms`         |
| einsum kernel (EinsumDense)  | the above, input/output as rows      | `einsum_kernel_sq_norms`     |
| depthwise conv kernel        | sum_r a_rc g_rc^T per channel c      | `depthwise_kernel_sq_norms`  |
| grouped conv kernel          | sum_r a_rg g_rg^T per group g    | `grouped_conv2d_kernel_sq_norms` |
| embedding table              | g_r scattered into row id_r          | `embedding_sq_norms`         |
| bias, offset (beta)          | sum_r g_r                            | `broadcast_sq_norms`         |
| scale (gamma, gain, skip)    | sum_r x_r * g_r                      | `broadcast_sq_norms`         |

One module per layer family, each imported by the tap rules of that family
(`tfdp.training.ghost_taps`, one module per family too):

- `dense`: `kernel_sq_norms` (any `z = a @ W`), `einsum_kernel_sq_norms`;
  taps `dense` (Dense, EinsumDense; `attention`'s projections are EinsumDense).
- `conv`: `conv2d_kernel_sq_norms` (over `conv2d_patches`, or
  `conv2d_example_gradients` on a GPU or TPU), `grouped_conv2d_kernel_sq_norms`,
  `depthwise_kernel_sq_norms`; taps `conv`.
- `weight_standardized`: `ws_kernel_sq_norms`; taps `conv` (WSConv2D, ScaledWSConv2D).
- `broadcast`: `broadcast_sq_norms`; taps `normalization`, `blocks`, `conv` (a
  gain) and `registry` (every bias).
- `embedding`: `embedding_sq_norms`; taps `embedding`.
- `registry`: which layer class has which rule; taps `registry`.

What the families share: `rows` (an example's positions and views, `Rows`),
`forms` (the form choice, the "Rounding" contract and a held vector's
margin, the recompute, and the switches that tests and benchmarks set) and
`gram` (the Gram form and its bound).

The rows r of one example are its positions (conv output pixels, sequence
steps) and, with augmentation multiplicity, its K views: an example's
gradient is the sum over all of them (its loss is the mean over views, whose
1/K is already in `g`), so its norm is the norm of that sum, never a sum of
the views' norms. Every rule therefore takes `num_views` and treats the K
consecutive rows of the flattened `[batch * K, ...]` tensors jointly.

Kernel gradients have two forms, and `choose_form` picks one for the static
shapes and the device's plan (by what each rule really computes and holds):
the DIRECT form builds the per-example gradient `[batch, fan_in, fan_out]`
(cost R * fan_in * fan_out per example, as the plain step's kernel gradient)
and the GRAM form never does, summing `(A A^T) * (G G^T)` over the R x R row
pairs (cost R^2 * (fan_in + fan_out), six passes on a GPU or TPU; Li et al.
2022, eq. (4)). A convolution's direct form comes from its patches on a CPU
and from one grouped convolution on a GPU or TPU (`conv2d_example_gradients`).
There, a kernel whose per-example gradient is larger than what it is built
from (the example's input region and output gradients) is not held but
built twice, chunk by chunk of the batch (one example at a time on the
per-example route, `recompute_trip_count`): once for its norms, once for the
weighted sum, which clips the second build again to the first one's norm
(`forms._recomputed`, `reclip_factors`): one layer's chunk of per-example
gradients in memory at a time, the memory of Bu et al. 2023's book-keeping.

Every rule returns `(squares, weighted_sum)`: float32 `[batch]`, per
example an upper bound on the squared norm of what `weighted_sum` adds for
it (per unit factor), at the matmul precision the device really uses (see
"Rounding" in `forms`), and a function `weighted_sum(factors)` that returns
`sum_i factors[i] * gradient_i` for each parameter, float32, from the same
per-example gradients: those the rule held (direct-form kernels, biases,
scales), or, for Gram-form kernels, from the same centred rows and output
gradients as the norm (the "book-keeping" of Bu et al. 2022, Sec. 3.2,
without a second backward pass). No float64 anywhere: every product and sum
whose rounding the bound covers goes through `tfdp.dp.precision`. A zero
factor drops its example even where its gradient is inf or nan (as
`tfdp.dp.clipping.weighted_sum`).

Pure TensorFlow on tensors: nothing here knows about Keras models. Which
layer has which rule is kept in a registry (`register_layer_rule`,
`find_layer_rule`) that `tfdp.training` fills with the Keras layer classes.

The public names below are re-exported here. The switches that tests and
benchmarks set (`GROUPED_CONV_GRADIENTS`, `PER_EXAMPLE_CONVS`,
`PER_EXAMPLE_MIN_CHANNELS`, `RECOMPUTED_GRADIENTS`, `RECOMPUTE_CHUNKS`,
`RECOMPUTE_CHUNK_EXAMPLES`, and `choose_form` replaced) are set on `forms`,
the module that defines and reads them; setting a re-exported name or a
switch on this package raises, as it would reach none of the code that
reads it.
"""

import sys
import types

from tfdp.dp.ghost_norms.broadcast import broadcast_sq_norms
from tfdp.dp.ghost_norms.conv import (conv2d_example_gradients, conv2d_kernel_sq_norms,
                                      conv2d_patches, depthwise_kernel_sq_norms,
                                      grouped_conv2d_kernel_sq_norms)
from tfdp.dp.ghost_norms.dense import (einsum_kernel_geometry, einsum_kernel_sq_norms,
                                       kernel_sq_norms)
from tfdp.dp.ghost_norms.embedding import embedding_sq_norms
from tfdp.dp.ghost_norms.forms import (DIRECT, GRAM, NORM_DTYPE, choose_form,
                                       grouped_conv_gradients, held_squares, per_example_convs,
                                       reclip_factors, recompute_chunk_count,
                                       recompute_trip_count, recomputed_gradients)
from tfdp.dp.ghost_norms.registry import UnsupportedLayer, find_layer_rule, register_layer_rule
from tfdp.dp.ghost_norms.rows import Rows, example_rows
from tfdp.dp.ghost_norms.weight_standardized import ws_kernel_sq_norms

__all__ = [
    "DIRECT", "GRAM", "NORM_DTYPE", "Rows", "UnsupportedLayer", "broadcast_sq_norms",
    "choose_form", "conv2d_example_gradients", "conv2d_kernel_sq_norms", "conv2d_patches",
    "depthwise_kernel_sq_norms", "einsum_kernel_geometry", "einsum_kernel_sq_norms",
    "embedding_sq_norms", "example_rows", "find_layer_rule", "grouped_conv2d_kernel_sq_norms",
    "grouped_conv_gradients", "held_squares", "kernel_sq_norms", "per_example_convs",
    "reclip_factors", "recompute_chunk_count", "recompute_trip_count", "recomputed_gradients",
    "register_layer_rule", "ws_kernel_sq_norms",
]

# Read by `forms` (and `choose_form` by `dense` and `weight_standardized` through it).
_SWITCHES = ("GROUPED_CONV_GRADIENTS", "PER_EXAMPLE_CONVS", "PER_EXAMPLE_MIN_CHANNELS",
             "RECOMPUTED_GRADIENTS", "RECOMPUTE_CHUNKS", "RECOMPUTE_CHUNK_EXAMPLES")


class _Package(types.ModuleType):
    """This package, refusing to set what the code reads elsewhere (a patch that would not take)."""

    def __setattr__(self, name, value):
        if name in __all__ or name in _SWITCHES:
            raise AttributeError(
                f"tfdp.dp.ghost_norms.{name} is read where it is defined: set it on the module "
                f"that defines it (tfdp.dp.ghost_norms.forms for the switches and choose_form).")
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
