"""Two `multi_worker_mirrored` workers on 127.0.0.1 train one job together.

Each worker is a real `python -m tfdp.main` process (on TFDS mock data) with
its own TF_CONFIG; they all-reduce over gRPC on loopback ports, each replica
taking its half of every static (padded, masked) logical batch. The chief
(worker 0) writes the workdir; worker 1 writes into a temporary directory
that it deletes.
"""

import json
import os
import socket
import subprocess
import sys

import tensorflow as tf

NUM_STEPS = 4

_WRAPPER = r'''
import os, sys
from tfdp.training import distribute
original = distribute.broadcast_from_chief
def broadcast_from_chief(strategy, value):  # record what this worker agreed on (test only)
    agreed = original(strategy, value)
    with open(os.environ["TFDP_TEST_SEED_FILE"], "w") as f:
        f.write(str(agreed))
    return agreed
distribute.broadcast_from_chief = broadcast_from_chief
from tfdp import data
with data.mock_data(num_examples=64):
    from tfdp import main
    sys.argv = ["tfdp.main"] + sys.argv[1:]
    main.run()
'''


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def test_two_workers_on_loopback_train_and_the_chief_writes_once(tmp_path):
    wrapper = tmp_path / "run_tfdp.py"
    wrapper.write_text(_WRAPPER)
    workdir = tmp_path / "workdir"
    cluster = {"worker": [f"127.0.0.1:{port}" for port in _free_ports(2)]}
    command = [
        sys.executable, str(wrapper), f"--workdir={workdir}",
        "--gin_file=fashion_mnist.gin", "--gin_file=smoke.gin",
        *[f"--gin_param={p}" for p in (
            "NUM_EXAMPLES = 64", "BATCH_SIZE = 16", f"NUM_STEPS = {NUM_STEPS}",
            "TARGET_EPSILON = None", "NOISE_MULTIPLIER = 1.0",
            "tfdp.train_and_evaluate.eval_every_steps = 2",
            "tfdp.train_and_evaluate.strategy = 'multi_worker_mirrored'",
            "tfdp.train_and_evaluate.static_batch_size = 'auto'",
            "tfdp.train_and_evaluate.noise_seed = 3",
        )],
    ]
    temp_dirs = [tmp_path / f"tmp{index}" for index in range(2)]
    procs = []
    for index in range(2):
        temp_dirs[index].mkdir()
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(temp_dirs[index]),
               "TF_CONFIG": json.dumps({"cluster": cluster,
                                        "task": {"type": "worker", "index": index}}),
               "TFDP_TEST_SEED_FILE": str(tmp_path / f"seed{index}")}
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    errors = []
    try:
        for proc in procs:
            errors.append(proc.communicate(timeout=300)[1])
    finally:  # on a timeout, do not leave a worker behind
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, stderr in zip(procs, errors):
        assert proc.returncode == 0, stderr[-4000:]

    report = json.loads((workdir / "privacy_report.json").read_text())
    assert report["steps"] == NUM_STEPS and report["epsilon"] > 0
    # Static logical batches split over the 2 replicas (one per worker).
    truncation = report["truncation"]
    assert truncation["num_replicas"] == 2
    assert truncation["per_replica_batch_size"] * 2 == truncation["static_batch_size"]
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4]  # written once, by the chief
    assert os.path.basename(tf.train.latest_checkpoint(str(workdir / "checkpoints"))) == (
        f"ckpt-{NUM_STEPS}")
    loaded = tf.saved_model.load(str(workdir / "export"))
    assert loaded.serve(tf.zeros([2, 28, 28, 1], tf.uint8))["logits"].shape == (2, 10)
    # Both workers sample with the chief's secret seed (each drew its own).
    seeds = [int((tmp_path / f"seed{index}").read_text()) for index in range(2)]
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(workdir / "checkpoints")))
    assert seeds[0] == seeds[1] == reader.get_tensor(
        "ledger/sampling_seed/.ATTRIBUTES/VARIABLE_VALUE")
    # Worker 1 wrote its copies into a temp dir and deleted it.
    assert not any(name.startswith("tfdp_worker") for name in os.listdir(temp_dirs[1]))
