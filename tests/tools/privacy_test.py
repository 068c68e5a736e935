"""Tests of tools/privacy.py.

Each subcommand runs once end to end as a subprocess (sys.executable, from
another cwd, --json, last line parsed); variants and error cases call the
script's main(argv) in-process to keep the suite fast.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest

from tfdp import accounting

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "tools",
    "privacy.py",
)


_spec = importlib.util.spec_from_file_location("privacy_cli", SCRIPT)
privacy_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(privacy_cli)


def _run(args, cwd):
    return subprocess.run(
        [sys.executable, SCRIPT, *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
        timeout=300,
    )


def _json(args, cwd):
    result = _run([*args, "--json"], cwd)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), result


def _main(args, capsys):
    """Runs main(args) in-process; returns (status, stdout, stderr)."""
    status = privacy_cli.main(args)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _main_json(args, capsys):
    status, out, err = _main([*args, "--json"], capsys)
    assert status == 0, err
    return json.loads(out.strip().splitlines()[-1]), out


CIFAR = ["--num_examples", "50000", "--delta", "1e-5"]


EPSILON_ARGS = [
    "epsilon",
    *CIFAR,
    "--batch_size",
    "4096",
    "--noise_multiplier",
    "3",
    "--steps",
    "1843",
]


def test_epsilon_subprocess(tmp_path):
    out, result = _json(EPSILON_ARGS, tmp_path)
    # De et al. 2022, Table 12, eps=6 row.
    assert out["epsilon"] == pytest.approx(5.952, abs=1e-3)
    assert out["sampling_prob"] == 0.08192
    assert (
        "epsilon = 5.952 at delta = 1e-05 after 1843 steps (RDP, Poisson " "sampling q=0.08192"
    ) in result.stdout


def test_epsilon_pld_and_text(capsys):
    pld, _ = _main_json([*EPSILON_ARGS, "--accountant", "pld"], capsys)
    assert pld["epsilon"] == pytest.approx(
        accounting.compute_epsilon(
            noise_multiplier=3.0,
            sampling_prob=0.08192,
            num_steps=1843,
            delta=1e-5,
            accountant="pld",
        )
    )
    status, out, _ = _main(EPSILON_ARGS, capsys)
    assert status == 0
    assert out.startswith("epsilon = 5.952 at delta = 1e-05 after 1843 steps")
    assert "{" not in out  # No JSON without --json.


@pytest.mark.slow
def test_calibrate_noise_multiplier(tmp_path):
    out, _ = _json(
        ["calibrate", *CIFAR, "--batch_size", "4096", "--steps", "2468", "--target_epsilon", "8"],
        tmp_path,
    )
    assert out["noise_multiplier"] == pytest.approx(2.714, abs=2e-3)
    assert out["epsilon"] <= 8


def test_calibrate_steps(capsys):
    out, _ = _main_json(
        [
            "calibrate",
            *CIFAR,
            "--batch_size",
            "4096",
            "--noise_multiplier",
            "3",
            "--target_epsilon",
            "8",
        ],
        capsys,
    )
    assert out["num_steps"] == 3066  # See accountant_test, Table 12 eps=8 row.


def test_calibrate_batch_size(capsys):
    out, _ = _main_json(
        [
            "calibrate",
            *CIFAR,
            "--noise_multiplier",
            "3",
            "--steps",
            "2468",
            "--target_epsilon",
            "8",
        ],
        capsys,
    )
    assert out["batch_size"] == accounting.calibrate_batch_size(
        target_epsilon=8, noise_multiplier=3.0, num_steps=2468, num_examples=50000, delta=1e-5
    )


@pytest.mark.parametrize(
    "extra",
    [
        [],  # Nothing to solve for... all three missing.
        ["--batch_size", "4096", "--noise_multiplier", "3", "--steps", "10"],
    ],
)
def test_calibrate_ambiguous_arguments(capsys, extra):
    status, _, err = _main(["calibrate", *CIFAR, "--target_epsilon", "8", *extra], capsys)
    assert status == 2
    assert ("solves for exactly one of --noise_multiplier, --steps, " "--batch_size") in err


def test_tan(tmp_path):
    out, _ = _json(
        [
            "tan",
            "--num_examples",
            "1271167",
            "--batch_size",
            "16384",
            "--noise_multiplier",
            "2.5",
            "--steps",
            "71589",
            "--delta",
            "8e-7",
        ],
        tmp_path,
    )
    assert out["eta"] == pytest.approx(0.9754, abs=1e-4)
    assert out["total_amount_of_noise"] == pytest.approx(1 / out["eta"])
    assert out["epsilon_tan"] == pytest.approx(8.261, abs=1e-3)
    assert out["epsilon_rdp"] == pytest.approx(8.0, abs=1e-3)
    assert out["epsilon_pld"] < out["epsilon_rdp"]


def test_simulate(tmp_path):
    out, result = _json(
        [
            "simulate",
            "--num_examples",
            "1271167",
            "--reference_batch_size",
            "16384",
            "--reference_noise_multiplier",
            "2.5",
            "--steps",
            "71589",
            "--batch_size",
            "256",
            "--delta",
            "8e-7",
        ],
        tmp_path,
    )
    assert out["noise_multiplier"] == 2.5 / 64
    assert out["reference_epsilon"] == pytest.approx(8.0, abs=1e-3)
    assert out["simulated_epsilon"] > 1000
    assert out["gin_params"][:3] == [
        "--gin_param=BATCH_SIZE=256",
        "--gin_param=NOISE_MULTIPLIER=0.0390625",
        "--gin_param=NUM_STEPS=71589",
    ]
    assert out["gin_params"][3] == "--gin_param=TARGET_EPSILON=None"
    assert out["gin_params"][4].startswith("--gin_param=tfdp.PrivacyConfig.simulation={")
    assert "NOT private" in result.stdout
    # delta = 8e-7 is just above 1/N = 7.87e-7 (De et al.'s own choice).
    assert "warning: delta=8e-07 >= 1/num_examples" in result.stderr


def test_ledger(tmp_path):
    study = tmp_path / "study"
    for name, sigma, steps in (("a", 3.0, 1843), ("b", 5.0, 1593)):
        accounting.append_run(study, run_name=name, mechanism=accounting.DPMechanism(
            num_examples=50000, batch_size=4096, num_steps=steps, noise_multiplier=sigma,
            l2_clip_norm=1.0, delta=1e-5))
    out, result = _json(["ledger", str(study), "--delta", "1e-5"], tmp_path)
    total, per_run = accounting.study_epsilon(study, delta=1e-5)
    assert out["epsilon"] == pytest.approx(total)
    assert [r["run"] for r in out["runs"]] == ["a", "b"]
    assert out["runs"][0]["epsilon"] == pytest.approx(per_run[0][1])
    assert "run a: epsilon = 5.952" in result.stdout


def test_bad_value_subprocess_exits_2_without_traceback(tmp_path):
    result = _run(
        ["epsilon", *CIFAR, "--batch_size", "4096", "--noise_multiplier", "0", "--steps", "10"],
        tmp_path,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "privacy.py epsilon: error: noise_multiplier must be a finite number "
        "> 0, got 0.0. It is the noise std divided by l2_clip_norm "
        "(dimensionless); 0 would mean no noise and no privacy."
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            [
                "epsilon",
                *CIFAR,
                "--batch_size",
                "60000",
                "--noise_multiplier",
                "1",
                "--steps",
                "10",
            ],
            "batch_size=60000 is larger than num_examples=50000",
        ),
        (
            [
                "epsilon",
                "--num_examples",
                "50000",
                "--delta",
                "2",
                "--batch_size",
                "10",
                "--noise_multiplier",
                "1",
                "--steps",
                "10",
            ],
            r"delta must be in (0, 1)",
        ),
        (
            [
                "calibrate",
                *CIFAR,
                "--batch_size",
                "4096",
                "--steps",
                "1000000",
                "--target_epsilon",
                "1e-4",
            ],
            "needs noise_multiplier > 10000",
        ),
        (
            ["tan", *CIFAR, "--batch_size", "4096", "--noise_multiplier", "1", "--steps", "0"],
            "num_steps must be an integer >= 1",
        ),
        (
            [
                "simulate",
                *CIFAR,
                "--reference_batch_size",
                "4096",
                "--reference_noise_multiplier",
                "-1",
                "--steps",
                "10",
                "--batch_size",
                "256",
            ],
            "reference_noise_multiplier must be",
        ),
        (["ledger", "does_not_exist", "--delta", "1e-5"], "No ledger at"),
        # A simulation at a LARGER batch used to print "NOT private at epsilon=3: its own
        # epsilon is 2.77", contradicting itself.
        (["simulate", *CIFAR, "--reference_batch_size", "2048", "--reference_noise_multiplier",
          "1.93", "--steps", "10", "--batch_size", "4096"], "is not smaller than"),
        # PLD over 10^9 steps used 12.8 GB and no answer in 90 s: refused at once.
        (["epsilon", *CIFAR, "--batch_size", "2048", "--noise_multiplier", "1.93", "--steps",
          "1000000000", "--accountant", "pld"], "Use the RDP accountant"),
    ],
)
def test_bad_values_return_2_with_one_line_message(capsys, args, message):
    status, _, err = _main(args, capsys)
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"privacy.py {args[0]}: error: ")
    assert message in lines[0]


TINY_NOISE = ["--num_examples", "60000", "--batch_size", "256", "--noise_multiplier", "0.01",
              "--steps", "1000", "--delta", "1e-5"]


def test_pld_at_tiny_noise_is_refused_at_once(tmp_path):
    # Before: nothing printed for 120 s and more (the PLD of one Gaussian at sigma 0.01
    # has ~10^7 privacy-loss points; sigma 0.05 already takes ~2 s a step and GBs).
    start = time.monotonic()
    result = subprocess.run([sys.executable, SCRIPT, "epsilon", *TINY_NOISE, "--accountant",
                             "pld"], capture_output=True, text=True, check=False, cwd=tmp_path,
                            timeout=30)
    seconds = time.monotonic() - start
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("privacy.py epsilon: error: ")
    assert re.search(r"noise_multiplier 0\.01 is below 0\.05, the smallest the PLD accountant "
                     r"takes: .*1 / noise_multiplier\^2.*Use the RDP accountant \(--accountant "
                     r"rdp", lines[0])
    assert result.stdout == "" and seconds < 10


def test_tan_at_tiny_noise_gives_rdp_and_says_why_not_pld(capsys):
    out, text = _main_json(["tan", *TINY_NOISE], capsys)
    assert out["epsilon_pld"] is None and out["epsilon_rdp"] > 1e6
    assert "RDP = 5.44e+06, PLD = not computed at delta" in text
    assert "note: PLD not computed: noise_multiplier 0.01 is below 0.05" in text


@pytest.mark.parametrize("sigma", ["5e-324", "1e-300", "1e300"])
def test_a_noise_multiplier_the_accountant_cannot_hold_is_one_line(capsys, sigma):
    # Before: ZeroDivisionError and OverflowError tracebacks from dp_accounting.
    args = [*EPSILON_ARGS]
    args[args.index("--noise_multiplier") + 1] = sigma
    status, _, err = _main(args, capsys)
    assert status == 2 and "is outside [1e-100, 1e+100]" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_pld_work_it_could_not_finish_is_one_line(capsys):
    args = ["epsilon", *CIFAR, "--batch_size", "200", "--noise_multiplier", "0.06",
            "--steps", "1000000", "--accountant", "pld"]
    status, _, err = _main(args, capsys)
    assert status == 2 and "Use the RDP accountant" in err
