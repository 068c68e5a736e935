"""Reruns of a finished workdir: nothing an earlier run wrote is lost or misreported."""

import json
import os
import shutil

import pytest

PARAMS = ["TARGET_EPSILON = None", "NOISE_MULTIPLIER = 1.0"]
OUTPUTS = ("privacy_report.json", "privacy_report.md", "export/saved_model.pb",
           "metrics.jsonl")


def _snapshot(workdir):
    return {name: os.stat(workdir / name).st_mtime_ns for name in OUTPUTS}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, run_smoke_module):
    """A finished 2-step run (fashion_mnist.gin + smoke.gin on mock data)."""
    workdir = tmp_path_factory.mktemp("finished")
    report = run_smoke_module(workdir, ["fashion_mnist.gin"], PARAMS)
    return workdir, report


@pytest.fixture
def copy(finished, tmp_path):
    workdir = tmp_path / "wd"
    shutil.copytree(finished[0], workdir)
    return workdir


@pytest.mark.parametrize("params, message", [
    # Before: the removal of finished outputs ran before these checks, and deleted
    # privacy_report.{json,md} and export/.
    (["NUM_STEPS = 1"], "This workdir already holds 2 steps"),
    (["tfdp.train_and_evaluate.sampling = 'possion'"], "Unknown sampling scheme"),
    # Before: "Done" with the old report, although the settings were not the ones used.
    (["tfdp.training.build_optimizer.learning_rate = 0.5"],
     r"finished run of 2 steps with other settings.*\n.*- \S*build_optimizer"
     r".learning_rate = 4.0\n.*\+ \S*build_optimizer.learning_rate = 0.5"),
])
def test_a_failed_rerun_changes_nothing(copy, run_smoke, params, message):
    before = _snapshot(copy)
    with pytest.raises(ValueError, match=message):
        run_smoke(copy, ["fashion_mnist.gin"], [*PARAMS, *params])
    assert _snapshot(copy) == before


def test_the_same_command_again_returns_the_finished_report_untouched(copy, finished,
                                                                     run_smoke):
    before = _snapshot(copy)
    report = run_smoke(copy, ["fashion_mnist.gin"], PARAMS)
    assert report == json.loads(json.dumps(finished[1]))
    assert _snapshot(copy) == before


def test_more_steps_extend_the_run(copy, run_smoke):
    report = run_smoke(copy, ["fashion_mnist.gin"], [*PARAMS, "NUM_STEPS = 4"])
    assert report["steps"] == 4
    assert json.loads((copy / "privacy_report.json").read_text())["steps"] == 4
