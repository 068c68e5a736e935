"""Tests of tools/scaling_law.py (TAN scaling-law fits, Sander et al. 2023, Sec. 3.4).

Synthetic workdirs (metrics.jsonl + privacy_report.json, or operative_config.gin)
are written to tmp_path; the CLI runs in-process through main(argv), and once
as a subprocess from another directory.
"""

import doctest
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "tools",
    "scaling_law.py",
)
_spec = importlib.util.spec_from_file_location("scaling_law_cli", SCRIPT)
scaling_law = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scaling_law)

NUM_EXAMPLES = 50_000
NUM_STEPS = 2500
B_REF = 4096
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(
    workdir,
    *,
    batch_size,
    noise_multiplier,
    accuracies,
    num_steps=NUM_STEPS,
    num_examples=NUM_EXAMPLES,
    report=True,
    config_text=None,
    simulation=None,
):
    """Writes a fake finished run: one evaluation per accuracy, the last at num_steps."""
    os.makedirs(workdir)
    steps = np.linspace(0, num_steps, len(accuracies) + 1)[1:].astype(int)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        for i, (step, acc) in enumerate(zip(steps, accuracies)):
            record = {
                "step": int(step),
                "epsilon": 0.5 * (i + 1),
                "delta": 1e-5,
                "test_accuracy": acc,
                "test_loss": 1.0,
                "train_accuracy": acc + 0.01,
                "train_loss": 0.9,
                "wall_time_s": float(i),
            }
            f.write(json.dumps(record) + "\n")
    if report:
        content = {
            "epsilon": 0.5 * len(accuracies),
            "delta": 1e-5,
            "noise_multiplier": noise_multiplier,
            "l2_clip_norm": 1.0,
            "batch_size": batch_size,
            "num_examples": num_examples,
            "steps": num_steps,
            "sampling": {"sampling_prob": batch_size / num_examples},
        }
        if simulation:
            content["simulation"] = simulation
        with open(os.path.join(workdir, "privacy_report.json"), "w") as f:
            json.dump(content, f)
    if config_text is not None:
        with open(os.path.join(workdir, "operative_config.gin"), "w") as f:
            f.write(config_text)
    return str(workdir)


def _scaling_family(tmp_path, *, prefix, sigma_ref, intercept, slope, noise, batch_sizes):
    """Runs at constant eta_step and num_steps: sigma = sigma_ref * B / B_REF (TAN Sec. 3.4).

    Final accuracy = intercept + slope * log2(B) + noise[i]; an earlier,
    higher evaluation makes "max" differ from "final".
    """
    workdirs = []
    for b, e in zip(batch_sizes, noise):
        final = intercept + slope * math.log2(b) + e
        workdirs.append(
            _write_run(
                tmp_path / f"{prefix}_b{b}",
                batch_size=b,
                noise_multiplier=sigma_ref * b / B_REF,
                accuracies=[0.3, final + 0.05, final],
            )
        )
    return workdirs


def _main(args, capsys):
    status = scaling_law.main(args)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _png_size(path):
    """(width, height) from the PNG's IHDR chunk."""
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == PNG_MAGIC
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def test_doctests():
    result = doctest.testmod(scaling_law)
    assert result.attempted >= 2 and result.failed == 0


def test_eta_step_is_q_over_sqrt2_sigma_and_constant_across_a_simulation_family():
    # q = 1000 / 50000 = 0.02; eta_step = 0.02 / (sqrt(2) * 2) = 0.00707107 (TAN Sec. 3.1).
    assert scaling_law.compute_eta_step(
        batch_size=1000, noise_multiplier=2.0, num_examples=50000
    ) == pytest.approx(0.02 / (math.sqrt(2) * 2))
    # sigma = sigma_ref * B / B_ref keeps it constant (TAN Sec. 3.4).
    values = [
        scaling_law.compute_eta_step(
            batch_size=b, noise_multiplier=3.0 * b / B_REF, num_examples=NUM_EXAMPLES
        )
        for b in (128, 256, 4096)
    ]
    assert values == pytest.approx([B_REF / (math.sqrt(2) * NUM_EXAMPLES * 3.0)] * 3, rel=1e-12)
    with pytest.raises(ValueError, match="noise_multiplier must be a finite number > 0"):
        scaling_law.compute_eta_step(batch_size=128, noise_multiplier=0.0, num_examples=10)


def test_fit_hand_computed_prediction_interval():
    # x = log2(B) = 1, 2, 3; y = 0, 1, 1: xbar = 2, Sxx = 2, slope = 1 / 2,
    # intercept = 2/3 - 1 = -1/3; residuals -1/6, 1/3, -1/6, SSE = 1/6, 1 dof.
    # At B_ref = 16 (x0 = 4): yhat = -1/3 + 2 = 5/3; half width
    # = t_{0.975, 1} * sqrt(1/6) * sqrt(1 + 1/3 + 4/2) = 12.7062047 * sqrt(10/18).
    fit = scaling_law.fit_scaling_law([2, 4, 8], [0.0, 1.0, 1.0], reference_batch_size=16)
    assert fit.slope == pytest.approx(0.5)
    assert fit.intercept == pytest.approx(-1 / 3)
    assert fit.prediction == pytest.approx(5 / 3)
    half = 12.706204736174707 * math.sqrt(10 / 18)
    assert fit.interval == pytest.approx((5 / 3 - half, 5 / 3 + half))
    assert fit.dof == 1 and fit.num_points == 3 and fit.num_batch_sizes == 3
    # R^2 = 1 - SSE / SST = 1 - (1/6) / (2/3) = 0.75; stderr = s / sqrt(Sxx).
    assert fit.r_squared == pytest.approx(0.75)
    assert fit.slope_stderr == pytest.approx(math.sqrt(1 / 6) / math.sqrt(2))


def test_fit_with_two_points_has_no_interval():
    fit = scaling_law.fit_scaling_law([256, 1024], [0.70, 0.66], reference_batch_size=4096)
    # Slope per doubling: (0.66 - 0.70) / 2 = -0.02; at 4096 (2 doublings on): 0.62.
    assert fit.slope == pytest.approx(-0.02)
    assert fit.prediction == pytest.approx(0.62)
    assert fit.interval is None and fit.dof == 0
    assert math.isnan(fit.slope_stderr)


def test_prediction_interval_covers_95_percent_of_new_runs():
    # Monte Carlo: y = 0.7 - 0.01 log2(B) + N(0, 0.01^2) at 4 batch sizes; a new
    # run at B_ref falls inside the 95% interval ~95% of the time (binomial
    # std over 2000 trials: 0.005). A confidence interval of the mean (without
    # the "1 +" term) would cover far less.
    rng = np.random.default_rng(0)
    b = np.array([128, 256, 512, 1024])
    truth = lambda batch: 0.7 - 0.01 * np.log2(batch)  # noqa: E731
    hits = 0
    trials = 2000
    for _ in range(trials):
        y = truth(b) + rng.normal(0, 0.01, b.size)
        fit = scaling_law.fit_scaling_law(b, y, reference_batch_size=B_REF)
        new_run = truth(B_REF) + rng.normal(0, 0.01)
        hits += fit.interval[0] <= new_run <= fit.interval[1]
    assert 0.93 <= hits / trials <= 0.97


@pytest.mark.parametrize(
    "batch_sizes, accuracies, match",
    [
        ([512, 512, 512], [0.6, 0.61, 0.62], "at least 2 distinct batch sizes"),
        ([], [], "at least 2 distinct batch sizes"),
        ([128, 256], [0.6], "same length"),
        ([0, 256], [0.6, 0.5], "batch sizes must be finite and > 0"),
        ([128, 256], [0.6, float("nan")], "accuracies must be finite"),
    ],
)
def test_fit_rejects_bad_input(batch_sizes, accuracies, match):
    with pytest.raises(ValueError, match=match):
        scaling_law.fit_scaling_law(batch_sizes, accuracies, reference_batch_size=B_REF)


def _fake_run(batch_size, noise_multiplier, num_steps=NUM_STEPS, name=None):
    return scaling_law.RunSummary(
        name=name or f"b{batch_size}",
        batch_size=batch_size,
        noise_multiplier=noise_multiplier,
        num_steps=num_steps,
        num_examples=NUM_EXAMPLES,
        final_accuracy=0.5,
        max_accuracy=0.5,
    )


def test_group_runs_by_eta_step_within_tolerance_and_by_num_steps():
    family = [_fake_run(b, 3.0 * b / B_REF) for b in (1024, 128, 512)]
    # eta_step 5e-4 (relative) away: same group at rel_tol 1e-3.
    close = _fake_run(256, 3.0 * 256 / B_REF / (1 + 5e-4), name="close")
    # eta_step 1% away, or same eta_step at other num_steps: separate groups.
    far = _fake_run(256, 3.0 * 256 / B_REF / 1.01, name="far")
    other_steps = _fake_run(256, 3.0 * 256 / B_REF, num_steps=1000, name="steps1000")
    groups = scaling_law.group_runs([*family, close, far, other_steps], rel_tol=1e-3)
    names = [[r.name for r in g] for g in groups]
    assert names == [["steps1000"], ["b128", "close", "b512", "b1024"], ["far"]]
    with pytest.raises(ValueError, match="rel_tol"):
        scaling_law.group_runs(family, rel_tol=-1)


def test_fit_cli_recovers_slope_per_group_and_writes_png_and_table(tmp_path, capsys):
    batch_sizes = (128, 256, 512, 1024)
    noise = (0.002, -0.001, -0.002, 0.001)
    group_a = _scaling_family(
        tmp_path, prefix="a", sigma_ref=3.0, intercept=0.80, slope=-0.015, noise=noise,
        batch_sizes=batch_sizes,
    )
    group_b = _scaling_family(
        tmp_path, prefix="b", sigma_ref=6.0, intercept=0.60, slope=0.0, noise=noise,
        batch_sizes=batch_sizes,
    )
    # The reference run itself (B = B_REF, sigma_ref = 3): held out of the fit of group a.
    reference = _write_run(
        tmp_path / "a_ref", batch_size=B_REF, noise_multiplier=3.0, accuracies=[0.62]
    )
    out = str(tmp_path / "plots" / "law")
    status, stdout, stderr = _main(
        ["fit", *group_a, *group_b, reference, "--reference_batch_size", str(B_REF),
         "--out", out],
        capsys,
    )
    assert status == 0, stderr
    assert _png_size(out + ".png") == (500, 350)
    with open(out + ".txt") as f:
        table = f.read()
    assert table == stdout[: len(table)]
    assert "log2(batch_size)" in table and "final test accuracy" in table

    # Independent check: numpy's least squares on (log2 B, final accuracy).
    x = np.log2(batch_sizes)
    slopes = [float(s) for s in re.findall(r"slope = ([-+0-9.]+) per doubling", table)]
    intercepts = [float(s) for s in re.findall(r"intercept = ([-0-9.]+)", table)]
    predictions = [float(s) for s in re.findall(r"B_ref = 4096: accuracy ([0-9.]+)", table)]
    # Group order: eta_step = B_ref / (sqrt(2) N sigma_ref) is smaller for sigma_ref = 6.
    expected_b = np.polyfit(x, 0.60 + np.array(noise), 1)
    expected_a = np.polyfit(x, 0.80 - 0.015 * x + np.array(noise), 1)
    assert slopes == pytest.approx([expected_b[0], expected_a[0]], abs=1e-4)
    assert intercepts == pytest.approx([expected_b[1], expected_a[1]], abs=1e-4)
    # Recovered within the noise: slope -0.015 and 0 per doubling.
    assert slopes[1] == pytest.approx(-0.015, abs=0.002)
    assert slopes[0] == pytest.approx(0.0, abs=0.002)
    assert intercepts[1] == pytest.approx(0.80, abs=0.02)
    # At B_ref = 2^12: 0.80 - 0.015 * 12 = 0.62 (group a), 0.60 (group b).
    assert predictions == pytest.approx([0.60, 0.62], abs=0.01)
    assert table.count("95% prediction interval") == 2
    assert "observed at B_ref: a_ref accuracy 0.6200 (inside the interval)" in table
    eta_a = B_REF / (math.sqrt(2) * NUM_EXAMPLES * 3.0)
    assert f"eta_step = {eta_a:.4g}, num_steps = 2500" in table
    assert "group 3" not in table


def test_fit_metric_max_uses_best_evaluation(tmp_path, capsys):
    workdirs = _scaling_family(
        tmp_path, prefix="a", sigma_ref=3.0, intercept=0.80, slope=-0.015, noise=(0, 0, 0),
        batch_sizes=(256, 512, 1024),
    )
    out = str(tmp_path / "law")
    status, stdout, _ = _main(
        ["fit", *workdirs, "--reference_batch_size", "4096", "--out", out, "--metric", "max"],
        capsys,
    )
    assert status == 0
    assert "maximum test accuracy over evaluations" in stdout
    # The best evaluation is final + 0.05: prediction 0.80 - 0.18 + 0.05 = 0.67,
    # exact data so the interval has zero width.
    assert "B_ref = 4096: accuracy 0.6700, 95% prediction interval [0.6700, 0.6700]" in stdout


def test_fit_with_two_batch_sizes_says_there_is_no_interval(tmp_path, capsys):
    workdirs = _scaling_family(
        tmp_path, prefix="a", sigma_ref=3.0, intercept=0.80, slope=-0.01, noise=(0, 0),
        batch_sizes=(256, 1024),
    )
    status, stdout, _ = _main(
        ["fit", *workdirs, "--reference_batch_size", "4096", "--out", str(tmp_path / "law")],
        capsys,
    )
    assert status == 0
    assert "no 95% prediction interval: 2 runs leave no degree of freedom" in stdout
    assert os.path.getsize(str(tmp_path / "law.png")) > 0


def test_fit_reference_batch_size_defaults_to_the_simulated_reference(tmp_path, capsys):
    simulation = {"reference": "ref", "reference_batch_size": 2048,
                  "reference_noise_multiplier": 3.0, "reference_epsilon": 8.0}
    workdirs = [
        _write_run(tmp_path / f"r{b}", batch_size=b, noise_multiplier=3.0 * b / 2048,
                   accuracies=[0.5 + 0.01 * math.log2(b)], simulation=simulation)
        for b in (128, 256, 512)
    ]
    status, stdout, stderr = _main(["fit", *workdirs, "--out", str(tmp_path / "law")], capsys)
    assert status == 0, stderr
    # 0.5 + 0.01 * log2(2048) = 0.61.
    assert "prediction at B_ref = 2048: accuracy 0.6100" in stdout


def test_operative_config_fallback_and_skipped_runs(tmp_path, capsys):
    def config(noise="{sigma!r}", steps=NUM_STEPS):
        return (
            "# Macros:\n"
            "BATCH_SIZE = {b}\n"
            f"NOISE_MULTIPLIER = {noise}\n"
            f"NUM_EXAMPLES = {NUM_EXAMPLES}\n"
            f"NUM_STEPS = {steps}\n\n"
            "tfdp.OptimizationConfig.batch_size = %BATCH_SIZE\n"
            "tfdp.train_and_evaluate.model_fn = @tfdp.models.build_tramer_cnn\n"
        )

    workdirs = []
    for b in (256, 512):
        sigma = 3.0 * b / B_REF
        workdirs.append(
            _write_run(tmp_path / f"cfg{b}", batch_size=b, noise_multiplier=sigma,
                       accuracies=[0.7 - 0.01 * math.log2(b)], report=False,
                       config_text=config().format(b=b, sigma=sigma))
        )
    with_report = _write_run(tmp_path / "rep1024", batch_size=1024,
                             noise_multiplier=3.0 * 1024 / B_REF, accuracies=[0.6])
    # Stopped at step 1250 of NUM_STEPS = 2500 (its metrics end at its own 1250).
    unfinished = _write_run(tmp_path / "unfinished", batch_size=128, noise_multiplier=0.09375,
                            accuracies=[0.5], num_steps=1250, report=False,
                            config_text=config(steps=NUM_STEPS).format(b=128, sigma=0.09375))
    calibrated = _write_run(tmp_path / "calibrated", batch_size=128, noise_multiplier=1.0,
                            accuracies=[0.5], report=False,
                            config_text=config(noise="None").format(b=128))
    nothing = _write_run(tmp_path / "nothing", batch_size=128, noise_multiplier=1.0,
                         accuracies=[0.5], report=False)
    runs, skipped = scaling_law.load_runs(
        [*workdirs, with_report, unfinished, calibrated, nothing, str(tmp_path / "missing")]
    )
    assert [(r.name, r.source, r.batch_size, r.num_steps) for r in runs] == [
        ("cfg256", "operative_config.gin", 256, NUM_STEPS),
        ("cfg512", "operative_config.gin", 512, NUM_STEPS),
        ("rep1024", "privacy_report.json", 1024, NUM_STEPS),
    ]
    reasons = dict((os.path.basename(w), r) for w, r in skipped)
    assert "did not finish" in reasons["unfinished"] and "1250 < NUM_STEPS = 2500" in (
        reasons["unfinished"])
    assert "NOISE_MULTIPLIER" in reasons["calibrated"]
    assert "neither privacy_report.json nor operative_config.gin" in reasons["nothing"]
    assert "metrics.jsonl does not exist" in reasons["missing"]

    status, stdout, stderr = _main(
        ["fit", *workdirs, with_report, unfinished, "--reference_batch_size", "4096",
         "--out", str(tmp_path / "law")],
        capsys,
    )
    assert status == 0
    assert "warning: skipping" in stderr and "unfinished" in stderr
    assert "3 runs at 3 batch sizes" in stdout


def test_fit_errors_exit_2(tmp_path, capsys):
    # No usable run.
    empty = tmp_path / "empty"
    empty.mkdir()
    status, _, stderr = _main(
        ["fit", str(empty), "--reference_batch_size", "4096", "--out", str(tmp_path / "x")],
        capsys,
    )
    assert status == 2
    assert "error: none of the workdirs holds a usable finished run" in stderr
    # One batch size only (two seeds): the fit needs 2.
    workdirs = [
        _write_run(tmp_path / f"seed{i}", batch_size=256, noise_multiplier=0.1875,
                   accuracies=[0.6 + 0.01 * i])
        for i in range(2)
    ]
    status, stdout, stderr = _main(
        ["fit", *workdirs, "--reference_batch_size", "4096", "--out", str(tmp_path / "y")],
        capsys,
    )
    assert status == 2
    assert "no fit: the scaling-law fit needs runs at at least 2 distinct batch sizes" in stdout
    assert "error: no group could be fitted" in stderr
    # No --reference_batch_size and no simulation metadata.
    status, _, stderr = _main(["fit", *workdirs, "--out", str(tmp_path / "z")], capsys)
    assert status == 2 and "pass --reference_batch_size" in stderr


def test_curve_writes_accuracy_against_epsilon(tmp_path, capsys):
    workdir = _write_run(tmp_path / "run", batch_size=256, noise_multiplier=1.0,
                         accuracies=[0.3, 0.5, 0.6, 0.65])
    out = str(tmp_path / "curve")
    status, stdout, stderr = _main(["curve", workdir, "--out", out], capsys)
    assert status == 0, stderr
    assert _png_size(out + ".png") == (500, 350)
    # 4 evaluations, epsilon 0.5 * (i + 1): the last is at epsilon 2.
    assert "4 evaluations; last: step 2500, epsilon 2, test_accuracy 0.6500" in stdout


def test_curve_errors_exit_2(tmp_path, capsys):
    status, _, stderr = _main(["curve", str(tmp_path / "nope"), "--out", str(tmp_path / "c")],
                              capsys)
    assert status == 2 and "metrics.jsonl does not exist" in stderr
    workdir = tmp_path / "noacc"
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_text(json.dumps({"step": 10, "epsilon": 1.0}) + "\n")
    status, _, stderr = _main(["curve", str(workdir), "--out", str(tmp_path / "c")], capsys)
    assert status == 2 and "no evaluation in metrics.jsonl has both" in stderr


@pytest.mark.slow
def test_script_runs_from_another_directory(tmp_path):
    workdirs = _scaling_family(
        tmp_path, prefix="a", sigma_ref=3.0, intercept=0.80, slope=-0.015, noise=(0, 0, 0),
        batch_sizes=(128, 256, 512),
    )
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    result = subprocess.run(
        [sys.executable, SCRIPT, "fit", *workdirs, "--reference_batch_size", "4096",
         "--out", "law"],
        capture_output=True, text=True, check=False, cwd=cwd, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "slope = -0.0150 per doubling" in result.stdout
    assert (cwd / "law.png").is_file() and (cwd / "law.txt").is_file()


def test_a_non_private_run_is_no_point_of_the_law(tmp_path):
    workdir = tmp_path / "ceiling"
    _write_run(str(workdir), batch_size=B_REF, noise_multiplier=3.0, accuracies=[0.9])
    scaling_law.load_run(str(workdir))  # a private run loads
    (workdir / "NOT_PRIVATE.json").write_text(json.dumps({"privacy": "NOT PRIVATE"}))
    with pytest.raises(ValueError, match="holds a NOT PRIVATE run"):
        scaling_law.load_run(str(workdir))
