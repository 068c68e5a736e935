"""train_and_evaluate with static batch shapes and checkpoint cadence, on mock data."""

import json
import math

import pytest
import tensorflow as tf

from tfdp import data

MOCK_EXAMPLES = 64  # the N that conftest.py's run_smoke trains on


def _run(run_smoke, workdir, *params):
    """fashion_mnist.gin + smoke.gin (2 steps) on mock data, N = 64, B = 16, sigma = 1."""
    return run_smoke(workdir, ["fashion_mnist.gin"], [
        "TARGET_EPSILON = None", "NOISE_MULTIPLIER = 1.0", *params])


@pytest.mark.slow
def test_static_batches_state_the_cap_and_the_truncation_bound(tmp_path, run_smoke):
    report = _run(run_smoke, tmp_path, "tfdp.RuntimeConfig.static_batch_size = 36",
                  "tfdp.OptimizationConfig.accumulation_steps = 2")
    truncation = report["truncation"]
    # eta = 2 steps * P(Binomial(65, 16/64) > 36); delta' = delta + (1 + e^eps) eta.
    eta = data.truncation_probability(MOCK_EXAMPLES, 16 / MOCK_EXAMPLES, 36, 2)
    assert truncation["static_batch_size"] == 36 and truncation["num_replicas"] == 1
    assert truncation["truncation_probability"] == pytest.approx(eta)
    assert truncation["delta_with_truncation"] == pytest.approx(
        report["accountant_delta"] + (1 + math.exp(report["epsilon"])) * eta)
    assert report["delta"] == truncation["delta_with_truncation"]  # the whole guarantee's
    saved = json.loads((tmp_path / "privacy_report.json").read_text())
    assert saved["truncation"] == truncation
    card = (tmp_path / "privacy_report.md").read_text()
    assert "truncated to 36 examples" in card
    assert report["steps"] == 2


def test_a_cap_that_truncates_too_often_is_refused_with_the_auto_value(tmp_path, run_smoke):
    # 20 slots for an expected batch of 16: truncation is likely, delta would explode.
    with pytest.raises(ValueError, match=r"truncates Poisson batches .*='auto' \(\d+ here\)"):
        _run(run_smoke, tmp_path, "tfdp.RuntimeConfig.static_batch_size = 20")


def test_a_cap_that_does_not_split_into_accumulation_chunks_is_refused(tmp_path, run_smoke):
    with pytest.raises(ValueError, match="must be a multiple of 4"):
        _run(run_smoke, tmp_path, "tfdp.RuntimeConfig.static_batch_size = 38",
             "tfdp.OptimizationConfig.accumulation_steps = 4")


def test_checkpoint_interval_must_divide_the_evaluation_interval(tmp_path, run_smoke):
    with pytest.raises(ValueError, match="must be >= 1 and divide eval_every_steps=2"):
        _run(run_smoke, tmp_path, "tfdp.RuntimeConfig.checkpoint_every_steps = 3")


@pytest.mark.slow
def test_checkpoints_every_step_evaluate_every_two(tmp_path, run_smoke):
    report = _run(run_smoke, tmp_path, "NUM_STEPS = 4",
                  "tfdp.RuntimeConfig.checkpoint_every_steps = 1",
                  "tfdp.EvaluationConfig.eval_every_steps = 2")
    assert report["steps"] == 4
    steps = [json.loads(line)["step"]
             for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4]  # evaluations only
    manager_state = tf.train.get_checkpoint_state(str(tmp_path / "checkpoints"))
    kept = [path.rsplit("-", 1)[1] for path in manager_state.all_model_checkpoint_paths]
    assert kept == ["3", "4"]  # one per step (the manager keeps the last 2)


def test_a_checkpoint_from_another_privacy_plan_is_not_resumed(tmp_path, run_smoke):
    _run(run_smoke, tmp_path, "NUM_STEPS = 2")
    with pytest.raises(ValueError, match=r"another privacy mechanism:\n  noise_multiplier: 1.0 vs 2.0"):
        _run(run_smoke, tmp_path, "NUM_STEPS = 4", "NOISE_MULTIPLIER = 2.0")
