"""Two `multi_worker_mirrored` workers on 127.0.0.1 train one job together.

Each worker is a real `python -m tfdp.main` process (on TFDS mock data) with
its own TF_CONFIG; they all-reduce over gRPC on loopback ports, each replica
taking its half of every static (padded, masked) logical batch. The chief
(worker 0) writes the workdir; worker 1 writes into a temporary directory
that it deletes.
"""

import collections
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from tfdp import data

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


def _two_workers(tmp_path, workdir, num_steps=NUM_STEPS, static_batch_size="'auto'"):
    """Runs the smoke config on 2 loopback workers into `workdir`; the temp dirs they used."""
    wrapper = tmp_path / "run_tfdp.py"
    wrapper.write_text(_WRAPPER)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in _free_ports(2)]}
    command = [
        sys.executable, str(wrapper), f"--workdir={workdir}",
        "--gin_file=fashion_mnist.gin", "--gin_file=smoke.gin",
        *[f"--gin_param={p}" for p in (
            "NUM_EXAMPLES = 64", "BATCH_SIZE = 16", f"NUM_STEPS = {num_steps}",
            "TARGET_EPSILON = None", "NOISE_MULTIPLIER = 1.0",
            "tfdp.EvaluationConfig.eval_every_steps = 2",
            "tfdp.RuntimeConfig.strategy = 'multi_worker_mirrored'",
            f"tfdp.RuntimeConfig.static_batch_size = {static_batch_size}",
            "tfdp.PrivacyConfig.noise_seed = 3",
        )],
    ]
    temp_dirs = [tmp_path / f"tmp{index}" for index in range(2)]
    procs = []
    for index in range(2):
        temp_dirs[index].mkdir(exist_ok=True)
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
    return temp_dirs


@pytest.mark.slow  # end to end (tests/run_slow.sh); the default suite has the per-host
# input (tests/inputs_test.py) and the start checks (tests/cluster_test.py)
def test_two_workers_on_loopback_train_and_the_chief_writes_once(tmp_path):
    workdir = tmp_path / "workdir"
    temp_dirs = _two_workers(tmp_path, workdir)

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


@pytest.mark.slow  # two multi-worker runs, end to end
def test_two_workers_extend_a_workdir_named_like_a_glob_pattern(tmp_path):
    # The worker that holds no lock reads the chief's checkpoints too: TensorFlow read
    # `sweep[lr=0.5]/checkpoints` as a pattern there.
    workdir = tmp_path / "sweep[lr=0.5] {a,b}"
    # A fixed truncation cap: "auto" depends on the number of steps, and a resume may not
    # change the mechanism.
    _two_workers(tmp_path, workdir, num_steps=2, static_batch_size=40)
    _two_workers(tmp_path, workdir, num_steps=NUM_STEPS, static_batch_size=40)
    report = json.loads((workdir / "privacy_report.json").read_text())
    assert report["steps"] == NUM_STEPS
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4]  # resumed at 2, not redone


# -- Per-host input: 2 workers x 2 replicas read exactly their share --

_SHARE_WRAPPER = r'''
import atexit, json, os, sys, threading
import tensorflow as tf
# 2 (or 4) logical CPU devices, before TensorFlow initializes.
cpu = tf.config.list_physical_devices("CPU")[0]
local = int(os.environ["TFDP_TEST_LOCAL_DEVICES"])
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * local)
# Test only: MultiWorkerMirroredStrategy takes one CPU device per worker; give it `local`.
from tensorflow.python.distribute import collective_all_reduce_strategy as collective
def local_devices(self, cluster_resolver, worker_device):
    return tuple(f"{worker_device}/device:CPU:{i}" for i in range(local)), "CPU"
collective.CollectiveAllReduceExtended._initialize_local_devices = local_devices
# Record the training records this process reads: the indices of every read.
from tfdp.data import tfds_source
reads, lock = [], threading.Lock()
original_fetch = tfds_source.TFDSSource._fetch
def fetch(self, indices):
    if self.split == "train" and len(indices):
        with lock:
            reads.append([int(i) for i in indices])
    return original_fetch(self, indices)
tfds_source.TFDSSource._fetch = fetch
def dump():
    with open(os.environ["TFDP_TEST_READS"], "w") as f:
        json.dump(reads, f)
atexit.register(dump)
from tfdp import data
with data.mock_data(num_examples=64):
    from tfdp import main
    sys.argv = ["tfdp.main"] + sys.argv[1:]
    main.run()
'''

SHARE_STEPS, SAMPLING_SEED, ACCUMULATION, SHARE_BATCH = 3, 7, 2, 32


def _run_cluster(tmp_path, name, workers, local_devices, wrapper=None, extra_params=()):
    """One job of `workers` processes x `local_devices` CPU replicas; returns its dir."""
    root = tmp_path / name
    root.mkdir()
    (root / "run.py").write_text(wrapper or _SHARE_WRAPPER)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in _free_ports(workers)]}
    command = [
        sys.executable, str(root / "run.py"), f"--workdir={root / 'workdir'}",
        "--gin_file=fashion_mnist.gin", "--gin_file=smoke.gin",
        *[f"--gin_param={p}" for p in (
            "NUM_EXAMPLES = 64", f"BATCH_SIZE = {SHARE_BATCH}", f"NUM_STEPS = {SHARE_STEPS}",
            "TARGET_EPSILON = None", "NOISE_MULTIPLIER = 1.0",
            f"tfdp.EvaluationConfig.eval_every_steps = {SHARE_STEPS}",
            "tfdp.RuntimeConfig.strategy = 'multi_worker_mirrored'",
            "tfdp.RuntimeConfig.static_batch_size = 'auto'",
            f"tfdp.OptimizationConfig.accumulation_steps = {ACCUMULATION}",
            "tfdp.AugmentationConfig.augmentation = 'mnist_crop'",
            "tfdp.AugmentationConfig.augmult = 2",
            "tfdp.RuntimeConfig.deterministic = True",
            "tfdp.PrivacyConfig.noise_seed = 3",
            f"tfdp.PrivacyConfig.sampling_seed = {SAMPLING_SEED}",
            *extra_params,
        )],
    ]
    procs = []
    for index in range(workers):
        (root / f"tmp{index}").mkdir()
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(root / f"tmp{index}"),
               "TF_CONFIG": json.dumps({"cluster": cluster,
                                        "task": {"type": "worker", "index": index}}),
               "TFDP_TEST_LOCAL_DEVICES": str(local_devices),
               "TFDP_TEST_READS": str(root / f"reads{index}.json")}
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    return root, procs


def _wait(procs):
    errors = []
    try:
        for proc in procs:
            errors.append(proc.communicate(timeout=600)[1])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, stderr in zip(procs, errors):
        assert proc.returncode == 0, stderr[-4000:]


def _checkpoint_floats(workdir):
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(workdir / "checkpoints")))
    dtypes = reader.get_variable_to_dtype_map()
    return {name: reader.get_tensor(name) for name in dtypes
            if dtypes[name].is_floating and "ledger" not in name}


@pytest.mark.slow
def test_each_worker_reads_its_share_and_matches_one_worker_with_four_replicas(tmp_path):
    # Both jobs together: 2 workers x 2 replicas, and 1 worker x 4 replicas.
    two, two_procs = _run_cluster(tmp_path, "two_workers", workers=2, local_devices=2)
    one, one_procs = _run_cluster(tmp_path, "one_worker", workers=1, local_devices=4)
    _wait(two_procs + one_procs)

    reports = [json.loads((root / "workdir" / "privacy_report.json").read_text())
               for root in (two, one)]
    assert reports[0]["epsilon"] == reports[1]["epsilon"] > 0
    truncation = reports[0]["truncation"]
    assert truncation == reports[1]["truncation"]
    assert (truncation["num_replicas"], truncation["accumulation_steps"]) == (4, ACCUMULATION)
    static, per_replica = truncation["static_batch_size"], truncation["per_replica_batch_size"]

    # What each worker must read: the truncated Poisson batch of every step, cut into
    # R a = 8 slices of n slots; global replica r's chunk j is slice r a + j, and
    # worker w owns replicas 2w and 2w + 1. One read per chunk (its real indices).
    n = static // (4 * ACCUMULATION)
    expected, whole = {0: [], 1: []}, []
    for step in range(SHARE_STEPS):
        batch = data.poisson_indices(SAMPLING_SEED, step, num_examples=64,
                                     sampling_prob=SHARE_BATCH / 64)[:static].tolist()
        for chunk in range(ACCUMULATION):
            for replica in range(4):
                k = replica * ACCUMULATION + chunk
                if batch[k * n:(k + 1) * n]:
                    expected[replica // 2].append(tuple(batch[k * n:(k + 1) * n]))
                    whole.append(expected[replica // 2][-1])
    assert sum(map(len, whole)) == sum(min(len(data.poisson_indices(
        SAMPLING_SEED, t, num_examples=64, sampling_prob=SHARE_BATCH / 64)), static)
        for t in range(SHARE_STEPS))
    reads = [_reads(two / f"reads{index}.json") for index in range(2)]
    for index in range(2):
        _assert_reads_share(reads[index], expected[index])
    assert not set(reads[0]) & set(reads[1])  # no chunk read by both workers
    _assert_reads_share(_reads(one / "reads0.json"), whole)

    # The same update, whatever host read which example: weights, EMA, optimizer
    # slots and the noise generator's state, to float tolerance.
    mine, reference = _checkpoint_floats(two / "workdir"), _checkpoint_floats(one / "workdir")
    assert mine.keys() == reference.keys() and len(mine) > 5
    for name in mine:
        np.testing.assert_allclose(mine[name], reference[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)


def _reads(path):
    return [tuple(chunk) for chunk in json.loads(path.read_text())]


def _assert_reads_share(reads, share):
    """Every chunk of `share` read, nothing else; extra reads only of a first prefix.

    Keras' `fit` takes one element from a first iterator that it then drops
    (`_maybe_symbolic_build`); that iterator has read ahead a few chunks of
    the SAME stream, so those are read twice: the extras are a prefix of it.
    """
    assert set(reads) == set(share)
    extra = collections.Counter(reads) - collections.Counter(share)
    prefixes = [collections.Counter(share[:k]) for k in range(len(share) + 1)]
    assert extra in prefixes, (extra, share)


# -- The pure-TF input: the same share, read with TensorFlow ops only --

_PURE_TF_WRAPPER = _SHARE_WRAPPER.replace(
    '''# Record the training records this process reads: the indices of every read.
from tfdp.data import tfds_source
reads, lock = [], threading.Lock()
original_fetch = tfds_source.TFDSSource._fetch
def fetch(self, indices):
    if self.split == "train" and len(indices):
        with lock:
            reads.append([int(i) for i in indices])
    return original_fetch(self, indices)
tfds_source.TFDSSource._fetch = fetch
def dump():
    with open(os.environ["TFDP_TEST_READS"], "w") as f:
        json.dump(reads, f)
atexit.register(dump)
''', '''# Record the training examples this process reads, with a graph op (no Python callback):
# tf.print of every gather's indices into a file.
from tfdp.data import array_source
original_read = array_source.ArraySource.read
def read(self, indices):
    if getattr(self, "split", None) == "train":
        logged = tf.print(indices, output_stream="file://" + os.environ["TFDP_TEST_READS"],
                          summarize=-1)
        with tf.control_dependencies([logged]):
            indices = tf.identity(indices)
    return original_read(self, indices)
array_source.ArraySource.read = read
''')

assert "tf.print(indices" in _PURE_TF_WRAPPER and "_fetch" not in _PURE_TF_WRAPPER


def _printed_reads(path):
    """The non-empty index vectors tf.print wrote, one per line ("[3 17 40]")."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [tuple(int(i) for i in line.strip("[]").split()) for line in lines
            if line.strip("[]").strip()]


@pytest.mark.slow
def test_the_pure_tf_input_reads_each_worker_s_share_and_matches_one_worker(tmp_path):
    params = ["tfdp.data.open_split.source = 'in_memory'"]
    roots = []
    for name, workers, local in (("two_workers", 2, 2), ("one_worker", 1, 4)):
        root, procs = _run_cluster(tmp_path, name, workers=workers, local_devices=local,
                                   wrapper=_PURE_TF_WRAPPER, extra_params=params)
        roots.append((root, procs))
    _wait([p for _, procs in roots for p in procs])
    (two, _), (one, _) = roots

    reports = [json.loads((root / "workdir" / "privacy_report.json").read_text())
               for root in (two, one)]
    assert reports[0]["epsilon"] == reports[1]["epsilon"] > 0
    assert reports[0]["truncation"] == reports[1]["truncation"]
    static = reports[0]["truncation"]["static_batch_size"]
    n = static // (4 * ACCUMULATION)
    expected, whole = {0: [], 1: []}, []
    for step in range(SHARE_STEPS):
        batch = data.poisson_indices_in_graph(
            SAMPLING_SEED, step, num_examples=64,
            sampling_prob=SHARE_BATCH / 64).numpy()[:static].tolist()
        for chunk in range(ACCUMULATION):
            for replica in range(4):
                k = replica * ACCUMULATION + chunk
                if batch[k * n:(k + 1) * n]:
                    expected[replica // 2].append(tuple(batch[k * n:(k + 1) * n]))
                    whole.append(expected[replica // 2][-1])
    reads = [_printed_reads(two / f"reads{index}.json") for index in range(2)]
    for index in range(2):
        _assert_reads_share(reads[index], expected[index])
    assert not set(reads[0]) & set(reads[1])
    _assert_reads_share(_printed_reads(one / "reads0.json"), whole)
    # The numpy sampler's batches are not what was read (another stream, the same law).
    numpy_first = data.poisson_indices(SAMPLING_SEED, 0, num_examples=64,
                                       sampling_prob=SHARE_BATCH / 64)[:static].tolist()
    assert numpy_first != sorted(sum((list(c) for c in whole[:4 * ACCUMULATION]), []))

    mine, reference = _checkpoint_floats(two / "workdir"), _checkpoint_floats(one / "workdir")
    assert mine.keys() == reference.keys() and len(mine) > 5
    for name in mine:
        np.testing.assert_allclose(mine[name], reference[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)
@pytest.mark.slow  # a whole CLI start (about 30 s); the waiting is tested in cluster_test
def test_a_worker_that_never_starts_stops_the_run_with_its_name(tmp_path):
    # Before: worker 0 printed nothing, for as long as one waited (and ignored SIGTERM).
    ports = _free_ports(2)
    command, env = _worker0_command(
        tmp_path, {"worker": [f"127.0.0.1:{port}" for port in ports]},
        "tfdp.training.make_strategy.worker_timeout_s = 4",
        "tfdp.training.make_strategy.wait_log_every_s = 1")
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"waiting for 1 of the 1 other workers of TF_CONFIG to start: worker 1 " \
           f"(127.0.0.1:{ports[1]})" in proc.stderr
    assert re.search(rf"tfdp: error: worker 0 waited \d+ s for worker 1 \(127.0.0.1:"
                     rf"{ports[1]}\) of TF_CONFIG to start, and it has not\..*worker_timeout_s "
                     r"\(now 4 s\)", proc.stderr), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "workdir").exists()


# -- A busy port is not a worker; two tasks on one address --------------


def _worker0_command(tmp_path, cluster, *params):
    wrapper = tmp_path / "run_tfdp.py"
    wrapper.write_text(_WRAPPER)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TFDP_TEST_SEED_FILE": str(tmp_path / "s"),
           "TF_CONFIG": json.dumps({"cluster": cluster,
                                    "task": {"type": "worker", "index": 0}})}
    command = [
        sys.executable, str(wrapper), f"--workdir={tmp_path / 'workdir'}",
        "--gin_file=fashion_mnist.gin", "--gin_file=smoke.gin",
        *[f"--gin_param={p}" for p in (
            "NUM_EXAMPLES = 64", "BATCH_SIZE = 16",
            "tfdp.RuntimeConfig.strategy = 'multi_worker_mirrored'", *params)]]
    return command, env


@pytest.mark.slow
def test_two_tasks_with_the_same_address_are_refused_at_start(tmp_path):
    # Before: worker 0 probed worker 1's address, reached its own listener, and then waited
    # in TensorFlow's cluster setup forever, printing nothing (killed here after 120 s).
    (port,) = _free_ports(1)
    command, env = _worker0_command(
        tmp_path, {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{port}"]})
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"tfdp: error: TF_CONFIG gives worker 0 and worker 1 the same address "
            f"127.0.0.1:{port}: every task needs its own host:port") in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "workdir").exists()


@pytest.mark.slow  # a whole CLI start and a 4 s wait (about 20 s); cluster_test has the unit
def test_a_port_held_by_a_stale_process_is_not_taken_for_the_worker(tmp_path):
    # Before: the stale listener answered on worker 1's port, worker 0 took it for worker 1,
    # and waited in TensorFlow's cluster setup forever with no output (killed here at 120 s).
    (mine,) = _free_ports(1)
    with socket.socket() as stale:
        stale.bind(("127.0.0.1", 0))
        stale.listen()
        theirs = stale.getsockname()[1]
        command, env = _worker0_command(
            tmp_path, {"worker": [f"127.0.0.1:{mine}", f"127.0.0.1:{theirs}"]},
            "tfdp.training.make_strategy.worker_timeout_s = 4",
            "tfdp.training.make_strategy.wait_log_every_s = 1")
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        lines = []  # (when, line), as the worker writes them
        reader = threading.Thread(target=lambda: lines.extend(
            (time.monotonic(), line) for line in proc.stderr))
        reader.start()
        try:
            proc.wait(timeout=120)
            ended = time.monotonic()
        finally:
            if proc.poll() is None:
                proc.kill()
            reader.join(timeout=10)
    first_wait = min((when for when, line in lines if "is waiting for" in line), default=None)
    stderr = "".join(line for _, line in lines)
    assert proc.returncode == 2, stderr[-3000:]
    assert first_wait is not None and ended - first_wait < 4 + 6, (ended - first_wait, stderr)
    assert (f"waiting for 1 of the 1 other workers of TF_CONFIG to start: worker 1 (127.0.0.1:"
            f"{theirs}: something answers there, but not as a tfdp worker: a stale process or "
            "another service?)") in stderr
    assert re.search(rf"tfdp: error: worker 0 waited \d+ s for worker 1 \(127.0.0.1:{theirs}: "
                     r"something answers there, but not as a tfdp worker", stderr), stderr[-3000:]
    assert "Traceback" not in stderr
    assert not (tmp_path / "workdir").exists()
