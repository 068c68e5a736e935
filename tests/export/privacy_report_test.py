"""The privacy card has every field of How to DP-fy ML Sec. 5.3.3, read from the mechanism."""

import json
import math

import pytest

from tfdp import accounting
from tfdp.export import privacy_report

REQUIRED = {
    "epsilon", "delta", "accountant", "noise_multiplier", "l2_clip_norm", "batch_size",
    "num_examples", "steps", "sampling", "neighbouring_relation", "privacy_unit",
    "dp_setting", "covered", "mechanism_output", "epsilon_tier", "hyperparameters",
    "software", "delta_below_1_over_n", "sensitivity", "noise_stddev", "seeds", "assumptions",
}


def _mechanism(**overrides):
    fields = dict(num_examples=60000, batch_size=600, num_steps=100, l2_clip_norm=1.0,
                  delta=1e-5, noise_multiplier=1.0)
    return accounting.DPMechanism(**{**fields, **overrides})


def _report(**overrides):
    return privacy_report.build_privacy_report(
        _mechanism(**overrides), steps_completed=100, hyperparameters={"lr": 0.1})


def test_report_has_every_field_and_the_markdown_card_states_them(tmp_path):
    mechanism = _mechanism()
    report = _report()
    assert REQUIRED <= set(report)
    assert report["epsilon"] == mechanism.epsilon(100)
    assert report["sampling"]["assumption_holds"] is True
    assert report["neighbouring_relation"] == "add-or-remove one example"
    assert report["mechanism"] == mechanism.to_dict()
    json_path, md_path = privacy_report.write_privacy_report(report, tmp_path)
    assert json.loads(open(json_path).read())["steps"] == 100
    card = open(md_path).read()
    for phrase in ("central", "add-or-remove", "every iterate", "Tier", "Poisson", "lr",
                   "What the guarantee assumes", "secret"):
        assert phrase in card


def test_shuffling_is_reported_at_replace_one_without_amplification():
    report = _report(sampling="shuffle")
    assert report["neighbouring_relation"] == "replace one example"
    assert report["sensitivity"] == 2.0 and report["sensitivity_formula"].startswith("2 *")
    # 100 steps of 600 out of 60000: one epoch touched; epsilon is the Gaussian's.
    assert "at most 1 of the 100 steps" in report["sampling"]["accountant_assumes"]
    assert report["epsilon"] == pytest.approx(accounting.epsilon_of_event(
        accounting.gaussian_composition_event(noise_multiplier=1.0, count=1), delta=1e-5))
    assert report["sampling"]["epsilon_assuming_poisson"] < report["epsilon"]
    card = privacy_report.render_markdown(report)
    assert "replace one example" in card and "NOT a guarantee" in card


@pytest.mark.parametrize("overrides, sensitivity, formula", [
    (dict(), 1.0, "l2_clip_norm"),
    (dict(l2_clip_norm=0.1, normalize_update=True), 1.0, "1"),
    (dict(l2_clip_norm=0.1, num_microbatches=8), 0.2, "2 * l2_clip_norm"),
    (dict(l2_clip_norm=0.1, normalize_update=True, num_microbatches=8), 2.0, "2 * 1"),
])
def test_the_stated_sensitivity_is_the_mechanism_s(overrides, sensitivity, formula):
    # The normalized update (De et al. eq. (3)) has sensitivity 1, not l2_clip_norm.
    report = _report(**overrides)
    assert report["sensitivity"] == pytest.approx(sensitivity)
    assert report["sensitivity_formula"].startswith(formula)
    assert report["noise_stddev"] == pytest.approx(sensitivity)  # sigma = 1


def test_the_top_level_delta_is_the_whole_guarantee_s():
    truncation = accounting.Truncation(static_batch_size=700, per_replica_batch_size=700,
                                       num_replicas=1, truncation_probability=1e-8)
    report = _report(truncation=truncation)
    assert report["accountant_delta"] == 1e-5
    assert report["delta"] == pytest.approx(1e-5 + (1 + math.exp(report["epsilon"])) * 1e-8)
    assert report["truncation"]["delta_with_truncation"] == report["delta"]
    assert f"{report['delta']:.3g})-DP" in privacy_report.render_markdown(report)


def test_a_delta_of_1_over_n_or_more_is_never_a_reasonable_guarantee():
    report = _report(num_examples=1000, batch_size=10, delta=1e-3)
    assert report["epsilon"] < 10
    assert report["epsilon_tier"].startswith("No meaningful guarantee")
    assert not report["delta_below_1_over_n"]


def test_fixed_seeds_are_stated_as_an_assumption():
    report = _report(fixed_seeds=("sampling_seed",))
    assert report["seeds"]["sampling_seed"].startswith("fixed by the user")
    assert report["seeds"]["noise_seed"].startswith("secret")


@pytest.mark.parametrize("epsilon, tier", [(0.5, "Tier 1"), (8.0, "Tier 2"), (12.0, "Tier 3")])
def test_epsilon_tiers(epsilon, tier):
    assert privacy_report.epsilon_tier(epsilon, 1e-6, 60000).startswith(tier)


@pytest.mark.parametrize("bound, verdict", [(1.2, "as a correct implementation gives"),
                                            (4.5, "NOT as private as claimed")])
def test_an_audit_gets_its_own_section_with_the_verdict_and_the_command(tmp_path, bound, verdict):
    from tfdp.accounting import audit  # pylint: disable=g-import-not-at-top

    report = _report()
    assert "Empirical audit" not in privacy_report.render_markdown(report)
    result = audit.AuditResult(
        epsilon_lower_bound=bound, num_canaries=1000, num_guesses=100, num_correct=95,
        num_guesses_in=50, num_guesses_out=50, num_candidates=4, delta=report["delta"],
        beta=0.05)
    report["audit"] = audit.report_section(
        result, canaries="gradient", score="sum", num_included=503,
        claimed_epsilon=report["epsilon"], command="python tools/audit.py gradient ...")
    assert report["audit"]["exceeds_claim"] is (bound > report["epsilon"])
    _, md_path = privacy_report.write_privacy_report(report, tmp_path)
    card = open(md_path).read()
    assert "## Empirical audit" in card and verdict in card
    assert f"epsilon >= **{bound:.3f}** at 95% confidence" in card
    assert "1000 (503 included" in card and "95 correct of 100" in card
    assert "`python tools/audit.py gradient ...`" in card


@pytest.mark.parametrize("device", ["float32", "tf32", "bf16"])
def test_the_card_states_the_norm_every_example_was_clipped_to(tmp_path, device):
    # Clipped to C / (1 + kappa), kappa by the device class; the noise stays at C.
    from tfdp.dp import device_arithmetic  # the report itself imports no TensorFlow
    from tfdp.dp import precision  # the report itself imports no TensorFlow

    emulated = {"float32": device_arithmetic.FLOAT32, "tf32": device_arithmetic.TF32,
                "bf16": device_arithmetic.BF16}
    with device_arithmetic.emulate(emulated[device]):
        margin = precision.clip_margin_record(2.0)
    report = privacy_report.build_privacy_report(
        _mechanism(l2_clip_norm=2.0), steps_completed=100, clip_margin=margin)
    kappa = precision.CLIP_MARGINS[device]
    assert precision.clip_margin_record(2.0, device=device) == margin  # the traced device's
    assert report["clip_margin"]["clipped_to"] == pytest.approx(2.0 / (1 + kappa), rel=1e-12)
    assert report["noise_stddev"] == pytest.approx(2.0)  # noise_multiplier 1 times C, not C'
    _, md_path = privacy_report.write_privacy_report(report, tmp_path)
    card = open(md_path).read()
    assert f"| clipped to | {2.0 / (1 + kappa):.6g} = l2_clip_norm / (1 + kappa), kappa " \
           f"{kappa:.0e} for {device} matmul inputs" in card
