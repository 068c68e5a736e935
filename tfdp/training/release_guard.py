"""The release guard: what DPModel's train function checks around every call.

Before a call: a model stopped for a non-finite release trains no further;
settings that would rewrite the step's float32 arithmetic are refused; a
device plan that changed since the trace traces the step again. After a
call: a withheld (non-finite) update stops training before Keras' callbacks
read the model. Design: docs/design/dp_step.md, "The step", and
docs/design/ghost_norms_and_precision.md.
"""

import tensorflow as tf
from absl import logging

from tfdp import models
from tfdp.dp import noise
from tfdp.dp import device_arithmetic
from tfdp.training import chunked


def guarded(dp_model, traced):
    """`traced` (a DPModel's train function) wrapped in the checks of the module doc.

    The ghost rules plan their arithmetic for the device at trace time
    (`tfdp.dp.device_arithmetic.step_plan`: matmul inputs, TF32 execution, oneDNN's
    fpmath mode) and the clip margin with it. A change after tracing
    (`tf.config.experimental.enable_tensor_float_32_execution(True)` on a
    GPU) would leave a float32 plan running on a rounding device, so the
    next call traces the step anew; a setting that would rewrite the step's
    precision (`device_arithmetic.refuse_precision_rewrites`) is refused before the
    step runs. A step the user traces in a `tf.function` of their own
    (`clip_and_accumulate`, `train_step`) gets the refusal at trace time
    only: trace it again after such a change.

    Args:
      dp_model: the `tfdp.training.DPModel` whose train function `traced` is.
      traced: the train function Keras (or `ChunkedTraining`) made.

    Returns:
      The train function to install: same arguments and logs as `traced`.

    Raises (from the returned function):
      tfdp.dp.noise.NonFiniteRelease: once a step's noisy update was not
        finite (`refuse_withheld`), and on every later call.
      tfdp.dp.device_arithmetic.PrecisionRewrite: a setting that rewrites the step's
        precision.
      ValueError: a layer's dtype policy changed to mixed precision
        (`tfdp.models.validate_float32`).
    """
    dp_model._release_check = None  # the variables as they are now (trainability may change)

    def train_function(*args, **kwargs):
        if dp_model._stopped:  # a non-finite state was seen: this model trains no further
            raise noise.NonFiniteRelease(dp_model._stopped)
        device_arithmetic.refuse_precision_rewrites()
        models.validate_float32(dp_model)  # a layer's dtype policy changed since compile
        now = device_arithmetic.step_plan()
        if dp_model._traced_plan is not None and now != dp_model._traced_plan:
            logging.warning("The DP step was traced for %s and would now run on %s: "
                            "tracing it again for this device.", dp_model._traced_plan, now)
            dp_model._traced_plan = None
            dp_model.train_function = None
            return dp_model.make_train_function()(*args, **kwargs)
        logs = traced(*args, **kwargs)
        refuse_withheld(dp_model)
        return logs

    return train_function


def refuse_withheld(dp_model):
    """Raises `noise.NonFiniteRelease` once `dp_model`'s state is not finite.

    Checked after every call of the train function, before Keras' callbacks
    (checkpoints, evaluation, logs) read the model, by TensorFlow's own
    kernels outside XLA (`noise.count_non_finite` on the bits): a
    compiler that drops IEEE semantics inside the step can fold the
    step's own test (`noise.finite_release`), not this one. The model's
    float state (trainable variables, their EMA, the optimizer's slots)
    is then set to zero, so that no non-finite state is saved or
    exported from this process. Covers every call of the train function
    (`fit`, `train_on_batch`, the CLI's chunked steps); a step the user
    runs in a function of their own (`train_step`) has the refusals only.

    Args:
      dp_model: a `tfdp.training.DPModel` after a call of its train function.

    Raises:
      tfdp.dp.noise.NonFiniteRelease: a step withheld its update, or a
        trainable variable or its EMA holds an inf or NaN.
    """
    if dp_model._release_check is None:
        variables = list(dp_model.trainable_variables) + list(dp_model.ema_variables or [])
        withheld = dp_model._withheld.value
        dp_model._release_check = chunked._Untracked(tf.function(
            lambda: tf.cast(withheld, tf.float32) + noise.count_non_finite(variables),
            jit_compile=False))
    if float(dp_model._release_check.value()) == 0.0:
        return
    dp_model._withheld.value.assign(1)  # every later step withholds its update too
    state = (list(dp_model.trainable_variables) + list(dp_model.ema_variables or [])
             + list(dp_model.optimizer.variables))
    for variable in state:
        if variable.dtype in ("float32", tf.float32, "float64", tf.float64):
            variable.assign(tf.zeros_like(variable))
    dp_model._stopped = (
        "A DP step computed a noisy update with an inf or NaN entry. It is not released: "
        "this model trains no further, and its float state is set to zero so "
        "that nothing non-finite is saved (a non-finite release would show that some "
        "example's contribution escaped its clip). Every example's contribution is "
        "finite by construction unless the compiler dropped IEEE float semantics: look "
        "for fast-math flags in XLA_FLAGS and TF_XLA_FLAGS (in the environment the "
        "process started with too), then resume from the last checkpoint in a new "
        "process.")
    raise noise.NonFiniteRelease(dp_model._stopped)
