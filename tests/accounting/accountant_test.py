"""Tests for tfdp.accounting.accountant: golden epsilons, calibration, errors."""

import doctest
import subprocess
import sys

import dp_accounting
import pytest

from tfdp import accounting
from tfdp.accounting import accountant
from tfdp.accounting import ledger
from tfdp.accounting import tan

CIFAR10_N = 50_000  # train + valid (De et al. 2022, Table 11).
IMAGENET_N = 1_271_167  # De et al. 2022, Table 11.

# De et al. 2022, App. C.5: (published epsilon, sigma, steps).
TABLE_12 = [
    (1, 10.0, 875),
    (2, 6.0, 1125),
    (3, 5.0, 1593),
    (4, 4.0, 1687),
    (6, 3.0, 1843),
]  # WRN-16-4, B = 4096, delta = 1e-5.
TABLE_13 = [
    (1, 40.0, 906),
    (2, 24.0, 1156),
    (3, 20.0, 1656),
    (4, 16.0, 1765),
    (6, 12.0, 2007),
    (8, 9.4, 2000),
]  # WRN-40-4, B = 16384.
# De et al. 2022, App. C.5, Tables 15-18 (ImageNet-32 -> CIFAR-10 / CIFAR-100, WRN-28-10,
# all layers or the last layer): the four tables share B = 16384, delta = 1e-5 and these
# (published epsilon, sigma, steps); only the learning rate differs.
TABLES_15_TO_18 = [
    (1, 21.1, 250),
    (2, 15.8, 500),
    (4, 12.0, 1000),
    (8, 9.4, 2000),
]
# De et al. 2022, App. C.5, Table 20 (JFT-300M -> ImageNet, last layer of NF-ResNet-200):
# B = 16384, delta = 8e-7.
TABLE_20 = [
    (0.5, 12.7, 12500),
    (1, 9.4, 25000),
    (2, 7.0, 50000),
    (4, 5.3, 100000),
    (8, 4.0, 193318),
]


def test_importing_accounting_does_not_import_tensorflow():
    code = (
        "import tfdp.accounting, sys; "
        "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("module", [accountant, tan, ledger])
def test_doctests_pass(module):
    # setup.cfg's testpaths=tests means `pytest` alone does not collect the
    # doctests under tfdp/, so run them here (incl. the Table 14 golden value).
    failed, attempted = doctest.testmod(module, verbose=False)
    assert failed == 0
    if module is not ledger:
        assert attempted > 0


def _rdp(sigma, batch_size, num_examples, steps, delta, acc="rdp"):
    return accounting.compute_epsilon(
        noise_multiplier=sigma,
        sampling_prob=batch_size / num_examples,
        num_steps=steps,
        delta=delta,
        accountant=acc,
    )


@pytest.mark.parametrize("published, sigma, steps", TABLE_12)
def test_table_12_wrn_16_4_golden_epsilon(published, sigma, steps):
    eps = _rdp(sigma, 4096, CIFAR10_N, steps, 1e-5)
    # eps=1 row computes to 0.988 (-1.2%); the others are within 0.8%.
    assert eps == pytest.approx(published, rel=0.015)


def test_table_12_eps_8_row_is_inconsistent_in_the_paper():
    # Table 12 lists eps=8 with sigma=3 and 2468 steps, but its eps=6 row has the
    # same sigma=3 with 1843 steps; sigma=3 for 2468 steps gives eps = 7.046
    # (eps=8 at 2468 steps needs sigma = 2.714; eps=8 at sigma=3 allows 3066
    # steps). We assert what the listed values really give.
    eps = _rdp(3.0, 4096, CIFAR10_N, 2468, 1e-5)
    assert eps == pytest.approx(7.046, abs=0.01)
    assert eps < 8 * 0.9
    assert (
        accounting.calibrate_num_steps(
            target_epsilon=8, noise_multiplier=3.0, sampling_prob=4096 / CIFAR10_N, delta=1e-5
        )
        == 3066
    )


@pytest.mark.parametrize("published, sigma, steps", TABLE_13)
def test_table_13_wrn_40_4_golden_epsilon(published, sigma, steps):
    eps = _rdp(sigma, 16384, CIFAR10_N, steps, 1e-5)
    # All rows are consistent: |error| <= 0.4%. The eps=6 row computes to
    # 6.023, i.e. 0.4% ABOVE the published budget (a rounding of sigma or T).
    assert eps == pytest.approx(published, rel=0.015)


def test_table_14_imagenet_golden_epsilon():
    eps = _rdp(2.5, 16384, IMAGENET_N, 71589, 8e-7)
    assert eps == pytest.approx(8.0, rel=0.015)
    assert eps == pytest.approx(8.0001, abs=1e-3)


@pytest.mark.parametrize("published, sigma, steps", TABLES_15_TO_18)
def test_tables_15_to_18_wrn_28_10_fine_tuning_golden_epsilon(published, sigma, steps):
    eps = _rdp(sigma, 16384, CIFAR10_N, steps, 1e-5)
    # Computes to 0.998, 2.003, 4.020, 7.998: within 0.5% (tolerance 1%). The eps=2 and
    # eps=4 rows are 0.1% and 0.5% ABOVE the published budget.
    assert eps == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize("published, sigma, steps", TABLE_20)
def test_table_20_imagenet_fine_tuning_golden_epsilon(published, sigma, steps):
    eps = _rdp(sigma, 16384, IMAGENET_N, steps, 8e-7)
    # Computes to 0.499, 0.996, 1.993, 3.968, 8.000: within 0.8%.
    assert eps == pytest.approx(published, rel=0.01)


def test_table_20_uses_n_without_the_validation_split():
    # With the full train split (N = 1,281,167) the eps=8 row gives 7.927, 0.9% low, and the
    # eps=4 row 3.934 (1.7% low): De et al.'s N is 1,271,167, train minus 10,000 (Table 11).
    assert _rdp(4.0, 16384, IMAGENET_N, 193318, 8e-7) == pytest.approx(8.0, abs=1e-3)
    assert _rdp(5.3, 16384, 1_281_167, 100000, 8e-7) < 4 * 0.99


@pytest.mark.parametrize(
    "sigma, batch_size, num_examples, steps, delta",
    [
        (10.0, 4096, CIFAR10_N, 875, 1e-5),  # RDP 0.988, PLD 0.904
        (3.0, 4096, CIFAR10_N, 1843, 1e-5),  # RDP 5.952, PLD 5.507
        (9.4, 16384, CIFAR10_N, 2000, 1e-5),  # RDP 7.998, PLD 7.425
        (2.5, 16384, IMAGENET_N, 71589, 8e-7),  # RDP 8.000, PLD 7.534
    ],
)
def test_pld_is_a_bit_lower_than_rdp(sigma, batch_size, num_examples, steps, delta):
    eps_rdp = _rdp(sigma, batch_size, num_examples, steps, delta)
    eps_pld = _rdp(sigma, batch_size, num_examples, steps, delta, acc="pld")
    assert 0.85 * eps_rdp < eps_pld < 0.97 * eps_rdp


def test_dp_sgd_event_structure():
    event = accounting.dp_sgd_event(noise_multiplier=2.0, sampling_prob=0.25, num_steps=7)
    assert event == dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(2.0)), 7
    )


def test_epsilon_of_event_matches_compute_epsilon():
    event = accounting.dp_sgd_event(noise_multiplier=3.0, sampling_prob=0.08192, num_steps=1843)
    for acc in accounting.ACCOUNTANTS:
        assert accounting.epsilon_of_event(event, delta=1e-5, accountant=acc) == (
            accounting.compute_epsilon(
                noise_multiplier=3.0,
                sampling_prob=0.08192,
                num_steps=1843,
                delta=1e-5,
                accountant=acc,
            )
        )


def test_epsilon_grows_with_steps_and_shrinks_with_noise():
    base = dict(sampling_prob=0.01, delta=1e-5)
    assert _rdp(1.0, 1, 100, 100, 1e-5) < _rdp(1.0, 1, 100, 200, 1e-5)
    assert accounting.compute_epsilon(
        noise_multiplier=2.0, num_steps=100, **base
    ) < accounting.compute_epsilon(noise_multiplier=1.0, num_steps=100, **base)


@pytest.mark.parametrize(
    "target, q, steps, acc",
    [
        (1.0, 4096 / CIFAR10_N, 875, "rdp"),
        (8.0, 4096 / CIFAR10_N, 2468, "rdp"),  # sigma = 2.714
        (3.0, 256 / 60_000, 10_000, "rdp"),
        (8.0, 4096 / CIFAR10_N, 2468, "pld"),  # sigma = 2.561
    ],
)
def test_calibrate_noise_multiplier_round_trip(target, q, steps, acc):
    sigma = accounting.calibrate_noise_multiplier(
        target_epsilon=target, sampling_prob=q, num_steps=steps, delta=1e-5, accountant=acc
    )
    eps = accounting.compute_epsilon(
        noise_multiplier=sigma, sampling_prob=q, num_steps=steps, delta=1e-5, accountant=acc
    )
    assert eps <= target
    assert eps == pytest.approx(target, rel=3e-3)
    # 0.1% less noise would go over budget (tolerance is 1e-3 relative).
    assert (
        accounting.compute_epsilon(
            noise_multiplier=sigma * 0.998,
            sampling_prob=q,
            num_steps=steps,
            delta=1e-5,
            accountant=acc,
        )
        > target
    )


def test_calibrate_noise_multiplier_reproduces_table_14_sigma():
    sigma = accounting.calibrate_noise_multiplier(
        target_epsilon=8.0, sampling_prob=16384 / IMAGENET_N, num_steps=71589, delta=8e-7
    )
    assert sigma == pytest.approx(2.5, rel=2e-3)


@pytest.mark.parametrize(
    "target, sigma, q, acc",
    [
        (8.0, 3.0, 4096 / CIFAR10_N, "rdp"),  # 3066 steps
        (1.0, 10.0, 4096 / CIFAR10_N, "rdp"),
        (2.0, 1.0, 0.004, "rdp"),
        (8.0, 3.0, 4096 / CIFAR10_N, "pld"),  # 3476 steps
    ],
)
def test_calibrate_num_steps_is_the_largest_within_budget(target, sigma, q, acc):
    steps = accounting.calibrate_num_steps(
        target_epsilon=target, noise_multiplier=sigma, sampling_prob=q, delta=1e-5, accountant=acc
    )

    def eps(num_steps):
        return accounting.compute_epsilon(
            noise_multiplier=sigma, sampling_prob=q, num_steps=num_steps, delta=1e-5, accountant=acc
        )

    assert isinstance(steps, int)
    assert eps(steps) <= target < eps(steps + 1)


def test_calibrate_num_steps_stops_at_max_num_steps():
    # sigma=10, q=0.001: 1000 steps cost far less than eps=8.
    assert (
        accounting.calibrate_num_steps(
            target_epsilon=8,
            noise_multiplier=10,
            sampling_prob=0.001,
            delta=1e-5,
            max_num_steps=1000,
        )
        == 1000
    )


@pytest.mark.parametrize(
    "target, sigma, steps, acc",
    [
        (8.0, 3.0, 2468, "rdp"),  # 4561
        (3.0, 5.0, 1593, "rdp"),
        (8.0, 3.0, 2468, "pld"),  # 4856
    ],
)
def test_calibrate_batch_size_is_the_largest_within_budget(target, sigma, steps, acc):
    batch_size = accounting.calibrate_batch_size(
        target_epsilon=target,
        noise_multiplier=sigma,
        num_steps=steps,
        num_examples=CIFAR10_N,
        delta=1e-5,
        accountant=acc,
    )

    def eps(b):
        return _rdp(sigma, b, CIFAR10_N, steps, 1e-5, acc)

    assert isinstance(batch_size, int)
    assert eps(batch_size) <= target < eps(batch_size + 1)


def test_calibrate_batch_size_stops_at_num_examples():
    assert (
        accounting.calibrate_batch_size(
            target_epsilon=8, noise_multiplier=10, num_steps=10, num_examples=1000, delta=1e-5
        )
        == 1000
    )


def test_calibrate_noise_multiplier_unreachable_targets():
    with pytest.raises(
        ValueError, match=r"needs noise_multiplier > 10000.*" r"raise target_epsilon"
    ):
        accounting.calibrate_noise_multiplier(
            target_epsilon=1e-3, sampling_prob=1.0, num_steps=10**6, delta=1e-5
        )
    with pytest.raises(
        ValueError, match=r"met even with noise_multiplier.*" r"lower target_epsilon"
    ):
        accounting.calibrate_noise_multiplier(
            target_epsilon=1000, sampling_prob=0.001, num_steps=1, delta=1e-5
        )


def test_calibrate_num_steps_unreachable_target():
    with pytest.raises(
        ValueError,
        match=r"single step already costs epsilon=" r".*raise target_epsilon or noise_multiplier",
    ):
        accounting.calibrate_num_steps(
            target_epsilon=0.1, noise_multiplier=0.5, sampling_prob=1.0, delta=1e-5
        )
    with pytest.raises(ValueError, match="max_num_steps must be an integer"):
        accounting.calibrate_num_steps(
            target_epsilon=1, noise_multiplier=1, sampling_prob=0.1, delta=1e-5, max_num_steps=0
        )


def test_calibrate_batch_size_unreachable_target():
    with pytest.raises(ValueError, match=r"Even batch_size=1 costs epsilon=.*" r"lower num_steps"):
        accounting.calibrate_batch_size(
            target_epsilon=0.01, noise_multiplier=0.5, num_steps=1000, num_examples=100, delta=1e-5
        )


@pytest.mark.parametrize("target", [0, -1.0, float("inf"), float("nan")])
def test_calibration_rejects_bad_target_epsilon(target):
    with pytest.raises(ValueError, match="target_epsilon must be a finite"):
        accounting.calibrate_noise_multiplier(
            target_epsilon=target, sampling_prob=0.1, num_steps=10, delta=1e-5
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(noise_multiplier=0.0),
            r"noise_multiplier must be .* > 0.*noise std" r" divided by l2_clip_norm",
        ),
        (dict(noise_multiplier=-1.0), "noise_multiplier must be"),
        (dict(noise_multiplier=float("inf")), "noise_multiplier must be"),
        (
            dict(sampling_prob=0.0),
            r"sampling_prob must be in \(0, 1\].*" r"q = batch_size / num_examples",
        ),
        (dict(sampling_prob=1.5), r"sampling_prob must be in \(0, 1\]"),
        (dict(delta=0.0), r"delta must be in \(0, 1\)"),
        (dict(delta=1.0), r"delta must be in \(0, 1\)"),
        (dict(num_steps=0), "num_steps must be an integer >= 1"),
        (dict(num_steps=2.5), "num_steps must be an integer >= 1"),
        (dict(num_examples=0), "num_examples must be an integer >= 1"),
    ],
)
def test_validate_privacy_params_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        accounting.validate_privacy_params(**kwargs)


def test_validate_privacy_params_accepts_good_values():
    accounting.validate_privacy_params(
        noise_multiplier=1.0, sampling_prob=1.0, delta=1e-5, num_examples=50_000, num_steps=1
    )


def test_delta_not_much_smaller_than_one_over_n_warns():
    with pytest.warns(UserWarning, match=r"How to DP-fy ML.*5\.3.*delta << 1/N"):
        accounting.validate_privacy_params(delta=1e-4, num_examples=50_000)


def test_compute_epsilon_validates():
    with pytest.raises(ValueError, match="noise_multiplier must be"):
        accounting.compute_epsilon(noise_multiplier=0, sampling_prob=0.1, num_steps=10, delta=1e-5)
    with pytest.raises(ValueError, match="num_steps must be"):
        accounting.compute_epsilon(noise_multiplier=1, sampling_prob=0.1, num_steps=0, delta=1e-5)


def test_unknown_accountant_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"Unknown accountant 'gdp'.*rdp.*pld"):
        accounting.compute_epsilon(
            noise_multiplier=1, sampling_prob=0.1, num_steps=10, delta=1e-5, accountant="gdp"
        )


def test_epsilon_of_unsupported_event():
    with pytest.raises(ValueError, match="does not support the event"):
        accounting.epsilon_of_event(dp_accounting.UnsupportedDpEvent(), delta=1e-5)


def test_sampling_prob_from():
    assert accounting.sampling_prob_from(4096, 50_000) == 0.08192
    assert accounting.sampling_prob_from(100, 100) == 1.0
    with pytest.raises(
        ValueError, match=r"batch_size=4096 is larger than " r"num_examples=1000.*Lower batch_size"
    ):
        accounting.sampling_prob_from(4096, 1000)
    with pytest.raises(ValueError, match="batch_size must be a number > 0"):
        accounting.sampling_prob_from(0, 1000)
    with pytest.raises(ValueError, match="num_examples must be an integer"):
        accounting.sampling_prob_from(10, 0)


def test_non_converging_rdp_orders_are_explained_once_not_warned_per_order(caplog):
    # q = 0.25 makes dp_accounting's series diverge for several fractional orders; it used
    # to log one warning per order and per call (26 lines in a 2-step smoke run).
    import logging  # pylint: disable=g-import-not-at-top

    with caplog.at_level(logging.INFO):
        for steps in (2, 3):
            accounting.compute_epsilon(noise_multiplier=1.16544, sampling_prob=0.25,
                                       num_steps=steps, delta=1e-5)
    assert not [r for r in caplog.records if "failed to converge" in r.getMessage()]


def test_pld_refuses_work_it_could_not_finish_before_starting():
    # sigma = 0.06 for 10^6 steps tried to allocate 31.5 GiB.
    from tfdp.accounting import accountant  # pylint: disable=g-import-not-at-top

    with pytest.raises(ValueError, match=r"steps / noise_multiplier\^2 = 2\.78e\+08.*rdp"):
        accountant.compute_epsilon(noise_multiplier=0.06, sampling_prob=0.004,
                                   num_steps=10**6, delta=1e-5, accountant="pld")
