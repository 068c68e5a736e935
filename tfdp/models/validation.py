"""Checks that a Keras model is compatible with per-example DP-SGD."""

import keras
import numpy as np

_FIX_HINT = (
    "DP-SGD clips each example's gradient, so no layer may mix examples across "
    "the batch. Replace it with keras.layers.GroupNormalization (De et al. 2022, "
    "App. C.1: 16 groups) or keras.layers.LayerNormalization, which normalize "
    "each example on its own (Ponomareva et al. 2023, 'How to DP-fy ML', "
    "Sec. 5.5.1)."
)


def _direct_children(layer):
    """Returns the layers directly nested in `layer`, in a stable order."""
    children = list(layer.layers) if isinstance(layer, keras.Model) else []
    for value in vars(layer).values():
        if isinstance(value, keras.layers.Layer):
            children.append(value)
        elif isinstance(value, (list, tuple)):
            children.extend(v for v in value if isinstance(v, keras.layers.Layer))
        elif isinstance(value, dict):
            children.extend(v for v in value.values() if isinstance(v, keras.layers.Layer))
    return children


def iter_layers(layer):
    """Yields (path, layer) for `layer` and every layer nested in it, each once.

    Nested layers are found through `keras.Model.layers` and through the
    attributes of any layer (sub-layers kept in attributes, lists, tuples or
    dicts), so functional, sequential and subclassed models are all covered.
    The walk is depth first; a layer reachable twice is yielded once.

    Args:
      layer: a `keras.layers.Layer` (a `keras.Model` is one).

    Yields:
      (path, layer) pairs, path being the "/"-joined layer names from `layer`
      down, starting with (layer.name, layer).
    """
    seen = set()
    stack = [(layer.name, layer)]
    while stack:
        path, current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield path, current
        children = _direct_children(current)
        stack.extend((f"{path}/{child.name}", child) for child in reversed(children))


_FREEZE_HINT = (
    "A pretrained BatchNormalization may stay if it is frozen: set `layer.trainable = "
    "False` on it (or on the model holding it) before building the DPModel; Keras 3 then "
    "normalizes with its moving (public, pretrained) statistics even in training mode."
)


def is_frozen_batch_norm(layer):
    """True for a `keras.layers.BatchNormalization` that runs in inference mode in every call.

    Such a layer normalizes each example with its moving mean and variance,
    which are fixed (public, pretrained) statistics, so it mixes no examples
    and its statistics never change. Keras 3 runs a BatchNormalization with
    `trainable=False` in inference mode even when called with
    `training=True`: its `call` takes the batch moments only under
    `if training and self.trainable:` (keras/src/layers/normalization/
    batch_normalization.py, `BatchNormalization.call`, and the class doc's
    "About setting `layer.trainable = False`"). Only the exact class is
    trusted (synchronized or not: synchronization only changes the batch
    moments, which a frozen layer never computes); a subclass may override
    `call`.

    Args:
      layer: any `keras.layers.Layer`.

    Returns:
      bool.
    """
    return type(layer) is keras.layers.BatchNormalization and not layer.trainable


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


def validate_float32(layer):
    """Raises if `layer`, or any layer nested in it, computes in float16 or bfloat16.

    tfdp does not support mixed precision. Its per-example norms and clip
    factors are float32: in float16 a norm is accurate to only about 1e-3, so
    a clipped contribution could exceed C (and on the ghost path the float16
    activations do not even meet the float32 factors). Under "mixed_float16"
    Keras' `compile` also wraps the optimizer in a `LossScaleOptimizer`,
    which would divide the noisy clipped sum by its loss scale.

    Args:
      layer: a `keras.layers.Layer` (a `keras.Model`, or a `DPModel` itself,
        whose own dtype policy decides the loss scaling).

    Raises:
      ValueError: naming every such layer (path and dtype policy), with the fix.
    """
    offenders = [
        f"{path} ({current.dtype_policy.name})"
        for path, current in iter_layers(layer)
        if getattr(current, "compute_dtype", "float32") in ("float16", "bfloat16")
    ]
    if offenders:
        raise ValueError(
            "tfdp does not support mixed precision; these layers compute in float16 or "
            "bfloat16: " + ", ".join(offenders) + ". Per-example norms and clipping must "
            "be float32 (a float16 norm can come out too small, so an example could "
            "contribute more than l2_clip_norm, and Keras' loss scaling would rescale the "
            "update). Call keras.config.set_dtype_policy('float32') before building the "
            "model and the DPModel."
        )


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
            + _FIX_HINT
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
                "(e.g. dropout). " + _FIX_HINT
            )
