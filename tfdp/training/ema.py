"""Exponential moving average of the parameters with De et al.'s warm-up.

Post-processing of the private iterates: it costs no privacy.
"""

import contextlib

import tensorflow as tf


def ema_decay(step, decay):
    """The EMA decay at update `step` (0 for the first update).

    `min(decay, (1 + t) / (10 + t))` (De et al. 2022, App. C.3, following Tan &
    Le 2019): early averages forget the random initialization quickly.

    Works on Python numbers and on TensorFlow scalars (inside tf.function).

    >>> [round(float(ema_decay(t, 0.9999)), 6) for t in (0, 1, 100, 10**6)]
    [0.1, 0.181818, 0.918182, 0.9999]

    Args:
      step: t >= 0, the index of the optimizer update just applied.
      decay: the asymptotic decay in [0, 1), e.g. 0.9999 (CIFAR) or 0.99999
        (ImageNet) in De et al. 2022.

    Returns:
      The decay for this update, a float32 scalar tensor.
    """
    step = tf.cast(step, tf.float32)
    return tf.minimum(tf.cast(decay, tf.float32), (1.0 + step) / (10.0 + step))


class EMAParameters:
    """Mixin for a trainer `keras.Model` (`DPModel`, `NonPrivateModel`) with `ema_decay`.

    `_build_ema()` (after the optimizer is built) makes one non-trainable copy
    per trainable variable, starting at its value; `_update_ema()` (after each
    `apply_gradients`) moves it with `ema_decay`; `use_ema_parameters()` swaps
    the averages in, e.g. to evaluate or export them. The copies use
    aggregation "none": each replica updates its own, identical copy.
    """

    ema_decay = None
    ema_variables = None

    def _build_ema(self):
        self.ema_variables = None
        if self.ema_decay is None:
            return
        self.ema_variables = [
            self.add_weight(shape=v.shape, initializer="zeros", trainable=False,
                            name=f"ema_{i}", aggregation="none")
            for i, v in enumerate(self.trainable_variables)
        ]
        for e, v in zip(self.ema_variables, self.trainable_variables):
            e.assign(v)
        # Keras keeps lists of variables out of tf.train.Checkpoint's object
        # graph; a tf.Module holding the list puts the EMA into every
        # checkpoint of this model (as `ema_state/variables_list/<i>`).
        self.ema_state = tf.Module(name="ema_state")
        self.ema_state.variables_list = list(self.ema_variables)

    def _update_ema(self):
        if self.ema_variables:
            decay = ema_decay(self.optimizer.iterations - 1, self.ema_decay)
            for e, v in zip(self.ema_variables, self.trainable_variables):
                e.assign(decay * e + (1.0 - decay) * v)

    @contextlib.contextmanager
    def use_ema_parameters(self):
        """Temporarily puts the EMA parameters into the model (no-op without EMA)."""
        if not self.ema_variables:
            yield
            return
        saved = [v.numpy() for v in self.trainable_variables]
        for v, e in zip(self.trainable_variables, self.ema_variables):
            v.assign(e)
        try:
            yield
        finally:
            for v, value in zip(self.trainable_variables, saved):
                v.assign(value)
