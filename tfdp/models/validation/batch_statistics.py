"""Rule: no layer normalizes with statistics of the batch (BatchNorm), unless frozen."""

import keras
import numpy as np

from tfdp.models.validation.float32 import validate_float32
from tfdp.models.validation.layers import is_frozen_batch_norm, iter_layers

FIX_HINT = (
    "DP-SGD clips each example's gradient, so no layer may mix examples across "
    "the batch. Replace it with keras.layers.GroupNormalization (De et al. 2022, "
    "App. C.1: 16 groups) or keras.layers.LayerNormalization, which normalize "
    "each example on its own (Ponomareva et al. 2023, 'How to DP-fy ML', "
    "Sec. 5.5.1)."
)


_FREEZE_HINT = (
    "A pretrained BatchNormalization may stay if it is frozen: set `layer.trainable = "
    "False` on it (or on the model holding it) before building the DPModel; Keras 3 then "
    "normalizes with its moving (public, pretrained) statistics even in training mode."
)


def _mixes_examples(layer):
    """True for layers that compute statistics over the batch axis."""
    if is_frozen_batch_norm(layer):
        return False
    if isinstance(layer, keras.layers.BatchNormalization):
        # Also covers synchronized BatchNorm (BatchNormalization(synchronized=True),
        # Keras 3's SyncBatchNorm) and any subclass.
        return True
    # Batch norms from other libraries (tf_keras, custom SyncBatchNorm classes).
    return any("BatchNorm" in cls.__name__ for cls in type(layer).__mro__)


def validate_dp_model(model, *, check_inputs=None, atol=1e-5):
    """Raises if `model` has a layer that mixes examples across the batch.

    DP-SGD needs each example's gradient to depend on that example only: its
    sensitivity analysis clips per-example gradients (Abadi et al. 2016;
    Ponomareva et al. 2023, Sec. 5.5.1). BatchNorm breaks this (its training
    mode normalizes with batch statistics) and must be replaced by GroupNorm
    (De et al. 2022, App. C.1). tfdp computes per-example gradients with
    `tf.vectorized_map`, calling the model on one example at a time, so such a
    layer would also silently compute different statistics than in a batch.

    Two checks:
      1. Structural, always: every layer, recursively through nested models
         and sub-layers, is rejected if it is a `keras.layers.BatchNormalization`
         (including synchronized BatchNorm) or any class whose name contains
         "BatchNorm", unless it is a FROZEN `keras.layers.BatchNormalization`
         (`trainable=False`, `is_frozen_batch_norm`): Keras 3 runs it in
         inference mode even with `training=True`, so it normalizes with its
         public pretrained statistics and mixes no examples (De et al. 2022,
         Sec. 4, fine-tuning pretrained models). `LayerNormalization`, `GroupNormalization`,
         `UnitNormalization` and `Normalization` (fixed statistics) are per
         example and accepted. A layer that computes in float16 or bfloat16
         (mixed precision) is rejected too (`validate_float32`).
      2. Functional, if `check_inputs` is given: the model in training mode on
         the whole batch must equal the model on each example alone (within
         `atol`). This also catches custom layers that reduce over the batch
         axis and layers that are random in training mode (dropout), which
         tfdp's models avoid (De et al. 2022 remove dropout).

    Note: a `keras.layers.Normalization` layer adapted on the private training
    set leaks its statistics; release them with DP instead
    (`tfdp.dp.data_normalization`, Tramer & Boneh 2021, App. B).

    Args:
      model: a `keras.Model` (or any `keras.layers.Layer`).
      check_inputs: optional batch of at least 2 model inputs, e.g. float32
        images [batch, height, width, channels].
      atol: absolute tolerance of the functional check, after scaling by
        max(1, max |output|).

    Returns:
      None.

    Raises:
      ValueError: naming every offending layer (path and class), with the fix;
        naming every mixed-precision layer (`validate_float32`); or, for the
        functional check, naming the first example whose output
        depends on the rest of the batch.
    """
    offenders = [
        f"{path} ({type(layer).__name__})"
        for path, layer in iter_layers(model)
        if _mixes_examples(layer)
    ]
    if offenders:
        raise ValueError(
            "validate_dp_model: these layers mix examples across the batch: "
            + ", ".join(offenders)
            + ". "
            + FIX_HINT
            + " "
            + _FREEZE_HINT
        )
    validate_float32(model)

    if check_inputs is None:
        return
    inputs = np.asarray(check_inputs)
    if inputs.shape[0] < 2:
        raise ValueError(
            f"validate_dp_model: check_inputs has {inputs.shape[0]} example(s); pass a batch "
            "of at least 2 so that mixing across examples can show."
        )
    batched = np.asarray(model(inputs, training=True))
    single = np.concatenate(
        [np.asarray(model(inputs[i : i + 1], training=True)) for i in range(inputs.shape[0])]
    )
    tolerance = atol * max(1.0, float(np.max(np.abs(batched))))
    for i in range(inputs.shape[0]):
        if not np.allclose(batched[i], single[i], rtol=0.0, atol=tolerance):
            raise ValueError(
                f"validate_dp_model: in training mode, the output of {model.name} for "
                f"example {i} differs between a call on the whole batch and a call on the "
                f"example alone (max |diff| = {np.max(np.abs(batched[i] - single[i])):.3g}). "
                "Some layer mixes examples across the batch or is random in training mode "
                "(e.g. dropout). " + FIX_HINT
            )
