"""Optimizers for the privatized gradient, selectable from gin.

Every optimizer here only ever sees the noisy, clipped gradient that
`DPModel` hands to `apply_gradients`, so any choice is post-processing and
costs no privacy (Abadi et al. 2016; De et al. 2022, App. C.3).
"""

import math
import numbers

import gin
import keras

from tfdp import gin_bindings

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")

# The arguments of `build_optimizer` that each optimizer reads. A bound argument that the
# chosen optimizer does not read (`beta_1` for "momentum", `momentum` for "sgd", a
# `weight_decay` for "adam") is refused before the run starts (`tfdp.main`).
READS = {
    "sgd": ("learning_rate", "weight_decay"),
    "momentum": ("learning_rate", "momentum", "weight_decay"),
    "adam": ("learning_rate", "beta_1", "beta_2", "epsilon"),
    "adamw": ("learning_rate", "weight_decay", "beta_1", "beta_2", "epsilon"),
}


@gin.configurable(module="tfdp.training")
def build_optimizer(name="sgd", *, learning_rate=gin.REQUIRED, momentum=0.9,
                    weight_decay=0.0, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """Builds a Keras optimizer with a constant learning rate.

    Args:
      name: "sgd" (DP-SGD: no momentum, constant learning rate, as in De et al.
        2022, App. C.3 and TAN), "momentum" (SGD with `momentum`, as in Tramer
        & Boneh 2021, App. C.5), "adam" or "adamw" (with `weight_decay`).
      learning_rate: the constant step size (per optimizer update).
      momentum: for "momentum" only ("sgd" has none).
      weight_decay: lambda >= 0. For "sgd" and "momentum", L2 regularization
        added to the (noisy, clipped) gradient before momentum, g + lambda w,
        as in De et al. 2022's code (jax_privacy; Sec. 4.1 and App. C: 5e-5
        for ImageNet-32 pretraining). For "adamw", AdamW's decoupled decay.
        "adam" refuses a non-zero value (use "adamw").
      beta_1, beta_2, epsilon: Adam's moment decays and its numerical epsilon
        (not the privacy epsilon).

    Returns:
      A `keras.optimizers.Optimizer`.

    Raises:
      ValueError: for an unknown name (the message lists OPTIMIZERS), a
        learning_rate that is not a positive, finite number, a negative weight_decay, or a weight_decay that `name` would not apply.
        (`READS` lists the arguments each name reads; from gin, a bound
        argument that `name` does not read is refused before the run,
        `tfdp.main`.)
    """
    if (isinstance(learning_rate, bool) or not isinstance(learning_rate, numbers.Real)
            or not 0 < learning_rate < math.inf):
        raise ValueError(
            f"learning_rate must be a positive, finite number, got {learning_rate!r}.")
    # Keras refuses an int, which `--gin_param=LEARNING_RATE=1` binds.
    learning_rate = float(learning_rate)
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}.")
    if name in ("sgd", "momentum"):
        return SGDWithL2(learning_rate=learning_rate, l2=weight_decay,
                         momentum=momentum if name == "momentum" else 0.0)
    if name == "adam":
        if weight_decay:
            raise ValueError(
                f"weight_decay={weight_decay} with optimizer 'adam', which has none; use "
                "'adamw' for decoupled weight decay, or set weight_decay to 0.")
        return keras.optimizers.Adam(learning_rate, beta_1=beta_1, beta_2=beta_2,
                                     epsilon=epsilon)
    if name == "adamw":
        return keras.optimizers.AdamW(learning_rate, weight_decay=weight_decay,
                                      beta_1=beta_1, beta_2=beta_2, epsilon=epsilon)
    raise ValueError(f"Unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}.")


gin_bindings.declare_branches("tfdp.training.build_optimizer",
                              setting=("tfdp.training.build_optimizer", "name"),
                              what="optimizer", reads=READS)


@keras.saving.register_keras_serializable(package="tfdp")
class SGDWithL2(keras.optimizers.SGD):
    """SGD (with momentum) on g + l2 * w: L2 regularization coupled to the gradient.

    Keras' own `weight_decay` is decoupled (w -= lr * wd * w after the
    momentum step); with momentum the two differ. De et al. 2022's code adds
    the decay to the gradient before momentum; this does the same. With
    l2 = 0 it is `keras.optimizers.SGD` exactly. Post-processing of the
    privatized gradient: no privacy cost.
    """

    def __init__(self, *, l2=0.0, **kwargs):
        super().__init__(**kwargs)
        self.l2 = float(l2)

    def update_step(self, gradient, variable, learning_rate):
        if self.l2:
            gradient = keras.ops.add(
                keras.ops.cast(gradient, variable.dtype),
                keras.ops.multiply(keras.ops.cast(self.l2, variable.dtype), variable))
        super().update_step(gradient, variable, learning_rate)

    def get_config(self):
        return {**super().get_config(), "l2": self.l2}


def refuse_step_miscounting(optimizer, *, where):
    """Refuses an optimizer whose `iterations` would not count every update.

    tfdp counts DP releases with `optimizer.iterations`: the checkpoint's
    steps, where a resumed sampler restarts, and the steps epsilon is
    computed for. Keras' `gradient_accumulation_steps` = k makes
    `iterations` count one per k calls of `apply_gradients`, while every
    call is one noisy release of a Poisson batch, so epsilon would be
    understated, the run would train past its plan, and a resume would
    sample steps it already used. `accumulation_steps` (tfdp's own) cuts a
    logical batch into chunks instead, with one update per batch.

    Args:
      optimizer: a `keras.optimizers.Optimizer`.
      where: the function named in the message.

    Raises:
      ValueError: if the optimizer has `gradient_accumulation_steps` set.
    """
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if steps:
        raise ValueError(
            f"{where}: the optimizer has gradient_accumulation_steps={steps}, with which Keras "
            "counts one optimizer iteration per that many updates; tfdp counts privacy "
            "releases with optimizer.iterations, so epsilon would be understated. Leave it "
            "unset; to bound memory, set accumulation_steps (tfdp.OptimizationConfig), which "
            "cuts each logical batch into chunks and makes one noisy update per batch.")
