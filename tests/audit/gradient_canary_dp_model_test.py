"""GradientCanaryDPModel through DPModel's real step, on a tiny model.

The canaries' plumbing (coordinates, Poisson sampling, norm) is checked with
almost no noise; the audit itself with a claimed epsilon of 3 and the two
planted bugs, each in its own code path: the noise std halved (a mechanism
whose noise_stddev() is half), and sensitivity 2C treated as C (canaries of
norm 2C against noise scaled to C).
"""

import dataclasses
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from tfdp import accounting
from tfdp.accounting import audit
from tfdp.audit import GradientCanaryDPModel

C = 0.5
BATCH = 8


@dataclasses.dataclass(frozen=True)
class _HalfNoiseMechanism(accounting.DPMechanism):
    """Planted bug: the noise added is half what the accountant assumed."""

    def noise_stddev(self):
        return 0.5 * super().noise_stddev()


class _DoubleSensitivity(GradientCanaryDPModel):
    """Planted bug: one example moves the sum by 2C while the noise is scaled to C."""

    def canary_norm(self):
        return 2.0 * super().canary_norm()


def _mechanism(*, sampling_prob=1.0, num_steps, noise_multiplier=None, target_epsilon=None):
    num_examples = round(BATCH / sampling_prob)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # delta >= 1/N for these tiny N
        return accounting.plan_mechanism(
            num_examples=num_examples, batch_size=BATCH, num_steps=num_steps, l2_clip_norm=C,
            target_delta=1e-5, noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
            accountant="pld")


def _train(mechanism, included, *, cls=GradientCanaryDPModel, coordinates=None, lr=0.0):
    """Runs `mechanism.num_steps` steps on one batch whose examples are all masked out.

    The clipped sum of the data is then exactly zero: what the canary coordinates hold
    is the canaries plus the noise. Returns the model and its weights before training.
    """
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(5)(inputs)))
    before = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
    dp = cls(model, mechanism, included=included, canary_coordinates=coordinates, noise_seed=1)
    dp.compile(optimizer=keras.optimizers.SGD(learning_rate=lr), jit_compile=False)
    x = np.random.default_rng(0).normal(size=(BATCH, 4)).astype(np.float32)
    batch = (x, np.zeros(BATCH, np.int32), np.zeros(BATCH, np.float32))
    dp.fit(tf.data.Dataset.from_tensors(batch).repeat(), epochs=1,
           steps_per_epoch=mechanism.num_steps, verbose=0)
    return dp, before


@pytest.mark.parametrize("coordinates", [
    None, pytest.param(np.array([0, 19, 20, 42, 37]), marks=pytest.mark.slow),
], ids=["dedicated", "model"])
def test_included_canaries_add_one_clipped_example_at_their_coordinate_each_step(coordinates):
    # q = 1 and almost no noise: an included canary scores C per step, T = 3 -> 1.5;
    # an excluded one 0. With SGD at lr 1, the model's parameter at a canary's coordinate
    # moves by -score / B and no other parameter moves.
    included = np.array([True, False, True, True, False])
    dp, before = _train(_mechanism(num_steps=3, noise_multiplier=1e-7), included,
                        coordinates=coordinates, lr=1.0)
    np.testing.assert_allclose(dp.canary_scores.numpy(), 3 * C * included, atol=1e-5)
    after = np.concatenate([v.numpy().ravel() for v in dp.model.trainable_variables])
    expected = before.copy()
    if coordinates is not None:
        expected[coordinates] -= 3 * C * included / BATCH
    np.testing.assert_allclose(after, expected, atol=1e-5)


@pytest.mark.slow
def test_canaries_join_each_step_independently_with_probability_q():
    # q = 1/2, T = 8: an included canary's score / C is Binomial(8, 1/2).
    included = np.ones(4000, bool)
    dp, _ = _train(_mechanism(sampling_prob=0.5, num_steps=8, noise_multiplier=1e-7), included)
    counts = np.round(dp.canary_scores.numpy() / C)
    assert np.mean(counts) == pytest.approx(4.0, abs=0.1)
    assert np.var(counts) == pytest.approx(2.0, rel=0.1)


@pytest.mark.slow
def test_the_audit_catches_each_planted_bug_through_the_real_step():
    # Claimed epsilon 3 (PLD, 4 full-batch steps); 20000 canaries on dedicated coordinates,
    # 3% of them guessed (as in tests/accounting/audit_test.py). With one noise seed, the two
    # bugs give scores in proportion, hence the same bound.
    mechanism = _mechanism(num_steps=4, target_epsilon=3.0)
    claimed = mechanism.epsilon()
    included = audit.draw_inclusion(20000, np.random.default_rng(0))
    guesses = audit.symmetric_guesses(20000, (0.03,))

    def bound(dp):
        return audit.audit(dp.canary_scores.numpy(), included, delta=mechanism.delta,
                           beta=0.05, guesses=guesses).epsilon_lower_bound

    correct, _ = _train(mechanism, included)
    # The excluded canaries' scores are the noise alone: N(0, T (sigma C)^2), T = 4.
    std = 2 * mechanism.noise_stddev()
    out = correct.canary_scores.numpy()[~included]
    assert stats.kstest(out, "norm", args=(0, std)).pvalue > 1e-3
    for wrong in (std * 2 / 3, std * 3 / 2):
        assert stats.kstest(out, "norm", args=(0, wrong)).pvalue < 1e-6
    half_noise = _HalfNoiseMechanism(**dataclasses.asdict(mechanism) | {"fixed_seeds": ()})
    assert half_noise.epsilon() == claimed  # the accountant still claims 3
    bounds = {"correct": bound(correct),
              "noise std halved": bound(_train(half_noise, included)[0]),
              "sensitivity 2C as C": bound(_train(mechanism, included, cls=_DoubleSensitivity)[0])}
    print(f"claimed {claimed:.3f}: {bounds}")
    assert bounds["correct"] < claimed
    assert bounds["noise std halved"] > claimed
    assert bounds["sensitivity 2C as C"] > claimed


@pytest.mark.parametrize("kwargs, message", [
    (dict(included=np.array([1, 0])), "bool vector"),
    (dict(included=np.array([], bool)), "bool vector"),
    (dict(included=np.ones(2, bool), canary_coordinates=np.array([3, 3])), "repeat"),
    (dict(included=np.ones(2, bool), canary_coordinates=np.array([0, 43])), r"\[0, 43\)"),
    (dict(included=np.ones(2, bool), canary_coordinates=np.array([0])), "2 integers"),
])
def test_bad_canaries_raise_clear_errors(kwargs, message):
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(5)(inputs)))
    with pytest.raises(ValueError, match=message):
        GradientCanaryDPModel(model, _mechanism(num_steps=1, noise_multiplier=1.0), **kwargs)


def test_microbatches_are_refused():
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    mechanism = dataclasses.replace(_mechanism(num_steps=1, noise_multiplier=1.0),
                                    num_microbatches=2)
    with pytest.raises(ValueError, match="num_microbatches=None"):
        GradientCanaryDPModel(model, mechanism, included=np.ones(3, bool))
