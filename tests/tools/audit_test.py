"""Tests of tools/audit.py.

`bound` runs once as a subprocess (another cwd, --json last line); the rest
call main(argv) in-process. The `gradient` and `input` subcommands train
fashion_mnist.gin under smoke.gin on TFDS mock data and must leave the audit
in the privacy report.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import gin
import numpy as np
import pytest

from tfdp import data
from tfdp.accounting import audit

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "tools", "audit.py")

_spec = importlib.util.spec_from_file_location("audit_cli", SCRIPT)
audit_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(audit_cli)

SMOKE = ["--gin_file=fashion_mnist.gin", "--gin_file=smoke.gin",
         "--gin_param=NUM_EXAMPLES = 64", "--gin_param=BATCH_SIZE = 16"]


def _main(args, capsys):
    status = audit_cli.main(args)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_bound_subprocess_prints_json_last(tmp_path):
    result = subprocess.run(
        [sys.executable, SCRIPT, "bound", "--num_canaries", "1000", "--num_guesses", "100",
         "--num_correct", "75", "--delta", "1e-4", "--json"],
        capture_output=True, text=True, check=False, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["epsilon_lower_bound"] == pytest.approx(0.673, abs=1e-3)  # App. D
    assert "epsilon >= 0.6730 at 95% confidence" in result.stdout


def test_simulate_reports_the_claim_and_each_audit(capsys):
    status, out, err = _main(
        ["simulate", "--noise_multiplier", "1.391", "--sampling_prob", "1", "--steps", "1",
         "--num_canaries", "2000", "--delta", "1e-5", "--repeats", "2", "--seed", "0",
         "--bug", "noise_halved", "--json"], capsys)
    assert status == 0, err
    payload = json.loads(out.strip().splitlines()[-1])
    assert payload["claimed_epsilon"] == pytest.approx(3.0, abs=0.01)  # PLD, sigma 1.391
    assert len(payload["epsilon_lower_bounds"]) == 2 and payload["bug"] == "noise_halved"
    assert payload["results"][0]["num_canaries"] == 2000


@pytest.mark.parametrize("args, message", [
    (["bound", "--num_canaries", "10", "--num_guesses", "20", "--num_correct", "5",
      "--delta", "1e-5"], "num_correct <= num_guesses <= num_canaries"),
    (["bound", "--num_canaries", "10", "--num_guesses", "5", "--num_correct", "5",
      "--delta", "1e-5", "--beta", "1"], r"beta must be in \(0, 1\)"),
    # Before: "batch_size=2000000000 is larger than num_examples=1000000000", values the
    # user never gave.
    (["simulate", "--noise_multiplier", "1", "--sampling_prob", "2", "--steps", "1",
      "--num_canaries", "10", "--delta", "1e-5"],
     r"sampling_prob must be in \(0, 1\] .*got 2\.0\.$"),
    (["simulate", "--noise_multiplier", "1", "--sampling_prob", "0", "--steps", "1",
      "--num_canaries", "10", "--delta", "1e-5"], r"sampling_prob must be in \(0, 1\]"),
    # Before: 30 s of silence, then exit 0 (q = 1, one step; at q = 0.004 nothing came in
    # 120 s): the PLD accountant's grid grows as 1 / sigma^2.
    (["simulate", "--noise_multiplier", "0.01", "--sampling_prob", "1", "--steps", "1",
      "--num_canaries", "10", "--delta", "1e-5"],
     r"noise_multiplier 0\.01 is below 0\.05, .*Use the RDP accountant \(--accountant rdp"),
])
def test_bad_values_exit_2_with_one_line(args, message, capsys):
    status, out, err = _main(args, capsys)
    assert status == 2 and "Traceback" not in err
    assert err.startswith(f"audit.py {args[0]}: error:") and len(err.strip().splitlines()) == 1
    assert "num_examples" not in err and "batch_size" not in err
    assert re.search(message, err)


def test_a_used_workdir_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    status, _, err = _main(["gradient", *SMOKE, "--workdir", str(tmp_path)], capsys)
    assert status == 2 and "is not empty" in err
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]


def _audit_run(kind, workdir, extra, capsys):
    gin.clear_config()
    try:
        with data.mock_data(num_examples=64):
            status, out, err = _main(
                [kind, *SMOKE, "--workdir", str(workdir), "--seed", "0", "--json", *extra],
                capsys)
    finally:
        gin.clear_config()
    assert status == 0, err
    payload = json.loads(out.strip().splitlines()[-1])
    report = json.loads((workdir / "privacy_report.json").read_text())
    card = (workdir / "privacy_report.md").read_text()
    assert report["audit"] == payload
    assert "## Empirical audit" in card and f"tools/audit.py {kind}" in card
    assert payload["claimed_epsilon"] == pytest.approx(report["epsilon"])
    assert payload["delta"] == report["delta"] and payload["beta"] == 0.05
    assert 0 <= payload["num_correct"] <= payload["num_guesses"] <= payload["num_canaries"]
    assert payload["epsilon_lower_bound"] == audit.epsilon_lower_bound(
        payload["num_canaries"], payload["num_guesses"], payload["num_correct"],
        delta=payload["delta"], beta=payload["beta"] / payload["num_candidates"])
    return payload, report


@pytest.mark.slow
def test_gradient_audit_of_a_smoke_run_fills_the_report(tmp_path, capsys):
    payload, _ = _audit_run("gradient", tmp_path, ["--num_canaries", "50"], capsys)
    assert payload["num_canaries"] == 50 and "dedicated" in payload["canaries"]


@pytest.mark.slow
def test_input_audit_trains_on_the_included_canaries(tmp_path, capsys):
    payload, report = _audit_run("input", tmp_path, ["--num_canaries", "20"], capsys)
    # N' = 64 - 20 canary originals + the included canaries, and the report says so.
    assert report["num_examples"] == 64 - 20 + payload["num_included"]
    assert "mislabelled" in payload["canaries"]


def test_too_many_canaries_are_refused_before_any_allocation(capsys):
    # Before: numpy's _ArrayMemoryError "Unable to allocate 7.28 TiB", as a traceback.
    status, _, err = _main(["simulate", "--noise_multiplier", "2", "--sampling_prob", "1",
                            "--steps", "1", "--num_canaries", "1000000000000", "--delta",
                            "1e-5"], capsys)
    assert status == 2, err
    assert re.search(r"audit.py simulate: error: 1,000,000,000,000 canaries would need about "
                     r"64\.0 TB of memory \(64 bytes per canary: its coin, score and rank\), "
                     r"and [\d.]+ [GMT]B is available\. Use at most about [\d,]+ canaries", err)
    with pytest.raises(ValueError, match=r"1,000,000 canaries would need about 64.0 MB .* and "
                                         r"1.0 MB is available\. Use at most about 15,625"):
        audit.check_canary_memory(10**6, available_bytes=10**6)
    audit.check_canary_memory(10**4, available_bytes=10**6)  # 640 kB fits


def _run_cli(args, *, timeout):
    """Runs the CLI as a user would; returns (result, wall seconds)."""
    start = time.monotonic()
    result = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                            check=False, timeout=timeout)
    return result, time.monotonic() - start


def test_a_bound_on_10_to_the_12_counts_is_refused_at_once():
    # Before: a traceback, numpy's "Unable to allocate 7.28 TiB" (the p-value summed
    # num_correct binomial terms at once). Now a refusal that says the limit and why.
    big = str(10**12)
    result, seconds = _run_cli(["bound", "--num_canaries", big, "--num_guesses", big,
                                "--num_correct", big, "--delta", "1e-5"], timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert re.search(r"^audit.py bound: error: num_correct = 1,000,000,000,000 is more than "
                     r"10,000,000, the most the bound handles: .* about a minute.*40\.0 TB",
                     result.stderr)
    assert seconds < 10
    with pytest.raises(ValueError, match="the most the bound handles"):
        audit.epsilon_lower_bound(10**8, 10**8, 10**7 + 1, delta=1e-5, beta=0.05)


def test_simulate_with_10_to_the_12_repeats_is_refused_after_timing_one():
    # Before: silent, for ever (one audit of 2,000 canaries takes ~0.1 s). Now the first
    # audit is timed and the run refused when the whole would exceed --max_seconds.
    result, seconds = _run_cli(
        ["simulate", "--noise_multiplier", "2", "--sampling_prob", "1", "--steps", "1",
         "--num_canaries", "2000", "--delta", "1e-5", "--seed", "0",
         "--repeats", str(10**12)], timeout=30)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert re.search(r"^audit.py simulate: error: 1,000,000,000,000 audits of 2,000 canaries "
                     r"would take about .* \(the first took [\d.]+ s\); at most [\d,]+ fit in "
                     r"--max_seconds 600\. Use --repeats [\d,]+ or fewer, or raise --max_seconds",
                     result.stderr)
    assert result.stdout == "" and seconds < 15


def test_simulate_repeats_are_split_at_the_first_without_changing_the_audits(capsys):
    # The first audit is timed apart from the others; the same seed gives the same bounds.
    args = ["simulate", "--noise_multiplier", "2", "--sampling_prob", "1", "--steps", "1",
            "--num_canaries", "500", "--delta", "1e-5", "--seed", "3", "--json"]
    status, out, err = _main([*args, "--repeats", "3"], capsys)
    assert status == 0, err
    bounds = json.loads(out.strip().splitlines()[-1])["epsilon_lower_bounds"]
    mechanism = audit.simulated_mechanism(sampling_prob=1.0, num_steps=1, delta=1e-5,
                                          noise_multiplier=2.0)
    expected = audit.simulate_audits(mechanism, num_canaries=500, repeats=3,
                                     rng=np.random.default_rng(3),
                                     guesses=audit.symmetric_guesses(500))
    assert bounds == [r.epsilon_lower_bound for r in expected]
    status, _, err = _main([*args, "--repeats", "3", "--max_seconds", "0"], capsys)
    assert status == 2 and "--max_seconds must be > 0" in err
