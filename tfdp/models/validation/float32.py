"""Rule: every layer computes in float32 (no mixed precision)."""

from tfdp.models.validation.layers import iter_layers


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
