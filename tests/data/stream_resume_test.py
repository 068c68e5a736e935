"""A killed input pipeline resumes with the very batches it would have produced.

Real processes read the Poisson batches of a local ArrayRecord dataset
(`synthetic_imagenet`, conftest.py) and log every batch (its step, labels and
a hash of its decoded pixels). Run A runs all steps. Run B is SIGKILLed right
after logging step 6, then restarted at step 4 (a resume from a checkpoint
older than the kill, which replays steps 4-6): every logged batch equals A's
batch of the same step.
"""

import json
import os
import signal
import subprocess
import sys
import time

NUM_STEPS, KILL_AFTER = 12, 6
# A large seed, like the trainer's secret ones (drawn in [0, 2**63)).
SEED = 6_127_550_012_345_678_901

_SCRIPT = r'''
import hashlib, json, os, sys, time
from tfdp import data
data_dir, log_path, start_step = sys.argv[1], sys.argv[2], int(sys.argv[3])
pause_after = int(os.environ.get("PAUSE_AFTER", "-1"))
source = data.TFDSSource("synthetic_imagenet", "train", data_dir=data_dir, image_size=32)
batches = data.train_batches(source, sampling="poisson", batch_size=8, num_steps=NUM_STEPS,
                             seed=SEED, start_step=start_step)
with open(log_path, "a") as log:
    for step, (images, labels) in enumerate(batches.as_numpy_iterator(), start=start_step):
        log.write(json.dumps({"step": step, "labels": labels.tolist(),
                              "pixels": hashlib.sha256(images.tobytes()).hexdigest()}) + "\n")
        log.flush()
        if step == pause_after:
            open(log_path + ".paused", "w").close()
            time.sleep(600)  # wait to be killed
'''.replace("NUM_STEPS", str(NUM_STEPS)).replace("SEED", str(SEED))


def _start(script, data_dir, log, start_step, **env):
    return subprocess.Popen([sys.executable, str(script), str(data_dir), str(log), str(start_step)],
                            env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc):
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]


def _read(log):
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_batches_after_a_kill_equal_the_uninterrupted_ones(tmp_path, synthetic_imagenet_dir):
    script = tmp_path / "stream.py"
    script.write_text(_SCRIPT)
    full, killed = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    run_a = _start(script, synthetic_imagenet_dir, full, 0)
    run_b = _start(script, synthetic_imagenet_dir, killed, 0, PAUSE_AFTER=str(KILL_AFTER))
    paused = tmp_path / "b.jsonl.paused"
    deadline = time.time() + 300
    while not paused.exists():
        assert run_b.poll() is None, run_b.communicate()[1][-3000:]
        assert time.time() < deadline, "the run to be killed never reached its pause"
        time.sleep(0.2)
    os.kill(run_b.pid, signal.SIGKILL)
    run_b.communicate(timeout=60)
    assert run_b.returncode == -signal.SIGKILL
    _finish(run_a)
    before_kill = _read(killed)
    assert [r["step"] for r in before_kill] == list(range(KILL_AFTER + 1))

    # The resume starts from an older checkpoint (step 4 < 7): the replayed steps get the
    # same batches, not new ones, and so do the steps the killed run never reached.
    resume_at = 4
    _finish(_start(script, synthetic_imagenet_dir, killed, resume_at))
    expected = _read(full)
    assert [r["step"] for r in expected] == list(range(NUM_STEPS))
    assert _read(killed) == expected[:KILL_AFTER + 1] + expected[resume_at:]
    assert len({len(r["labels"]) for r in expected}) > 1  # Poisson: the sizes vary
