"""DPMechanism: one object for the run's privacy facts; planning, events, records."""

import dataclasses
import math

import dp_accounting
import pytest

from tfdp import accounting
from tfdp.accounting import mechanism as mechanism_lib

COMMON = dict(num_examples=60000, batch_size=2048, l2_clip_norm=0.1, target_delta=1e-5)


def _mechanism(**overrides):
    fields = dict(num_examples=60000, batch_size=600, num_steps=100, noise_multiplier=1.0,
                  l2_clip_norm=0.5, delta=1e-5)
    return accounting.DPMechanism(**{**fields, **overrides})


# -- Planning (formerly training/privacy.py) ------------------------------------------


def test_noise_is_calibrated_to_the_target():
    mech = accounting.plan_mechanism(num_steps=1172, target_epsilon=3.0, **COMMON)
    assert mech.noise_calibrated and not mech.steps_capped
    assert mech.sampling_prob == pytest.approx(2048 / 60000)
    assert mech.epsilon() == pytest.approx(3.0, rel=2e-3)
    assert mech.epsilon() <= 3.0
    # The same sigma as the accountant's own calibration of the Poisson event.
    assert mech.noise_multiplier == pytest.approx(accounting.calibrate_noise_multiplier(
        target_epsilon=3.0, sampling_prob=2048 / 60000, num_steps=1172, delta=1e-5), rel=1e-3)


# One search runs in the default suite (the shuffle case), the others under -m slow.
@pytest.mark.parametrize("change", [
    pytest.param(dict(delta=1e-6), marks=pytest.mark.slow),
    pytest.param(dict(num_steps=101), marks=pytest.mark.slow),
    pytest.param(dict(batch_size=601), marks=pytest.mark.slow),
    pytest.param(dict(accountant="pld"), marks=pytest.mark.slow),
    dict(sampling="shuffle"),
    pytest.param({}, marks=pytest.mark.slow),
])
def test_a_calibration_is_searched_once_per_mechanism_and_target(monkeypatch, change):
    # The cache of `calibrated` must give a repeated plan the searched value, and search
    # again for any other field or target: a stale sigma would be a wrong guarantee.
    monkeypatch.setattr(mechanism_lib, "_CALIBRATED", {})
    searched = []
    solve = accounting.calibration.solve_noise_multiplier
    monkeypatch.setattr(accounting.calibration, "solve_noise_multiplier",
                        lambda *args, **kwargs: searched.append(1) or solve(*args, **kwargs))
    first = _mechanism().calibrated(3.0)
    assert _mechanism().calibrated(3.0) == first and len(searched) == 1
    other = _mechanism(**change).calibrated(3.0 if change else 2.0)
    assert len(searched) == 2
    assert other.epsilon() <= (3.0 if change else 2.0)
    assert other.noise_multiplier != first.noise_multiplier
    # What the cache returns is what a fresh search finds.
    monkeypatch.setattr(mechanism_lib, "_CALIBRATED", {})
    assert _mechanism(**change).calibrated(3.0 if change else 2.0) == other


def test_an_epsilon_is_computed_once_per_event_accountant_and_delta(monkeypatch):
    monkeypatch.setattr(accounting.accountant, "_EPSILONS", {})
    event = _mechanism().dp_event()
    computed = []
    factory = accounting.accountant._accountant_factory
    monkeypatch.setattr(accounting.accountant, "_accountant_factory",
                        lambda name: computed.append(name) or factory(name))
    epsilon = accounting.epsilon_of_event(event, delta=1e-5)
    assert accounting.epsilon_of_event(event, delta=1e-5) == epsilon and len(computed) == 1
    assert accounting.epsilon_of_event(event, delta=1e-6) > epsilon and len(computed) == 2
    assert accounting.epsilon_of_event(_mechanism(noise_multiplier=1.01).dp_event(),
                                       delta=1e-5) < epsilon and len(computed) == 3
    assert accounting.epsilon_of_event(event, delta=1e-5, accountant="pld") != epsilon
    assert len(computed) == 4


def test_an_event_printed_alike_but_not_equal_gets_its_own_epsilon(monkeypatch):
    # A 0-d array prints to 8 digits (fewer under the user's print options): keyed by
    # repr, sigma = 0.84 and 0.8 shared an entry at precision=1 (3.24 reported for 3.70).
    import numpy as np  # pylint: disable=g-import-not-at-top

    monkeypatch.setattr(accounting.accountant, "_EPSILONS", {})

    def event(sigma):
        return dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            0.01, dp_accounting.GaussianDpEvent(sigma)), 1000)

    with np.printoptions(precision=1):
        assert repr(event(np.array(0.84))) == repr(event(np.array(0.8)))
        wide = accounting.epsilon_of_event(event(np.array(0.84)), delta=1e-5)
        narrow = accounting.epsilon_of_event(event(np.array(0.8)), delta=1e-5)
    assert narrow > wide + 0.3
    assert narrow == accounting.epsilon_of_event(event(0.8), delta=1e-5)
    # Plain numbers, NumPy scalars among them, are remembered exactly: 1 + 4e-10 is not 1.
    assert accounting.accountant._exact_key(event(np.float64(1.0))) == \
        accounting.accountant._exact_key(event(1.0))
    assert accounting.accountant._exact_key(event(1.0000000004)) != \
        accounting.accountant._exact_key(event(1.0))
    assert accounting.accountant._exact_key(event(np.array(0.8))) is None  # not cached


def test_steps_are_capped_so_training_never_passes_the_target():
    mech = accounting.plan_mechanism(num_steps=5000, noise_multiplier=1.0, target_epsilon=3.0,
                                     **COMMON)
    assert mech.steps_capped and mech.num_steps < 5000
    assert mech.epsilon() <= 3.0 < mech.epsilon(mech.num_steps + 1)


def test_epsilon_upper_bound_is_an_upper_bound():
    mech = accounting.plan_mechanism(num_steps=100, noise_multiplier=1.0, **COMMON)
    for step in (1, 9, 10, 11, 99, 100):
        assert accounting.epsilon_upper_bound(mech, step) >= mech.epsilon(step)
    assert accounting.epsilon_upper_bound(mech, 0) == 0.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(noise_multiplier=0.0), "noise_multiplier"),
        (dict(noise_multiplier=-1.0), "noise_multiplier"),
        (dict(noise_multiplier=1.0, target_delta=1.0), "delta"),
        (dict(noise_multiplier=1.0, batch_size=70000), "batch_size=70000 is larger"),
        (dict(noise_multiplier=1.0, l2_clip_norm=0.0), "l2_clip_norm must be a finite number > 0"),
        (dict(noise_multiplier=1.0, accountant="moments"), "Unknown accountant"),
        (dict(noise_multiplier=1.0, sampling="shufle"), "Unknown sampling scheme"),
        (dict(noise_multiplier=1.0, num_microbatches=0), "num_microbatches must be an integer"),
        (dict(noise_multiplier=1.0, data_normalization={"noise_multiplier": 8.0}),
         "missing keys"),
        (dict(), "Neither NOISE_MULTIPLIER nor TARGET_EPSILON"),
    ],
)
def test_bad_parameters_raise_clear_errors(overrides, message):
    kwargs = dict(COMMON, num_steps=10)
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=message):
        accounting.plan_mechanism(**kwargs)


def test_plan_uses_the_same_epsilon_as_the_accountant():
    mech = accounting.plan_mechanism(num_steps=50, noise_multiplier=1.1, **COMMON)
    assert mech.epsilon() == accounting.compute_epsilon(
        noise_multiplier=1.1, sampling_prob=2048 / 60000, num_steps=50, delta=1e-5)


NORM = {"noise_multiplier": 8.0, "l2_clip_norm_mean": 0.3, "l2_clip_norm_square": 0.15,
        "threshold": 1e-4}


def test_private_data_normalization_is_composed_into_epsilon():
    plain = accounting.plan_mechanism(num_steps=50, noise_multiplier=1.1, **COMMON)
    normed = accounting.plan_mechanism(num_steps=50, noise_multiplier=1.1,
                                       data_normalization=NORM, **COMMON)
    assert normed.epsilon() > plain.epsilon()
    assert normed.epsilon(0) > 0  # released before the first step
    calibrated = accounting.plan_mechanism(num_steps=50, target_epsilon=3.0,
                                           data_normalization=NORM, **COMMON)
    assert calibrated.epsilon() <= 3.0
    assert calibrated.noise_multiplier > accounting.plan_mechanism(
        num_steps=50, target_epsilon=3.0, **COMMON).noise_multiplier


# -- Sensitivity, noise, division -------------------------------------------------------


@pytest.mark.parametrize("overrides, sensitivity", [
    (dict(), 0.5),                                              # C
    (dict(normalize_update=True), 1.0),                         # De et al. eq. (3)
    (dict(num_microbatches=8), 1.0),                            # 2C (Sec. 5.6)
    (dict(num_microbatches=8, normalize_update=True), 2.0),
    (dict(sampling="shuffle"), 1.0),                            # replace-one: 2C
    (dict(sampling="shuffle", num_microbatches=8), 1.0),        # still 2C, not 4C
    (dict(sampling="shuffle", normalize_update=True), 2.0),
])
def test_sensitivity_and_noise_std(overrides, sensitivity):
    mech = _mechanism(noise_multiplier=3.0, **overrides)
    assert mech.sensitivity() == pytest.approx(sensitivity)
    assert mech.noise_stddev() == pytest.approx(3.0 * sensitivity)


def test_update_divisor_is_the_expected_batch_or_the_microbatch_count():
    assert _mechanism().update_divisor == 600.0
    assert _mechanism(num_microbatches=8).update_divisor == 8.0


def test_adjacency_follows_the_sampling():
    assert _mechanism().adjacency == accounting.ADD_OR_REMOVE == "add-or-remove one example"
    assert _mechanism(sampling="shuffle").adjacency == accounting.REPLACE_ONE


# -- Events ------------------------------------------------------------------------------


def test_poisson_event_is_the_subsampled_gaussian():
    assert _mechanism().dp_event() == accounting.dp_sgd_event(
        noise_multiplier=1.0, sampling_prob=0.01, num_steps=100)


def test_shuffle_counts_the_epochs_touched_not_the_examples_seen():
    # N = 10, B = 4: floor(10/4) = 2 batches per epoch, 2 examples dropped each epoch.
    # T = 5 steps touch epochs 0, 1, 2: an example can be in 3 steps. ceil(T B / N) = 2
    # would undercount.
    mech = _mechanism(num_examples=10, batch_size=4, num_steps=5, sampling="shuffle",
                      delta=1e-3)
    assert mech.participations() == 3
    assert mech.dp_event() == dp_accounting.SelfComposedDpEvent(
        dp_accounting.GaussianDpEvent(1.0), 3)


def test_shuffle_includes_the_data_normalization_at_replace_one():
    norm = accounting.DataNormalization(**NORM)
    mech = _mechanism(num_examples=10, batch_size=4, num_steps=5, sampling="shuffle",
                      delta=1e-3, data_normalization=norm)
    # Replace-one doubles the normalization's sensitivity: noise multiplier 8 / 2.
    assert mech.dp_event() == dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.0), 3),
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(4.0), 2)])
    no_norm = dataclasses.replace(mech, data_normalization=None)
    assert mech.epsilon() > no_norm.epsilon()
    # What papers often quote for shuffling is smaller and is not the guarantee.
    assert mech.epsilon_assuming_poisson() < mech.epsilon()


def test_truncation_adds_to_the_guarantee_delta():
    trunc = accounting.Truncation(static_batch_size=700, per_replica_batch_size=700,
                                  num_replicas=1, truncation_probability=1e-9)
    mech = _mechanism(truncation=trunc)
    epsilon, delta = mech.guarantee()
    assert epsilon == mech.epsilon()
    assert delta == pytest.approx(1e-5 + (1 + math.exp(epsilon)) * 1e-9)
    assert _mechanism().guarantee() == (mech.epsilon(), 1e-5)


# -- Records: checkpoint and ledger ------------------------------------------------------


def test_to_dict_round_trips():
    mech = _mechanism(data_normalization=accounting.DataNormalization(**NORM),
                      truncation=accounting.Truncation(700, 700, 1, 1e-9),
                      num_microbatches=4, fixed_seeds=("noise_seed",))
    assert accounting.DPMechanism.from_dict(mech.to_dict()) == mech


@pytest.mark.parametrize("change, field", [
    (dict(accountant="pld"), "accountant"),
    (dict(normalize_update=True), "normalize_update"),
    (dict(num_microbatches=4), "num_microbatches"),
    (dict(sampling="shuffle"), "sampling"),
    (dict(noise_multiplier=1.5), "noise_multiplier"),
    (dict(batch_size=601), "batch_size"),
    (dict(truncation=accounting.Truncation(700, 700, 1, 1e-9)), "static_batch_size"),
    (dict(data_normalization=accounting.DataNormalization(**NORM)), "data_normalization"),
    (dict(fixed_seeds=("sampling_seed",)), "fixed_seeds"),
])
def test_differences_name_the_field(change, field):
    lines = _mechanism().differences(_mechanism(**change))
    assert len(lines) == 1 and lines[0].startswith(field)


def test_more_steps_are_not_a_different_mechanism():
    assert _mechanism().differences(_mechanism(num_steps=500)) == []


def test_runs_sharing_a_fixed_sampling_seed_compose_as_one_subsampled_mechanism():
    a = _mechanism(noise_multiplier=2.0, num_steps=100)
    b = _mechanism(noise_multiplier=2.0, num_steps=40)
    # Steps 1-40: both runs on the same batch, sigma_eff = (1/4 + 1/4)^(-1/2) = sqrt(2).
    event = mechanism_lib.shared_sampling_seed_event([a, b])
    assert event == dp_accounting.ComposedDpEvent([
        accounting.dp_sgd_event(noise_multiplier=math.sqrt(2), sampling_prob=0.01,
                                num_steps=40),
        accounting.dp_sgd_event(noise_multiplier=2.0, sampling_prob=0.01, num_steps=60)])
    with pytest.raises(ValueError, match="same NUM_EXAMPLES and BATCH_SIZE"):
        mechanism_lib.shared_sampling_seed_event([a, _mechanism(batch_size=601)])


@pytest.mark.parametrize("sigma", [5e-324, 1e-300, 1e300])
def test_a_noise_multiplier_the_accountant_cannot_hold_is_refused_by_name(sigma):
    # Before: accepted, then step 1 crashed in dp_accounting (ZeroDivisionError, OverflowError)
    # and left a checkpoint-0 workdir.
    with pytest.raises(ValueError, match=r"noise_multiplier=.* is outside \[1e-100, 1e\+100\]"):
        accounting.DPMechanism(num_examples=1000, batch_size=10, num_steps=10,
                               noise_multiplier=sigma, l2_clip_norm=1.0, delta=1e-5)
    with pytest.raises(ValueError, match="is outside"):
        accounting.compute_epsilon(noise_multiplier=sigma, sampling_prob=0.01, num_steps=10,
                                   delta=1e-5)


@pytest.mark.parametrize("clip, sigma, match", [
    (1e31, 1.0, r"l2_clip_norm=1e\+31 is outside"), (1e-31, 1.0, "l2_clip_norm=1e-31 is outside"),
    (1e20, 1e20, "float32 noise would overflow")])
def test_a_clip_norm_or_noise_float32_cannot_hold_is_refused(clip, sigma, match):
    with pytest.raises(ValueError, match=match):
        accounting.DPMechanism(num_examples=1000, batch_size=10, num_steps=10,
                               noise_multiplier=sigma, l2_clip_norm=clip, delta=1e-5)
