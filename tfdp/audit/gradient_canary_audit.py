"""GradientCanaryAudit: the `train_and_evaluate(audit=...)` hook for gradient canaries."""

import secrets

import numpy as np

from tfdp.accounting import audit as audit_lib
from tfdp.audit.gradient_canary_dp_model import GradientCanaryDPModel

COORDINATES = ("dedicated", "model")


class GradientCanaryAudit:
    """White-box audit of a run with Dirac gradient canaries (`GradientCanaryDPModel`).

    `tfdp.train_and_evaluate(workdir, audit=GradientCanaryAudit(...))` trains
    as usual, with `num_canaries` canaries in the clipped sum; the privacy
    report then has an "audit" section with the epsilon lower bound at
    confidence 1 - beta (`tfdp.accounting.audit`). The canary coins are drawn
    from `seed` (None: OS entropy); they are the auditor's, not the run's
    secret seeds.

    Args:
      num_canaries: m >= 2. Keep 2 m delta well below 1: the bound's delta
        term grows with m (Steinke et al. 2023, Corollary 5.4).
      coordinates: "dedicated" (extra coordinates no example touches: audits
        the noise against the claimed sensitivity and sampling) or "model"
        (distinct random coordinates of the model's parameters, where the
        training data's gradients add to the scores).
      beta: 1 - confidence, in (0, 1).
      guesses: candidate (k+, k-) pairs, or None for
        `tfdp.accounting.audit.symmetric_guesses(m)`.
      seed: None or an int, for the canary coins.
      command: the command line, recorded in the report.

    Raises:
      ValueError: on num_canaries < 2 or unknown coordinates.
    """

    def __init__(self, num_canaries, *, coordinates="dedicated", beta=0.05, guesses=None,
                 seed=None, command=None):
        if int(num_canaries) < 2:
            raise ValueError(f"num_canaries must be >= 2, got {num_canaries}.")
        if coordinates not in COORDINATES:
            raise ValueError(f"Unknown coordinates {coordinates!r}; use one of {COORDINATES}.")
        self.num_canaries = int(num_canaries)
        self.coordinates = coordinates
        self.beta = beta
        self.guesses = guesses
        self.command = command
        self._rng = np.random.default_rng(secrets.randbits(64) if seed is None else seed)
        self.included = audit_lib.draw_inclusion(self.num_canaries, self._rng)

    def prepare_train(self, train):
        """Gradient canaries leave the training split unchanged."""
        return train

    def build_dp_model(self, model, mechanism, **kwargs):
        """A `GradientCanaryDPModel` in place of the `DPModel`.

        Raises:
          ValueError: with coordinates="model", if the model has fewer
            parameters than canaries.
        """
        canary_coordinates = None
        if self.coordinates == "model":
            num_parameters = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
            if num_parameters < self.num_canaries:
                raise ValueError(f"{self.num_canaries} canaries do not fit in the model's "
                                 f"{num_parameters} parameters; use fewer, or 'dedicated'.")
            canary_coordinates = self._rng.choice(num_parameters, self.num_canaries,
                                                  replace=False)
        return GradientCanaryDPModel(model, mechanism, included=self.included,
                                     canary_coordinates=canary_coordinates, **kwargs)

    def result(self, dp_model, mechanism):
        """The report's "audit" section, from the trained `GradientCanaryDPModel`."""
        epsilon, delta = mechanism.guarantee(int(dp_model.optimizer.iterations.numpy()))
        result = audit_lib.audit(dp_model.canary_scores.numpy(), self.included, delta=delta,
                                 beta=self.beta, guesses=self.guesses)
        return audit_lib.report_section(
            result, canaries=f"gradient: Dirac canaries on {self.coordinates} coordinates, "
                             f"each of norm {dp_model.canary_norm():g} (the sensitivity), "
                             "Poisson-sampled with the run's q",
            score="sum over the steps of the noisy clipped sum at the canary's coordinate",
            num_included=int(self.included.sum()), claimed_epsilon=epsilon,
            command=self.command)
