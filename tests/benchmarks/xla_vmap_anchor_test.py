"""benchmarks/xla_vmap_anchor.py: the reference's vmap step computes tfdp's own models.

The anchor is a JAX program (no TensorFlow): the test needs a side
interpreter with JAX. Set TFDP_JAX_PYTHON (or TFDP_TPU_PYTHON, a venv with
jax[tpu]) to its path, else it is skipped.
"""

import json
import os
import pathlib
import subprocess

import numpy as np
import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "xla_vmap_anchor.py"
JAX_PYTHON = os.environ.get("TFDP_JAX_PYTHON") or os.environ.get("TFDP_TPU_PYTHON")


def _anchor(*args):
    # On the CPU: a jax[tpu] venv would otherwise take libtpu, which one process holds at a time.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [JAX_PYTHON, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, env=env
    )


@pytest.mark.skipif(not JAX_PYTHON, reason="TFDP_JAX_PYTHON (a Python with JAX) not set")
def test_nf_resnet50_anchor_computes_tfdps_logits(tmp_path):
    from tfdp.models import build_nf_resnet  # pylint: disable=g-import-not-at-top

    model = build_nf_resnet(input_shape=(64, 64, 3))
    rng = np.random.default_rng(0)
    # Gains, biases and skip gains away from their initial ones and zeros, so that each of them
    # changes the logits if the anchor dropped or misplaced it.
    for v in model.trainable_variables:
        if v.path.endswith(("/gain", "/skip_gain")):
            v.assign(rng.uniform(0.5, 1.5, v.shape).astype(np.float32))
        elif v.path.endswith("/bias"):
            v.assign(rng.normal(0.0, 0.1, v.shape).astype(np.float32))
    # (Every kernel here has var * fan_in near 1: the standardization's 1e-4 floor is not reached.)
    images = rng.uniform(0.0, 255.0, (2, 64, 64, 3)).astype(np.float32)
    want = np.asarray(model(images), np.float64)
    named = {v.path: np.asarray(v) for v in model.trainable_variables}
    np.savez(tmp_path / "weights.npz", images=images, **named)

    done = _anchor("--model", "nf_resnet50", "--logits", str(tmp_path / "weights.npz"))
    assert done.returncode == 0, done.stderr[-2000:]
    got = np.asarray(json.loads(done.stdout.strip().splitlines()[-1])["logits"])

    assert got.shape == want.shape == (2, 1000)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


@pytest.mark.skipif(not JAX_PYTHON, reason="TFDP_JAX_PYTHON (a Python with JAX) not set")
@pytest.mark.parametrize(
    "model, size, message",
    [
        ("nf_resnet50", 64, "not tfdp's NF-ResNet-50"),  # weights of another model
        ("wrn16_4", 32, "only with --model nf_resnet50"),
    ],
)
def test_logits_refuses(tmp_path, model, size, message):
    np.savez(tmp_path / "weights.npz", images=np.zeros((1, size, size, 3), np.float32))
    done = _anchor("--model", model, "--logits", str(tmp_path / "weights.npz"))
    assert done.returncode != 0
    assert message in done.stderr


@pytest.mark.skipif(not JAX_PYTHON, reason="TFDP_JAX_PYTHON (a Python with JAX) not set")
def test_unknown_model_is_refused():
    done = _anchor("--model", "resnet18", "--target", "cpu", "1")
    assert done.returncode != 0
    assert "use wrn16_4 or nf_resnet50" in done.stderr
