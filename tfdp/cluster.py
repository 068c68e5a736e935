"""Multi-worker start-up: TF_CONFIG checked, every worker found, the cluster's join bounded.

`MultiWorkerMirroredStrategy()` waits, silently and with no timeout, until
every worker of `TF_CONFIG` has joined TensorFlow's cluster, holding the
interpreter and catching SIGTERM meanwhile. `tfdp.training.make_strategy`
therefore calls, in order:

1. `check_tf_config()`: TF_CONFIG is JSON with a cluster and a task, and
   every address is a host:port of its own.
2. `wait_for_workers(config)`: a TCP start check with every other task,
   logged while it waits and bounded by `worker_timeout_s`.
3. `join_cluster(config, timeout_s, build)`: builds the strategy under a
   watchdog process that stops this one if TensorFlow's cluster does not
   form in time.

`check_no_cluster(name)` refuses a TF_CONFIG cluster of several tasks under a
single-process strategy. The design: docs/design/sampling_and_distribution.md
("Multi-worker start").
"""

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import tensorflow as tf
from absl import logging

# How long a multi_worker_mirrored worker waits for the others to start, and how often it
# says so (`wait_for_workers`).
WORKER_TIMEOUT_S = 600
WAIT_LOG_EVERY_S = 30
# The jobs of a TF_CONFIG cluster that train (`MultiWorkerMirroredStrategy`'s collectives).
_TRAINING_JOBS = ("chief", "worker")


def check_tf_config():
    """The parsed TF_CONFIG of a multi-worker run, every address checked.

    Returns:
      The TF_CONFIG environment variable as a dict: "cluster" ({job: [address]}
      or {job: {index: address}}) and "task" ({"type", "index"}).

    Raises:
      ValueError: TF_CONFIG unset, not JSON, without cluster or task, a task
        index outside its job, an address that is not host:port (e.g.
        "10.0.0.2" without its port; TensorFlow would stop deep inside with
        "Could not parse port"), or two tasks with the same address.
    """
    raw = os.environ.get("TF_CONFIG")
    example = ('TF_CONFIG=\'{"cluster": {"worker": ["host0:12345", "host1:12345"]}, '
               '"task": {"type": "worker", "index": 0}}\'')
    if not raw:
        raise ValueError(
            "strategy 'multi_worker_mirrored' needs the TF_CONFIG environment variable "
            f"on every worker, e.g. {example} (index 1 on the second worker)."
        )
    try:
        config = json.loads(raw)
        cluster = config["cluster"]
        task_type, task_index = config["task"]["type"], config["task"]["index"]
        addresses = cluster[task_type][task_index]
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"TF_CONFIG={raw!r} is not valid ({e!r}); expected {example}.") from e
    del addresses
    for job in cluster:
        for index, address in _tasks(cluster, job):
            if _host_port(address) is None:
                raise ValueError(
                    f"TF_CONFIG's {job} {index} has the address {address!r}, which is not "
                    "host:port (e.g. '10.0.0.2:12345'): every task needs the port its "
                    f"server listens on. Fix TF_CONFIG on every worker; expected {example}.")
    _check_distinct_addresses(cluster)
    return config


def _tasks(cluster, job):
    """[(index, address)] of a TF_CONFIG job: a list, or a sparse {index: address} dict."""
    tasks = cluster.get(job, [])
    if isinstance(tasks, dict):
        return sorted((int(i), address) for i, address in tasks.items())
    return list(enumerate(tasks if isinstance(tasks, list) else [tasks]))


def _host_port(address):
    """`(host, port)` of "host:port" (also "[v6]:port"), or None if it is not one."""
    if not isinstance(address, str):
        return None
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def check_no_cluster(name):
    """Refuses a TF_CONFIG cluster of several tasks under a single-process strategy.

    Every worker started with the same command and TF_CONFIG would then train
    its own model alone, on its own secret seeds. A cluster of one task (a
    launcher that always sets TF_CONFIG) is only logged.

    Args:
      name: the run's strategy (one of `tfdp.training.STRATEGIES`, not
        "multi_worker_mirrored"), for the message.

    Raises:
      ValueError: TF_CONFIG describes two or more chief or worker tasks.
    """
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return
    try:
        cluster = json.loads(raw).get("cluster", {})
        tasks = [f"{job} {i} ({address})" for job in _TRAINING_JOBS
                 for i, address in _tasks(cluster, job)]
    except (ValueError, AttributeError, TypeError):
        tasks = []
    if len(tasks) > 1:
        raise ValueError(
            f"TF_CONFIG describes a cluster of {len(tasks)} tasks ({', '.join(tasks)}), but "
            f"strategy is {name!r}: this process would train alone, and every other worker "
            "started this way would train its own model. Set "
            "tfdp.RuntimeConfig.strategy = 'multi_worker_mirrored' to train them as one "
            "job, or unset TF_CONFIG to train on this machine alone.")
    logging.warning("TF_CONFIG is set, but strategy %r does not use it: this process trains "
                    "alone. (Use strategy 'multi_worker_mirrored' for a cluster.)", name)


def wait_for_workers(config, *, timeout_s=WORKER_TIMEOUT_S, log_every_s=WAIT_LOG_EVERY_S,
                     probe_timeout_s=1.0):
    """Waits until every other training task of `config` (TF_CONFIG) has started, or stops.

    `MultiWorkerMirroredStrategy()` blocks, silently and with no timeout, until
    every worker has joined (TensorFlow's coordination service), holding the
    Python interpreter meanwhile: a worker that never starts hangs the others
    forever. So, before any TensorFlow op, each worker listens on its own
    port and, in turn, connects to every other task's address and asks who
    answers there (the start check). Only a tfdp worker that is that very
    task of the same TF_CONFIG cluster counts as started: a port held by
    anything else (a stale process, another service) accepts the connection
    but does not answer so, and is named as such. A worker goes on once it
    has found every other task and every other task has found it (it keeps
    listening until then, so no worker stops answering while another still
    looks for it). While some are missing, it logs which (job, index,
    address, and what answers there, if anything) and for how long, at once
    and every `log_every_s`; after `timeout_s` it stops with an error naming
    them. Its own listener is closed before TensorFlow's server takes the
    port.

    Args:
      config: the parsed TF_CONFIG (`check_tf_config`).
      timeout_s: seconds to wait in all (`make_strategy`'s worker_timeout_s).
      log_every_s: seconds between two "waiting" lines.
      probe_timeout_s: seconds a connection attempt, and its answer, may take.

    Raises:
      ValueError: two tasks of TF_CONFIG with the same address (at once), this
        worker's port already in use, or some task not found within
        `timeout_s`; the message names each, what to check, and the setting
        that raises the timeout.
    """
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0
            and isinstance(log_every_s, (int, float)) and log_every_s > 0):
        raise ValueError(f"worker_timeout_s={timeout_s!r} and wait_log_every_s={log_every_s!r} "
                         "must be numbers > 0 (seconds).")
    cluster, task = config["cluster"], config["task"]
    _check_distinct_addresses(cluster)
    me = (task["type"], int(task["index"]))
    others = {(job, i): address for job in _TRAINING_JOBS
              for i, address in _tasks(cluster, job) if (job, i) != me}
    if not others:
        return
    digest = _cluster_digest(cluster)
    start = time.monotonic()
    last_log = None
    found, answers = set(), {}  # answers: what a task's address answered when not the task
    with _StartCheck(dict(_tasks(cluster, me[0]))[me[1]], me, digest) as check:
        while True:
            for key, address in others.items():
                if key not in found:
                    answer = _probe(address, key, me, digest, probe_timeout_s)
                    if answer is True:
                        found.add(key)
                    if answer is not _NO_CONNECTION:  # (a full backlog says nothing new)
                        answers[key] = None if answer is True else answer
            found_by = check.found_by()
            missing = [key for key in others if key not in found or key not in found_by]
            elapsed = time.monotonic() - start
            if not missing:
                if last_log is not None:
                    logging.info("All %d workers of TF_CONFIG have started (waited %.0f s).",
                                 len(others) + 1, elapsed)
                return
            names = ", ".join(_named(key, others[key], answers.get(key) or (
                "started, but has not reached this worker yet" if key in found else None))
                for key in missing)
            if elapsed >= timeout_s:
                raise ValueError(
                    f"{me[0]} {me[1]} waited {elapsed:.0f} s for {names} of TF_CONFIG to "
                    f"start, and {'it has' if len(missing) == 1 else 'they have'} not. Start "
                    "the same command on every worker of TF_CONFIG (each with its own task "
                    "index), check that the addresses and ports are right, reachable from "
                    "here and held by no other process, or raise "
                    "tfdp.training.make_strategy.worker_timeout_s (now "
                    f"{timeout_s:g} s). Nothing was trained or written.")
            if last_log is None or time.monotonic() - last_log >= log_every_s:
                last_log = time.monotonic()
                logging.warning(
                    "%s %d is waiting for %d of the %d other workers of TF_CONFIG to start: "
                    "%s (%.0f s of the %g s timeout, "
                    "tfdp.training.make_strategy.worker_timeout_s).", me[0], me[1],
                    len(missing), len(others), names, elapsed, timeout_s)
            time.sleep(min(0.5, max(0.0, timeout_s - elapsed)))


def _named(key, address, answer):
    """"worker 1 (127.0.0.1:2222)", with what answers there if it is not that worker."""
    return f"{key[0]} {key[1]} ({address}{': ' + answer if answer else ''})"


def _check_distinct_addresses(cluster):
    """Refuses two tasks of TF_CONFIG with one host:port (host names compared as written).

    A worker that probes the other task would reach the first (or itself),
    and TensorFlow would then wait for the second forever.
    """
    seen = {}
    for job in cluster:
        for index, address in _tasks(cluster, job):
            host_port = _host_port(address)
            if host_port is None:
                continue  # refused by check_tf_config, with its own message
            key = (host_port[0].lower(), host_port[1])
            if key in seen:
                first, first_address = seen[key]
                raise ValueError(
                    f"TF_CONFIG gives {first} and {job} {index} the same address "
                    f"{first_address}: every task needs its own host:port (its server listens "
                    "there), or each would take the other for itself and TensorFlow would "
                    "wait for the second forever. Fix TF_CONFIG on every worker.")
            seen[key] = (f"{job} {index}", address)


def _cluster_digest(cluster):
    """A short digest of TF_CONFIG's cluster: workers of different clusters tell them apart."""
    tasks = {job: [[i, address] for i, address in _tasks(cluster, job)] for job in cluster}
    return hashlib.sha256(json.dumps(tasks, sort_keys=True).encode()).hexdigest()[:16]


# The start check's lines: the caller's "tfdp-worker? JOB INDEX DIGEST", the answer
# "tfdp-worker JOB INDEX DIGEST", then the caller's "ok" once it has taken the answer.
_HELLO, _ANSWER, _OK = "tfdp-worker?", "tfdp-worker", "ok"
_START_CHECK_READ_S = 5.0  # how long the listener waits for a caller's line


def _read_line(sock, limit=256):
    """One "\n"-terminated ASCII line from `sock`, without it ("" on EOF or a longer line)."""
    data = b""
    while not data.endswith(b"\n") and len(data) < limit:
        chunk = sock.recv(limit - len(data))
        if not chunk:
            return ""
        data += chunk
    return data.decode("ascii", "replace").strip() if data.endswith(b"\n") else ""


_NO_CONNECTION = object()


def _probe(address, key, me, digest, timeout_s):
    """True if `address` answers the start check as task `key` of this cluster.

    Else None if nothing listens there (not started), `_NO_CONNECTION` if the
    connection timed out (an unreachable host, or a listener whose backlog is
    full: a stale one fills it), or what answers there instead, as text for
    the messages.
    """
    host, port = _host_port(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except TimeoutError:
        return _NO_CONNECTION
    except OSError:
        return None
    with sock:
        try:
            sock.sendall(f"{_HELLO} {me[0]} {me[1]} {digest}\n".encode())
            answer = _read_line(sock).split()
        except OSError:
            answer = []
        if len(answer) != 4 or answer[0] != _ANSWER or not answer[2].isdigit():
            return ("something answers there, but not as a tfdp worker: a stale process or "
                    "another service?")
        who = (answer[1], int(answer[2]))
        if answer[3] != digest:
            return f"a tfdp worker answers there as {who[0]} {who[1]} of another TF_CONFIG cluster"
        if who == me:
            return (f"that address reaches this worker itself ({me[0]} {me[1]}): do two tasks "
                    "of TF_CONFIG name one machine and port?")
        if who != key:
            return f"a tfdp worker answers there as {who[0]} {who[1]}"
        try:
            sock.sendall(f"{_OK}\n".encode())
        except OSError:
            return None
    return True


class _StartCheck:
    """This worker's side of the start check, for a `with` block: it listens on its port.

    A thread accepts each caller and, in a thread of its own, reads its line,
    answers who this worker is, and records the caller (`found_by`) once the
    caller has taken the answer.
    """

    def __init__(self, address, me, digest):
        self._me, self._digest = me, digest
        self._found_by, self._lock = set(), threading.Lock()
        self._stop = threading.Event()
        host_port = _host_port(address)
        if host_port is None:
            raise ValueError(f"This worker's TF_CONFIG address {address!r} is not host:port.")
        self._sock = socket.socket(socket.AF_INET6 if ":" in host_port[0] else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind(("", host_port[1]))
            self._sock.listen(64)
        except OSError as e:
            self._sock.close()
            raise ValueError(
                f"This worker's TF_CONFIG address {address} cannot be listened on: "
                f"{e.strerror or e}. Is another process (an earlier worker?) using port "
                f"{host_port[1]}? Stop it, or give this task another port in TF_CONFIG on "
                "every worker.") from None
        self._sock.settimeout(0.1)
        self._thread = threading.Thread(target=self._serve, name="tfdp-start-check",
                                        daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sock.close()

    def found_by(self):
        """The (job, index) of each task that has found this worker."""
        with self._lock:
            return set(self._found_by)

    def _serve(self):
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (socket.timeout, BlockingIOError):
                continue
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn):
        with conn:
            conn.settimeout(_START_CHECK_READ_S)
            try:
                hello = _read_line(conn).split()
                conn.sendall(f"{_ANSWER} {self._me[0]} {self._me[1]} {self._digest}\n".encode())
                if (len(hello) == 4 and hello[0] == _HELLO and hello[2].isdigit()
                        and hello[3] == self._digest and _read_line(conn) == _OK):
                    with self._lock:
                        self._found_by.add((hello[1], int(hello[2])))
            except OSError:
                pass


# Stops this process (SIGKILL) with a message on stderr unless its stdin closes within
# argv[1] seconds. A separate process: TensorFlow's cluster setup holds the interpreter
# (no Python thread or signal handler runs) and catches SIGTERM.
_WATCHDOG = (
    "import os, select, signal, sys\n"
    "if not select.select([sys.stdin], [], [], float(sys.argv[1]))[0]:\n"
    "    sys.stderr.write(sys.argv[3] + '\\n')\n"
    "    sys.stderr.flush()\n"
    "    os.kill(int(sys.argv[2]), signal.SIGKILL)\n")


def join_cluster(config, timeout_s, build):
    """`build()` (the strategy, which joins TensorFlow's cluster), or this process stopped.

    Every worker has answered the start check (`wait_for_workers`), but one
    may stop before it joins TensorFlow's cluster, and TensorFlow would then
    wait for it forever. A watchdog process stops this one after `timeout_s`,
    with a message naming the other workers; its exit status is then that of
    SIGKILL (137 in a shell).

    Args:
      config: the parsed TF_CONFIG (`check_tf_config`).
      timeout_s: seconds `build` may take (`make_strategy`'s worker_timeout_s).
      build: a function of no arguments that returns the
        `tf.distribute.MultiWorkerMirroredStrategy` (its constructor joins the
        cluster).

    Returns:
      What `build()` returns.

    Raises:
      ValueError: TensorFlow's cluster setup failed (a `tf.errors.OpError`,
        e.g. a deadline).
    """
    cluster, task = config["cluster"], config["task"]
    me = f"{task['type']} {int(task['index'])}"
    tasks = [(job, i, address) for job in _TRAINING_JOBS for i, address in _tasks(cluster, job)]
    others = ", ".join(f"{job} {i} ({address})" for job, i, address in tasks
                       if f"{job} {i}" != me)
    logging.info("%s is joining TensorFlow's cluster of TF_CONFIG (%d workers; at most %g s, "
                 "tfdp.training.make_strategy.worker_timeout_s).", me, len(tasks), timeout_s)
    message = (
        f"tfdp: error: {me}: TensorFlow's cluster of TF_CONFIG did not form within "
        f"{timeout_s:g} s (tfdp.training.make_strategy.worker_timeout_s), though every worker "
        f"had answered tfdp's start check: one of {others} has stopped since, or runs with "
        "another TF_CONFIG. This process is stopped (TensorFlow holds it while it waits, and "
        "ignores SIGTERM). Nothing was trained or written.")
    watchdog = subprocess.Popen(
        [sys.executable, "-S", "-c", _WATCHDOG, str(timeout_s), str(os.getpid()), message],
        stdin=subprocess.PIPE)
    try:
        return build()
    except tf.errors.OpError as e:
        raise ValueError(
            f"{me}: TensorFlow's cluster of TF_CONFIG did not form: "
            f"{(e.message or type(e).__name__).splitlines()[0]}. Check that every worker runs "
            f"with the same TF_CONFIG ({others}). Nothing was trained or written.") from None
    finally:
        watchdog.stdin.close()
        watchdog.wait()
