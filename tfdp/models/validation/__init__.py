"""Checks that a Keras model is compatible with per-example DP-SGD: one rule a module.

- `batch_statistics`: no layer normalizes with the batch's statistics (a frozen
  BatchNormalization may stay); `validate_dp_model` runs it with `float32`, and
  with a batch-against-single-example comparison when given inputs.
- `float32`: every layer computes in float32 (`validate_float32`).
- `example_mixing`: by behaviour, no example moves another's output or gradient
  (`refuse_example_mixing`), on a probe batch (`probe`).
- `gradients`: user-defined gradients that tfdp cannot vouch for
  (`user_defined_gradients`); ghost clipping avoids them.
- `onednn_matmuls`: no batch matmul that oneDNN computes wrongly in the forward pass.
- `layers`: the walk over nested layers (`iter_layers`), `is_frozen_batch_norm`.
"""

from tfdp.models.validation.batch_statistics import validate_dp_model
from tfdp.models.validation.example_mixing import refuse_example_mixing
from tfdp.models.validation.float32 import validate_float32
from tfdp.models.validation.gradients import user_defined_gradients
from tfdp.models.validation.layers import is_frozen_batch_norm, iter_layers
from tfdp.models.validation.probe import ExampleMixingError, input_example_shape

__all__ = ["ExampleMixingError", "input_example_shape", "is_frozen_batch_norm", "iter_layers",
           "refuse_example_mixing", "user_defined_gradients", "validate_dp_model",
           "validate_float32"]
