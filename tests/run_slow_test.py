"""tests/run_slow.sh: which pytest runs its arguments give."""

import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pytest_calls(tmp_path, *args):
    """The argument lists run_slow.sh passes to `python`, with a stub python on PATH."""
    log = tmp_path / "calls"
    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir(parents=True)
    stub.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    stub.chmod(0o755)
    env = dict(os.environ, PATH=f"{stub.parent}{os.pathsep}{os.environ['PATH']}")
    subprocess.run(["bash", os.path.join(REPO, "tests", "run_slow.sh"), *args], env=env,
                   check=True, timeout=60)
    return log.read_text().splitlines()


def test_named_files_run_once_also_after_an_option(tmp_path):
    # An option before the file names used to run the named file three times, beside the
    # two memory-heavy files.
    for args in (["tests/layout_test.py"], ["--durations=5", "tests/layout_test.py"]):
        calls = _pytest_calls(tmp_path / str(len(args)), *args)
        assert calls == ["-m pytest -q -n 2 -m slow " + " ".join(args)]


def test_options_alone_run_everything_in_three_processes(tmp_path):
    calls = _pytest_calls(tmp_path, "--durations=5")
    assert len(calls) == 3 and all("--durations=5" in call for call in calls)
    assert "--ignore=tests/training/dp_step_xla_test.py" in calls[0]
