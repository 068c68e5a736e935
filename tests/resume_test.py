"""Preemption and determinism of real training processes (`python -m tfdp.main`).

One configuration, run as separate processes on TFDS mock data, with static
batches ("auto"), checkpoints every 2 steps, EMA, augmult and op determinism
(`tests/multi_worker_test.py` runs the same machinery with 2 replicas):

* A and B: uninterrupted runs with the same fixed seeds -> identical weights
  (determinism);
* C: paused after step 5 (of 6; checkpoints at steps 2 and 4), SIGKILLed,
  then restarted with the same command -> the same final step, epsilon,
  privacy record, noise-generator state and weights as A;
* D: secret seeds (no seed fixed), paused after step 1, before its first
  interval, SIGKILLed and restarted -> it resumes from the checkpoint written
  before step 1 with the same secret sampling seed and noise state.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

NUM_STEPS, PAUSE_AT = 6, 5

_WRAPPER = r'''
import os, sys, time
pause_at = int(os.environ.get("TFDP_TEST_PAUSE_AT_STEP", "0"))
if pause_at:  # stop (and wait to be killed) right after update `pause_at`
    from tfdp.training import callbacks
    original = callbacks.ProgressLog.on_train_batch_end
    def on_train_batch_end(self, batch, logs=None):
        original(self, batch, logs)
        if int(self.model.optimizer.iterations.numpy()) == pause_at:
            open(os.environ["TFDP_TEST_PAUSED_FILE"], "w").close()
            time.sleep(600)
    callbacks.ProgressLog.on_train_batch_end = on_train_batch_end
from tfdp import data
with data.mock_data(num_examples=64):
    from tfdp import main
    sys.argv = ["tfdp.main"] + sys.argv[1:]
    main.run()
'''

_PARAMS = [
    "NUM_EXAMPLES = 64", "BATCH_SIZE = 16", f"NUM_STEPS = {NUM_STEPS}",
    "TARGET_EPSILON = None", "NOISE_MULTIPLIER = 1.0",  # no calibration: faster
    "tfdp.EvaluationConfig.eval_every_steps = 4",
    "tfdp.RuntimeConfig.checkpoint_every_steps = 2",
    "tfdp.RuntimeConfig.static_batch_size = 'auto'",
    "tfdp.RuntimeConfig.deterministic = True",
    "tfdp.PrivacyConfig.noise_seed = 7",
    "tfdp.PrivacyConfig.sampling_seed = 5",
    "tfdp.OptimizationConfig.ema_decay = 0.9",
    "tfdp.AugmentationConfig.augmentation = 'mnist_crop'",
    "tfdp.AugmentationConfig.augmult = 2",
]


_SECRET = [p for p in _PARAMS if "_seed" not in p]


def _command(wrapper, workdir, params):
    return [sys.executable, str(wrapper), f"--workdir={workdir}",
            "--gin_file=fashion_mnist.gin", "--gin_file=smoke.gin",
            *[f"--gin_param={p}" for p in params]]


def _start(wrapper, workdir, params=_PARAMS, **env):
    return subprocess.Popen(_command(wrapper, workdir, params), env={**os.environ, **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _finish(proc):
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]


def _checkpoint(workdir):
    """{name: value} of every variable in the run's latest checkpoint."""
    path = tf.train.latest_checkpoint(str(workdir / "checkpoints"))
    reader = tf.train.load_checkpoint(path)
    return path, {name: reader.get_tensor(name)
                  for name in reader.get_variable_to_shape_map()
                  if name.endswith("VARIABLE_VALUE")}


def _kill_at_pause(proc, paused):
    deadline = time.time() + 300
    while not paused.exists():
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.time() < deadline, "the run to be killed never reached its pause"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs A, B, C and D side by side; kills C and D at their pauses and restarts them."""
    root = tmp_path_factory.mktemp("runs")
    wrapper = root / "run_tfdp.py"
    wrapper.write_text(_WRAPPER)
    procs = {name: _start(wrapper, root / name) for name in ("a", "b")}
    killed = _start(wrapper, root / "c", TFDP_TEST_PAUSE_AT_STEP=str(PAUSE_AT),
                    TFDP_TEST_PAUSED_FILE=str(root / "paused_c"))
    secret = _start(wrapper, root / "d", _SECRET, TFDP_TEST_PAUSE_AT_STEP="1",
                    TFDP_TEST_PAUSED_FILE=str(root / "paused_d"))
    _kill_at_pause(killed, root / "paused_c")
    interrupted = {
        "returncode": killed.returncode,
        "checkpoint": tf.train.latest_checkpoint(str(root / "c" / "checkpoints")),
        "report_exists": (root / "c" / "privacy_report.json").exists(),
    }
    _kill_at_pause(secret, root / "paused_d")
    interrupted["secret"] = _checkpoint(root / "d")
    for proc in procs.values():
        _finish(proc)
    _finish(_start(wrapper, root / "c"))  # the same command again
    _finish(_start(wrapper, root / "d", _SECRET))
    return root, interrupted


def _report(workdir):
    return json.loads((workdir / "privacy_report.json").read_text())


@pytest.mark.slow  # end to end (tests/run_slow.sh); the default suite has the resume of
# the streams (tests/data/stream_resume_test.py, sampling_test, views_test)
def test_two_deterministic_runs_give_identical_weights(runs):
    root, _ = runs
    path_a, a = _checkpoint(root / "a")
    path_b, b = _checkpoint(root / "b")
    assert os.path.basename(path_a) == os.path.basename(path_b) == f"ckpt-{NUM_STEPS}"
    weights = [name for name in a if "_trainable_variables/" in name]
    assert len(weights) == 8  # the CNN's kernels and biases
    assert len([name for name in a if "ema_state/" in name]) == 8  # and their EMA
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.slow
def test_killed_run_resumes_to_the_uninterrupted_result(runs):
    root, interrupted = runs
    assert interrupted["returncode"] == -signal.SIGKILL
    # Killed after step 5: the last checkpoint is step 4, and no report yet.
    assert os.path.basename(interrupted["checkpoint"]) == "ckpt-4"
    assert not interrupted["report_exists"]

    a, c = _report(root / "a"), _report(root / "c")
    assert c["steps"] == a["steps"] == NUM_STEPS
    assert c["epsilon"] == a["epsilon"] > 0
    assert c["truncation"] == a["truncation"]
    assert c["truncation"]["static_batch_size"] > 16  # above the expected batch
    assert c["delta"] == c["truncation"]["delta_with_truncation"] <= 1.1 * c["accountant_delta"]

    _, ledger_a = _checkpoint(root / "a")
    path_c, ledger_c = _checkpoint(root / "c")
    assert os.path.basename(path_c) == f"ckpt-{NUM_STEPS}"
    key = "ledger/{}/.ATTRIBUTES/VARIABLE_VALUE"
    assert ledger_c[key.format("steps")] == NUM_STEPS
    assert ledger_c[key.format("epsilon")] == pytest.approx(a["epsilon"], rel=1e-12)
    # Everything in the final checkpoint matches: model, EMA, optimizer, the
    # privacy record and the noise generator's state (the resumed run continued
    # the same noise stream: steps 5-6 replayed with the same batches and the
    # same noise, nothing drawn twice for different data).
    assert ledger_a.keys() == ledger_c.keys()
    assert any(name.startswith("noise_generator/") for name in ledger_c)
    for name in ledger_a:
        np.testing.assert_array_equal(ledger_a[name], ledger_c[name], err_msg=name)

    steps = [json.loads(line)["step"]
             for line in (root / "c" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [4, NUM_STEPS]  # evaluations at 4 and at the end, none repeated


def test_checkpoint_holds_the_ema_and_a_restore_brings_it_back(tmp_path):
    import keras  # pylint: disable=g-import-not-at-top

    from tfdp import accounting  # pylint: disable=g-import-not-at-top
    from tfdp.training.dp_model import DPModel  # pylint: disable=g-import-not-at-top

    mechanism = accounting.DPMechanism(num_examples=100, batch_size=4, num_steps=10,
                                       noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5)

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        dp = DPModel(keras.Model(inputs, keras.layers.Dense(3)(inputs)), mechanism,
                     ema_decay=0.5, noise_seed=1)
        dp.compile(optimizer=keras.optimizers.SGD(1.0))
        return dp

    dp = build()
    dp.train_step((tf.ones([2, 4]), tf.constant([0, 1])))
    saved = [e.numpy().copy() for e in dp.ema_variables]
    path = tf.train.Checkpoint(model=dp).save(str(tmp_path / "ckpt"))
    restored = build()  # fresh EMA = the initial weights
    assert not np.array_equal(restored.ema_variables[0].numpy(), saved[0])
    tf.train.Checkpoint(model=restored).restore(path).assert_existing_objects_matched()
    for e, value in zip(restored.ema_variables, saved):
        np.testing.assert_array_equal(e.numpy(), value)


@pytest.mark.slow
def test_secret_seeds_survive_a_kill_before_the_first_interval(runs):
    root, interrupted = runs
    path, before = interrupted["secret"]
    assert os.path.basename(path) == "ckpt-0"  # written before step 1
    _, after = _checkpoint(root / "d")
    key = "ledger/{}/.ATTRIBUTES/VARIABLE_VALUE"
    assert after[key.format("steps")] == NUM_STEPS
    assert after[key.format("noise_seed")] == -1  # drawn from OS entropy, not fixed
    assert after[key.format("sampling_seed")] == before[key.format("sampling_seed")]
    _, fixed = _checkpoint(root / "a")
    assert after[key.format("sampling_seed")] != fixed[key.format("sampling_seed")]
    report = _report(root / "d")
    assert report["seeds"]["sampling_seed"].startswith("secret")
