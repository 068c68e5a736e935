"""Multi-worker start-up (`tfdp.cluster`): TF_CONFIG checked, workers found, the join bounded.

Through `tfdp.training.make_strategy` where the check is its wiring, and
`tfdp.cluster.wait_for_workers` on loopback ports for the start check itself.
The whole CLI on two workers: tests/multi_worker_test.py.
"""

import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from tfdp import cluster as cluster_lib
from tfdp.training import distribute

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_multi_worker_needs_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="needs the TF_CONFIG environment variable"):
        distribute.make_strategy("multi_worker_mirrored")
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {}}')
    with pytest.raises(ValueError, match="is not valid"):
        distribute.make_strategy("multi_worker_mirrored")


# -- TF_CONFIG checked, and a worker that never starts is named, not waited for --


def test_tf_config_addresses_need_a_port(monkeypatch):
    # Before: InvalidArgumentError "Could not parse port" from deep inside TensorFlow.
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": ["127.0.0.1:2222", "10.0.0.2"]},
        "task": {"type": "worker", "index": 0}}))
    with pytest.raises(ValueError, match=r"TF_CONFIG's worker 1 has the address '10.0.0.2', "
                                         r"which is not host:port"):
        distribute.make_strategy("multi_worker_mirrored")


def test_a_cluster_under_the_default_strategy_is_refused(monkeypatch, caplog):
    # Before: each worker trained its own model alone, with no warning.
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
        "task": {"type": "worker", "index": 0}}))
    with pytest.raises(ValueError, match=r"TF_CONFIG describes a cluster of 2 tasks \(worker 0 "
                       r"\(127.0.0.1:2222\), worker 1 \(127.0.0.1:2223\)\), but strategy is "
                       r"'default': this process would train alone.*multi_worker_mirrored"):
        distribute.make_strategy("default")
    # A one-task cluster (a launcher that always sets it) is said, not refused.
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["127.0.0.1:2222"]},
                                                "task": {"type": "worker", "index": 0}}))
    with caplog.at_level(logging.WARNING):
        assert distribute.make_strategy("default").num_replicas_in_sync == 1
    assert "TF_CONFIG is set, but strategy 'default' does not use it" in caplog.text


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_worker_that_never_starts_is_named_and_the_wait_ends(caplog):
    # Before: MultiWorkerMirroredStrategy() blocked forever, with no output.
    mine, theirs = _free_port(), _free_port()
    config = {"cluster": {"worker": [f"127.0.0.1:{mine}", f"127.0.0.1:{theirs}"]},
              "task": {"type": "worker", "index": 0}}
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        with pytest.raises(ValueError, match=rf"worker 0 waited \d+ s for worker 1 "
                           rf"\(127.0.0.1:{theirs}\) of TF_CONFIG to start.*raise "
                           r"tfdp.training.make_strategy.worker_timeout_s \(now 1.5 s\)"):
            cluster_lib.wait_for_workers(config, timeout_s=1.5, log_every_s=0.5)
    assert 1.5 <= time.monotonic() - start < 10
    waits = [r.getMessage() for r in caplog.records if "is waiting for" in r.getMessage()]
    assert len(waits) >= 2, waits
    assert (f"worker 0 is waiting for 1 of the 1 other workers of TF_CONFIG to start: worker 1 "
            f"(127.0.0.1:{theirs}) (0 s of the 1.5 s timeout") in waits[0]
    # While it waits, worker 0's own port answers: that is how the others see it started.


def test_workers_that_start_are_found_and_see_each_other():
    ports = [_free_port(), _free_port()]
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    errors, servers = [], []

    def worker(index):
        try:
            cluster_lib.wait_for_workers({"cluster": cluster,
                                          "task": {"type": "worker", "index": index}},
                                         timeout_s=20, log_every_s=5)
        except ValueError as e:  # pragma: no cover  (the assertion below reports it)
            errors.append(e)
            return
        server = socket.socket()  # what TensorFlow's server then does on that port
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", ports[index]))
        server.listen()
        servers.append(server)

    first = threading.Thread(target=worker, args=(0,))
    first.start()
    time.sleep(1.0)  # worker 1 starts a second later
    worker(1)
    first.join(timeout=20)
    for server in servers:
        server.close()
    assert not first.is_alive() and errors == [] and len(servers) == 2


# -- Only a real worker counts as started; two tasks on one address --


def test_two_tasks_with_the_same_address_are_refused_at_once(monkeypatch):
    # Before: worker 0 listened on the address, probed "worker 1" there, reached itself,
    # and MultiWorkerMirroredStrategy() then waited for worker 1 forever, silently.
    port = _free_port()
    config = {"cluster": {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{port}"]},
              "task": {"type": "worker", "index": 0}}
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"TF_CONFIG gives worker 0 and worker 1 the same "
                       rf"address 127.0.0.1:{port}: every task needs its own host:port"):
        cluster_lib.wait_for_workers(config, timeout_s=30, log_every_s=10)
    assert time.monotonic() - start < 5
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"chief": ["host0:2222"], "worker": ["HOST0:2222", "host1:2222"]},
        "task": {"type": "worker", "index": 1}}))
    with pytest.raises(ValueError, match=r"TF_CONFIG gives chief 0 and worker 0 the same "
                       r"address host0:2222"):
        distribute.make_strategy("multi_worker_mirrored")


@pytest.mark.slow
def test_a_port_held_by_another_process_is_not_a_worker_and_the_wait_ends(caplog):
    # Before: anything that accepted a connection on worker 1's port (a stale process,
    # another service) counted as worker 1, and TensorFlow's cluster setup then waited forever.
    mine = _free_port()
    with socket.socket() as stale:
        stale.bind(("127.0.0.1", 0))
        stale.listen()  # accepts connections (the kernel's backlog), says nothing
        theirs = stale.getsockname()[1]
        config = {"cluster": {"worker": [f"127.0.0.1:{mine}", f"127.0.0.1:{theirs}"]},
                  "task": {"type": "worker", "index": 0}}
        start = time.monotonic()
        with caplog.at_level(logging.WARNING):
            with pytest.raises(ValueError, match=rf"worker 0 waited \d+ s for worker 1 "
                               rf"\(127.0.0.1:{theirs}: something answers there, but not as a "
                               r"tfdp worker: a stale process or another service\?\) of "
                               r"TF_CONFIG to start.*worker_timeout_s \(now 2 s\)"):
                cluster_lib.wait_for_workers(config, timeout_s=2, log_every_s=0.5)
        assert 2 <= time.monotonic() - start < 8
    waits = [r.getMessage() for r in caplog.records if "is waiting for" in r.getMessage()]
    assert waits and "not as a tfdp worker" in waits[0], waits


@pytest.mark.slow
def test_a_worker_that_answers_as_another_task_is_not_taken_for_it():
    # Worker 1's address reaches a tfdp worker that is task 0 of its TF_CONFIG (e.g. a
    # TF_CONFIG copied to both hosts without changing the index).
    ports = [_free_port(), _free_port()]
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    errors = []

    def impostor():  # listens on worker 1's port, but as worker 0 of another cluster
        try:
            cluster_lib.wait_for_workers(
                {"cluster": {"worker": [f"127.0.0.1:{ports[1]}", "127.0.0.1:1"]},
                 "task": {"type": "worker", "index": 0}}, timeout_s=3, log_every_s=10)
        except ValueError as e:
            errors.append(e)

    thread = threading.Thread(target=impostor)
    thread.start()
    time.sleep(0.5)
    with pytest.raises(ValueError, match=rf"worker 1 \(127.0.0.1:{ports[1]}: a tfdp worker "
                       r"answers there as worker 0 of another TF_CONFIG cluster\)"):
        cluster_lib.wait_for_workers(
            {"cluster": cluster, "task": {"type": "worker", "index": 0}},
            timeout_s=2, log_every_s=10)
    thread.join(timeout=10)
    assert not thread.is_alive() and len(errors) == 1


_JOIN_SCRIPT = r'''
import json, os, sys, threading
from absl import logging
from tfdp import cluster as cluster_lib
from tfdp.training import distribute
logging.use_absl_handler()
logging.set_verbosity(logging.INFO)
ports = [int(p) for p in sys.argv[1:3]]
cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
os.environ["TF_CONFIG"] = json.dumps({"cluster": cluster,
                                      "task": {"type": "worker", "index": 0}})
# Worker 1 passes tfdp's start check (in this process), then never starts TensorFlow: as a
# worker that stops between the two.
peer = threading.Thread(target=cluster_lib.wait_for_workers, daemon=True, args=(
    {"cluster": cluster, "task": {"type": "worker", "index": 1}},), kwargs={"timeout_s": 30})
peer.start()
distribute.make_strategy("multi_worker_mirrored", worker_timeout_s=float(sys.argv[3]))
print("the strategy was built")
'''


@pytest.mark.slow
def test_the_wait_for_tensorflow_s_cluster_is_bounded_too(tmp_path):
    # Before: MultiWorkerMirroredStrategy() waited for worker 1 forever, with no output,
    # holding the interpreter (no Python thread or signal handler ran) and catching SIGTERM.
    script = tmp_path / "join.py"
    script.write_text(_JOIN_SCRIPT)
    # The script imports this checkout's tfdp, whatever tfdp is installed.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script), str(_free_port()), str(_free_port()),
                             "3"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0 and "the strategy was built" not in out, err[-3000:]
    assert re.search(r"worker 0 is joining TensorFlow's cluster of TF_CONFIG \(2 workers; at "
                     r"most 3 s, tfdp.training.make_strategy.worker_timeout_s\)", err), err[-3000:]
    assert re.search(r"tfdp: error: worker 0: TensorFlow's cluster of TF_CONFIG did not form "
                     r"within 3 s.*worker 1 \(127.0.0.1:\d+\)", err), err[-3000:]
    assert "Traceback" not in err
