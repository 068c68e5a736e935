"""oneDNN on by default, the user's TF_ENABLE_ONEDNN_OPTS respected, the host line truthful."""

import logging
import os
import re
import subprocess
import sys

import pytest

from tfdp import host

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TF_SAYS_ON = "oneDNN custom operations are on"  # TensorFlow's own log line at import


def _python(code, **env_vars):
    """Runs `code` in a fresh interpreter; TF_ENABLE_ONEDNN_OPTS only as `env_vars` set it."""
    env = {k: v for k, v in os.environ.items()
           if k not in (host.ENV_VAR, host.SET_BY_TFDP_VAR)}
    env.update(env_vars)
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300, cwd=REPO, check=True)


def test_cpu_flags_and_tensorflow_s_default_per_cpu(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some CPU\n"
                       "flags\t\t: fpu sse2 avx avx2 fma\n")
    avx2 = host.cpu_flags(str(cpuinfo))
    assert avx2 == {"fpu", "sse2", "avx", "avx2", "fma"}
    assert host.cpu_class(avx2) == "AVX2"
    assert host.cpu_class(avx2 | {"avx512f"}) == "AVX-512"
    assert host.cpu_class(frozenset()) == "CPU flags unknown"
    assert host.cpu_flags(str(tmp_path / "missing")) == frozenset()
    if sys.platform.startswith("linux"):
        # TensorFlow 2.21 leaves oneDNN off on AVX2-only and plain AVX-512 CPUs.
        assert host.tf_default_onednn(avx2) is False
        assert host.tf_default_onednn(avx2 | {"avx512f"}) is False
        assert host.tf_default_onednn(avx2 | {"avx512f", "avx512_vnni"}) is True
        assert host.tf_default_onednn(avx2 | {"avx_vnni"}) is True
    assert host.tf_default_onednn(frozenset()) is None


def test_import_tfdp_turns_onednn_on_when_the_user_did_not_choose():
    out = _python("import os, tfdp.host as h; print(os.environ['TF_ENABLE_ONEDNN_OPTS']); "
                  "print(h.describe_host())").stdout.splitlines()
    assert out[0] == "1"
    assert "oneDNN on (tfdp set TF_ENABLE_ONEDNN_OPTS=1 before TensorFlow's import" in out[1]
    assert out[1].startswith("host: ") and " cores; " in out[1]


@pytest.mark.parametrize("value", [pytest.param("0", marks=pytest.mark.slow), "false"])
def test_the_user_s_zero_is_respected_and_tensorflow_agrees(value):
    # TensorFlow is imported after tfdp: it reads the variable tfdp left alone.
    done = _python("import os, tfdp, tensorflow; from tfdp import host; "
                   "print(os.environ['TF_ENABLE_ONEDNN_OPTS']); print(host.onednn_enabled()); "
                   "print(host.describe_host())", TF_ENABLE_ONEDNN_OPTS=value)
    out = done.stdout.splitlines()
    assert out[:2] == [value, "False"]
    assert f"oneDNN off (TF_ENABLE_ONEDNN_OPTS={value} set by the user)" in out[2]
    assert TF_SAYS_ON not in done.stderr


def test_a_child_process_still_says_tfdp_chose():
    out = _python("import os, subprocess, sys, tfdp; print(subprocess.run([sys.executable, '-c', "
                  "'import tfdp.host as h; print(h.enable_onednn())'], capture_output=True, "
                  "text=True, check=True).stdout)").stdout
    assert "oneDNN on (TF_ENABLE_ONEDNN_OPTS=1 set by tfdp in a parent process)" in out


@pytest.fixture
def undecided(monkeypatch):
    """`host` as if never called; TensorFlow is already imported in this test process."""
    import tensorflow  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import

    monkeypatch.setattr(host, "_decision", None)
    monkeypatch.delenv(host.ENV_VAR, raising=False)
    monkeypatch.delenv(host.SET_BY_TFDP_VAR, raising=False)
    return monkeypatch


def test_tensorflow_imported_first_with_onednn_off_says_how_to_turn_it_on(undecided, caplog):
    # As on an AVX2-only host (TensorFlow's default: off), which this test cannot get.
    undecided.setattr(host, "onednn_enabled", lambda: False)
    with caplog.at_level(logging.WARNING, logger=host.__name__):
        text = host.enable_onednn()
    assert text.startswith("oneDNN off (TensorFlow was imported before tfdp")
    assert host.ENV_VAR not in os.environ  # too late to set: TensorFlow has read it
    [warning] = [r.getMessage() for r in caplog.records]
    assert "set the environment variable TF_ENABLE_ONEDNN_OPTS=1 before TensorFlow" in warning
    assert host.enable_onednn() == text and len(caplog.records) == 1  # said once


@pytest.mark.parametrize("user_value, on", [(None, True), ("0", False)])
def test_tensorflow_imported_first_is_quiet_when_on_or_chosen(undecided, caplog, user_value, on):
    if user_value is not None:
        undecided.setenv(host.ENV_VAR, user_value)
    undecided.setattr(host, "onednn_enabled", lambda: on)
    with caplog.at_level(logging.WARNING, logger=host.__name__):
        text = host.enable_onednn()
    assert text.startswith(f"oneDNN {'on' if on else 'off'} (TensorFlow was imported before tfdp")
    assert not caplog.records


# Ghost norms against the vectorized per-example path, and each norm rule against its
# reference: a few cases of each (about 10 s) in a fresh process under the OTHER oneDNN
# setting than this one's (TensorFlow reads the variable once, at import), since oneDNN
# rounds differently from Eigen. The full files: TF_ENABLE_ONEDNN_OPTS=0 pytest ...
EQUALITY_TESTS = [
    "tests/dp/ghost_norms_test.py", "tests/training/ghost_clipping_test.py", "-k",
    "(test_norms_and_clipped_sum_equal_the_vectorized_path and None and "
    "(tramer_cnn or tramer_cifar_cnn)) or test_conv2d_kernel or test_ws_kernel_chains"]


@pytest.mark.slow
def test_ghost_norm_equality_holds_under_the_other_onednn_setting():
    other = "0" if host.onednn_enabled() else "1"
    env = dict(os.environ, **{host.ENV_VAR: other, "PYTHONPATH": REPO})
    env.pop(host.SET_BY_TFDP_VAR, None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p",
                           "no:cacheprovider", "-q", *EQUALITY_TESTS], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stdout[-5000:]
    assert int(re.search(r"(\d+) passed", done.stdout).group(1)) >= 20, done.stdout[-2000:]


_SMOKE = """
import sys
from tfdp import data, main
sys.argv = ["tfdp.main", "--gin_file=fashion_mnist.gin", "--gin_file=smoke.gin",
            "--gin_param=NUM_EXAMPLES = 64", "--gin_param=BATCH_SIZE = 16",
            "--workdir=" + sys.argv[1]]
with data.mock_data(num_examples=64):
    main.run()
"""


@pytest.mark.slow
@pytest.mark.parametrize("user_value, expected", [
    (None, "oneDNN on (tfdp set TF_ENABLE_ONEDNN_OPTS=1 before TensorFlow's import"),
    ("0", "oneDNN off (TF_ENABLE_ONEDNN_OPTS=0 set by the user)"),
])
def test_a_smoke_run_logs_the_host_and_onednn_once(tmp_path, user_value, expected):
    env = {} if user_value is None else {host.ENV_VAR: user_value}
    done = _python(_SMOKE.replace("sys.argv[1]", repr(str(tmp_path / "wd"))), **env)
    assert done.stderr.count("host: ") == 1 and expected in done.stderr, done.stderr[-3000:]
    assert (TF_SAYS_ON in done.stderr) == (user_value is None)
    assert os.path.exists(tmp_path / "wd" / "privacy_report.json")
