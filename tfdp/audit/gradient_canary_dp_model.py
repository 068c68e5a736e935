"""GradientCanaryDPModel: DP-SGD with Dirac gradient canaries, for a white-box audit."""

import numpy as np
import tensorflow as tf

from tfdp.training.dp_model import DPModel


class GradientCanaryDPModel(DPModel):
    """A `DPModel` whose clipped sum also holds Dirac gradient canaries.

    White-box auditing in one run (Steinke, Nasr & Jagielski 2023, with
    Dirac gradient canaries as in their DP-SGD experiments, Sec. 7): canary
    i owns one coordinate of the parameters. At every step, each INCLUDED
    canary joins the logical batch independently with the run's sampling
    probability q (Poisson, as an example would) and adds a vector of norm
    `canary_norm()` - one clipped example's worth, the mechanism's
    sensitivity C (1 with the normalized update) - at its coordinate to the
    clipped sum, before `add_noise`. The auditor sees the mechanism's output
    (every noisy gradient, as the privacy report states): after the noise,
    the noisy sum at each canary's coordinate is added to `canary_scores`, so
    a canary's score is the sum over steps of its observed coordinate
    (`tfdp.accounting.audit` turns scores into the epsilon lower bound).

    What this audits: the noise actually added (`DPModel.add_noise`, its std
    and generator) against the claimed sensitivity and sampling rate, i.e.
    whether noise_multiplier * sensitivity hides one example's contribution
    as well as the accountant assumes. What it does not: the canaries' norm
    and sampling are this class's (from the mechanism), not the data path's,
    so a bug in per-example clipping or in the data sampler is not seen here
    (input canaries see it, weakly; `tests/dp` and `tests/data` check it).
    A planted "sensitivity 2C treated as C" overrides `canary_norm`. Two
    kinds of coordinates:

    * `canary_coordinates=None` (dedicated): the clipped sum gets `m` extra
      coordinates, one per canary, that no example's gradient touches; they
      go through the same `DPModel.add_noise` call as the model's gradient
      and are dropped before the update. The score of an excluded canary is
      then pure noise, N(0, T s^2) for noise std s, and of an included one
      C * Binomial(T, q) more: the exact law of
      `tfdp.accounting.audit.simulate_gradient_canary_scores`.
    * flat indices into the model's trainable variables (concatenated in
      order, each flattened row-major): the realistic white box, where the
      training data's gradients at those coordinates add to every score.

    The coins that sample the canaries come from the (secret) noise
    generator. One replica only: with R replicas each would add the canaries
    to its share of the sum.

    The coordinates and inclusion coins are the auditor's; they must not be
    reused for a second run (draw them anew, `tfdp.audit.GradientCanaryAudit`).

    Args:
      model: as `DPModel`.
      mechanism: as `DPModel`; Poisson sampling and per-example clipping
        (add-or-remove one example), where one example moves the clipped sum
        by at most the sensitivity.
      included: bool [m], which canaries are in the run.
      canary_coordinates: None (dedicated slots), or int [m] distinct flat
        indices into the model's trainable variables.
      **kwargs: as `DPModel` (accumulation_steps, noise_seed, ema_decay).

    Raises:
      ValueError: on shuffled sampling or microbatches, more than one
        replica, an empty or non-boolean `included`, or coordinates that
        repeat, are out of range or do not match `included` in length.

    Reference:
      Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1)
      Training Run", Algorithm 1 and Sec. 7.
    """

    def __init__(self, model, mechanism, *, included, canary_coordinates=None, **kwargs):
        super().__init__(model, mechanism, **kwargs)
        if mechanism.sampling != "poisson" or mechanism.num_microbatches:
            raise ValueError(
                "Gradient canaries audit Poisson sampling with per-example clipping "
                f"(add-or-remove one example); this mechanism has sampling="
                f"{mechanism.sampling!r}, num_microbatches={mechanism.num_microbatches}. "
                "Audit with sampling='poisson' and num_microbatches=None.")
        if self.distribute_strategy.num_replicas_in_sync != 1:
            raise ValueError(
                "Gradient canaries need one replica (each replica would add them to its "
                "share of the sum); run the audit with strategy='default'.")
        included = np.asarray(included)
        if included.ndim != 1 or included.size == 0 or included.dtype != bool:
            raise ValueError(f"included must be a non-empty bool vector, one coin per canary; "
                             f"got dtype {included.dtype} and shape {included.shape}.")
        self.num_canaries = int(included.size)
        self.canary_included = tf.constant(included, tf.float32)
        self._coordinates = None
        if canary_coordinates is not None:
            self._coordinates = _checked_coordinates(
                canary_coordinates, self.num_canaries,
                sum(int(np.prod(v.shape)) for v in model.trainable_variables))
        self.canary_scores = self.add_weight(
            shape=(self.num_canaries,), initializer="zeros", trainable=False,
            name="canary_scores")

    def canary_norm(self):
        """A canary's contribution to the clipped sum: one example's, the sensitivity."""
        return self.mechanism.sensitivity()

    def add_noise(self, summed):
        """Adds the sampled canaries, then the noise; records the canary coordinates."""
        sampled = tf.cast(
            self.noise_generator.uniform([self.num_canaries]) < self.mechanism.sampling_prob,
            tf.float32)
        contributions = self.canary_norm() * self.canary_included * sampled
        if self._coordinates is None:
            # Dedicated coordinates: one more tensor through the same noise.
            *noisy, observed = super().add_noise([*summed, contributions])
        else:
            noisy = super().add_noise(self._scatter_add(summed, contributions))
            observed = self._gather(noisy)
        self.canary_scores.assign_add(observed)
        return noisy

    def _layout(self):
        """Per variable of `summed`: (position, canary ids, flat offsets) of its canaries."""
        positions = {id(v): i for i, v in enumerate(self.trainable_variables)}
        layout, start = [], 0
        for v in self.model.trainable_variables:
            size = int(np.prod(v.shape))
            ids = np.flatnonzero((self._coordinates >= start) & (self._coordinates < start + size))
            if ids.size:
                layout.append((positions[id(v)], ids, self._coordinates[ids] - start))
            start += size
        return layout

    def _scatter_add(self, summed, contributions):
        summed = list(summed)
        for position, ids, offsets in self._layout():
            g = summed[position]
            flat = tf.tensor_scatter_nd_add(
                tf.reshape(g, [-1]), offsets[:, None], tf.gather(contributions, ids))
            summed[position] = tf.reshape(flat, tf.shape(g))
        return summed

    def _gather(self, noisy):
        observed = tf.zeros([self.num_canaries])
        for position, ids, offsets in self._layout():
            values = tf.gather(tf.reshape(noisy[position], [-1]), offsets)
            observed = tf.tensor_scatter_nd_update(observed, ids[:, None], values)
        return observed


def _checked_coordinates(coordinates, num_canaries, num_parameters):
    coordinates = np.asarray(coordinates)
    if coordinates.shape != (num_canaries,) or not np.issubdtype(coordinates.dtype, np.integer):
        raise ValueError(f"canary_coordinates must be {num_canaries} integers, one per canary; "
                         f"got dtype {coordinates.dtype} and shape {coordinates.shape}.")
    if len(np.unique(coordinates)) != num_canaries:
        raise ValueError("canary_coordinates repeat: two canaries on one coordinate would "
                         "collide. Draw them without replacement.")
    if coordinates.min() < 0 or coordinates.max() >= num_parameters:
        raise ValueError(f"canary_coordinates must be in [0, {num_parameters}), the model's "
                         f"trainable parameters; got [{coordinates.min()}, {coordinates.max()}].")
    return coordinates.astype(np.int64)
