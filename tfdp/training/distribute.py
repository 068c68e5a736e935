"""tf.distribute strategies for DP training, and how a logical batch is split.

`make_strategy(name)` builds one of `STRATEGIES`:

| name                    | what it is                                               |
|-------------------------|----------------------------------------------------------|
| `default`               | one device, no replicas (`tf.distribute.get_strategy()`) |
| `mirrored`              | all local GPUs (or the CPU), `MirroredStrategy`          |
| `multi_worker_mirrored` | one process per worker, cluster from `TF_CONFIG`         |
| `tpu`                   | `TPUStrategy` on a Cloud TPU (VM: `tpu="local"`)         |

DP semantics under replicas and hosts (De et al. 2022, App. A.1, Algorithm 1).
One optimizer update consumes ONE logical Poisson batch, fed as R a chunks
(`distribute_chunks`, `tfdp.data.train_chunks`): R replicas over W hosts, a
accumulation chunks per replica, n slots per chunk.

Layout. Every host computes the same index vector B_t for step t: it is a
function of (secret sampling seed, t) only, and the chief's seed reaches the
workers by `broadcast_from_chief` and the checkpoint. Each host truncates B_t
to its first S = R a n indices (the static size; without one, n is the
smallest that holds B_t) and pads it with masked slots to S; slice
k = r a + j, slots [k n, (k + 1) n), is chunk j of replica r. A host reads and
decodes only the real indices of its own replicas' slices. The slices are a
partition of the S slots, so the union of what the hosts read is exactly the
truncated Poisson batch B'_t = the first min(|B_t|, S) indices of B_t, each
index exactly once.

Step. Replica r adds, over its chunks j, the clipped per-example gradients
of its real slots: sum_{i in slice(r, j), mask_i = 1} clip_C(g_i), where g_i
is example i's gradient averaged over its K views. The views of an example
depend only on (public augmentation seed, t, the example's pixels)
(`tfdp.augment.example_keyed_views`), not on its slot, chunk, replica or host.
Keras all-reduces the replicas' sums with a SUM, so the update's clipped sum
is s(B'_t) = sum_{i in B'_t} clip_C(g_i(x_i)), the same for every R, a, W.
Each replica adds an independent N(0, (sigma C)^2 / R) draw (`DPModel`), so the
noise of the logical batch is exactly N(0, (sigma C)^2); the optimizer then
divides by the expected batch size B (public).

Sensitivity for adjacent batches (add-or-remove one example x), D' = D + {x}.
Couple the two runs: the same Poisson coin for every shared example (the
coins are i.i.d. and secret, so this is a valid coupling wherever x sits in
the index order) and, with microbatches, the same secret i.i.d. microbatch id
for every shared example. Views need no coupling: they are a public function
of the example. Outside the truncation event (|B_t| < S for D', so also
for D), B'_t(D') = B'_t(D) or B'_t(D) + {x}: inserting x into the sorted
vector shifts later examples to other slots, chunks, replicas or hosts, but
s(.) is a sum over the SET of sampled examples of a term that depends on each
example alone (its clipped gradient at the step's shared parameters, with
views keyed by its own pixels), so it does not see where an example sat.
Hence s(B'_t(D')) - s(B'_t(D)) = clip_C(g_x) or 0, of norm <= C: sensitivity
C, as with one device (2C with microbatches: `DPModel` sums every
microbatch over chunks and replicas before clipping, so x changes one
microbatch mean). Masked slots contribute exactly 0 (the mask selects
terms; it is never a weight). On the truncation event the coupling fails;
its probability is eta = T P(Binomial(N + 1, q) > S) and it adds
(1 + e^eps) eta to delta (`tfdp.data.padding`). The cap S is on the logical
batch: a replica-chunk holds n = S / (R a) slots, and chunks are filled in
order, so the cap and its eta are those of the logical batch; no chunk is
truncated on its own. (Independent per-chunk caps would need more padding:
each chunk's count would need its own tail margin.)

Chief. Under `multi_worker_mirrored` every worker runs the same program (all
take part in the collectives, including the ones inside checkpoint saving), but
only the chief (`strategy.extended.should_checkpoint`) writes to the run's
workdir; the others write to a temporary directory that is deleted at the end
(the pattern of the TF multi-worker Keras tutorial).
"""

import atexit
import dataclasses
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import gin
import tensorflow as tf
from absl import logging

from tfdp import gin_bindings

STRATEGIES = ("default", "mirrored", "multi_worker_mirrored", "tpu")

# The arguments of `make_strategy` that each strategy reads (the run's strategy is
# `tfdp.RuntimeConfig.strategy`). A bound argument that it does not read (`tpu` or
# `devices` under "default") is refused before the run starts (`tfdp.main`).
READS = {
    "default": (),
    "mirrored": ("devices",),
    "multi_worker_mirrored": ("worker_timeout_s", "wait_log_every_s"),
    "tpu": ("tpu",),
}
gin_bindings.declare_branches("tfdp.training.make_strategy",
                              setting=("tfdp.RuntimeConfig", "strategy"),
                              what="strategy", reads=READS)


# How long a multi_worker_mirrored worker waits for the others to start, and how often it
# says so (`wait_for_workers`).
WORKER_TIMEOUT_S = 600
WAIT_LOG_EVERY_S = 30
# The jobs of a TF_CONFIG cluster that train (`MultiWorkerMirroredStrategy`'s collectives).
_TRAINING_JOBS = ("chief", "worker")


@gin.configurable(module="tfdp.training", denylist=["name"])
def make_strategy(name="default", *, tpu="local", devices=None,
                  worker_timeout_s=WORKER_TIMEOUT_S, wait_log_every_s=WAIT_LOG_EVERY_S):
    """Builds the tf.distribute strategy called `name`.

    Create it before any other TensorFlow op of the process:
    `multi_worker_mirrored` configures collective ops, which is only possible
    at program start, and `tpu` initializes the TPU system (which resets the
    TPU's memory).

    Args:
      name: one of `STRATEGIES`.
      tpu: for `tpu`: "local" on a Cloud TPU VM (the TPU is attached to this
        host), else the TPU name or `grpc://` address of a TPU node or pod
        (`TPUClusterResolver(tpu=...)`).
      devices: for `mirrored`: device names (e.g. `["/gpu:0", "/gpu:1"]`), or
        None for every local GPU (the CPU if there is none).
      worker_timeout_s: for `multi_worker_mirrored`: seconds to wait for every
        other worker of TF_CONFIG to start (`wait_for_workers`) before stopping
        with an error, and again for TensorFlow's cluster to form after that
        (`_join_cluster`); TensorFlow itself would wait forever, silently.
      wait_log_every_s: seconds between the log lines that name the workers
        still awaited.

    Returns:
      A `tf.distribute.Strategy`; `strategy.num_replicas_in_sync` is R.

    Raises:
      ValueError: on an unknown name (the message lists `STRATEGIES`); for
        `multi_worker_mirrored` without a valid `TF_CONFIG` environment
        variable (JSON with a cluster, the task's type and index, and every
        address as host:port, no two the same), or when a worker has not
        started within `worker_timeout_s`; for `default` with a TF_CONFIG
        cluster of several tasks (each would train alone). If TensorFlow's
        cluster then does not form within `worker_timeout_s`, the process is
        stopped (SIGKILL) with a message on stderr (`_join_cluster`).
      tf.errors.NotFoundError: for `tpu` when no TPU is reachable.
    """
    if name not in STRATEGIES:
        raise ValueError(
            f"Unknown strategy {name!r}; use one of {', '.join(STRATEGIES)} "
            "(e.g. --gin_param=\"tfdp.RuntimeConfig.strategy = 'mirrored'\")."
        )
    if name != "multi_worker_mirrored":
        _check_no_cluster(name)
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "mirrored":
        return tf.distribute.MirroredStrategy(devices=devices)
    if name == "multi_worker_mirrored":
        config = _check_tf_config()
        wait_for_workers(config, timeout_s=worker_timeout_s, log_every_s=wait_log_every_s)
        return _join_cluster(config, worker_timeout_s)
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
    tf.config.experimental_connect_to_cluster(resolver)  # a no-op for tpu="local"
    tf.tpu.experimental.initialize_tpu_system(resolver)
    return tf.distribute.TPUStrategy(resolver)


def is_chief(strategy):
    """True on the one process that writes the run's outputs.

    Every process of `default`, `mirrored` and `tpu`; under
    `multi_worker_mirrored` only the chief (the `chief` task, or `worker` 0 when
    the cluster has no `chief`).
    """
    return bool(strategy.extended.should_checkpoint)


def task_id(strategy):
    """The worker's index under `multi_worker_mirrored` (0 otherwise)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    return int(getattr(resolver, "task_id", 0) or 0)


def output_dir(workdir, strategy):
    """Where this process writes: `workdir` on the chief, a fresh temp dir otherwise.

    Non-chief workers must still write (saving checkpoints and SavedModels
    may run collective ops that every worker joins), but their copies are
    thrown away: the caller deletes the returned directory when it is not
    `workdir`, and it is also deleted when the process exits (even on an
    error; not on SIGKILL).
    """
    if is_chief(strategy):
        return workdir
    path = tempfile.mkdtemp(prefix=f"tfdp_worker{task_id(strategy)}_")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def broadcast_from_chief(strategy, value: int) -> int:
    """Every worker gets the chief's `value` (an int64), e.g. the secret sampling seed.

    Each worker process draws its own secret seeds, but the Poisson batches
    must be the same on every worker (`distribute_logical_batches`). Under
    `multi_worker_mirrored` the value is all-reduced (SUM) with only global
    replica 0, on the chief, contributing it; nothing is written or logged.
    Single-process strategies return `value` unchanged.

    Args:
      strategy: the run's strategy.
      value: this process's value, an int in [0, 2**63).

    Returns:
      The chief's value, a Python int.
    """
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return int(value)

    def replica_fn():
        context = tf.distribute.get_replica_context()
        first = tf.equal(context.replica_id_in_sync_group, 0)
        mine = tf.where(first, tf.constant(int(value), tf.int64), tf.constant(0, tf.int64))
        return context.all_reduce(tf.distribute.ReduceOp.SUM, mine)

    result = strategy.run(replica_fn)
    return int(strategy.experimental_local_results(result)[0].numpy())


def per_replica_batch_size(static_batch_size, num_replicas, accumulation_steps=1):
    """Examples per replica per step for a static logical batch, with a clear error.

    Args:
      static_batch_size: S, the padded logical batch (examples per update,
        over all replicas and accumulation chunks).
      num_replicas: R, `strategy.num_replicas_in_sync`.
      accumulation_steps: a, chunks each replica processes one after another.

    Returns:
      S / R, a Python int (each of the a chunks then has S / (R a) examples).

    Raises:
      ValueError: if S is not a positive multiple of R * a; the message gives
        the nearest valid sizes.
    """
    unit = int(num_replicas) * int(accumulation_steps)
    if static_batch_size < 1 or static_batch_size % unit:
        lower = max(unit, static_batch_size // unit * unit)
        upper = -(-static_batch_size // unit) * unit
        raise ValueError(
            f"static_batch_size={static_batch_size} cannot be split into {num_replicas} "
            f"replicas x {accumulation_steps} accumulation steps of equal size: it must be a "
            f"multiple of {unit} (e.g. {lower} or {upper}), or 'auto'."
        )
    return static_batch_size // int(num_replicas)


def distribute_logical_batches(strategy, dataset, *, per_replica_size=None):
    """Gives every replica its contiguous slice of each logical batch.

    Each element of `dataset` is one logical batch `(images, labels, mask)`
    whose length is a multiple of R (see `tfdp.data.pad_batches`). Replica r
    (its `replica_id_in_sync_group`) receives rows
    `[r * n, (r + 1) * n)`, n = length / R, of the same element on every
    worker, so one `train_step` over all replicas sees exactly one logical
    batch. (Keras' default `experimental_distribute_dataset` would instead
    auto-shard ELEMENTS across workers: each worker would train on a
    different Poisson batch in the same update.)

    Args:
      strategy: the strategy of the run.
      dataset: `tf.data.Dataset` of `(images [b, ...], labels [b],
        mask float32 [b])` with b a multiple of R, identical on every worker
        (the Poisson sampler is keyed by (seed, step), so it is).
      per_replica_size: n as a Python int when b is static (static shapes
        for XLA/TPU), or None.

    Returns:
      `tf.distribute.DistributedDataset` for `model.fit`, or `dataset` itself
      when R == 1.
    """
    num_replicas = strategy.num_replicas_in_sync
    if num_replicas == 1:
        return dataset

    def split(*tensors):
        def per_replica(t):
            n = tf.shape(t)[0] // num_replicas
            out = tf.reshape(t, tf.concat([[num_replicas, n], tf.shape(t)[1:]], 0))
            # Keep every dimension that is static (all of them for XLA/TPU).
            return tf.ensure_shape(out, [num_replicas, per_replica_size, *t.shape[1:]])

        return tuple(per_replica(t) for t in tensors)

    def dataset_fn(input_context):
        local = _local_replicas(num_replicas, input_context)
        # Consecutive elements go to this worker's local replicas in turn.
        return dataset.map(split).flat_map(
            lambda *t: tf.data.Dataset.from_tensor_slices(t).skip(local.start).take(len(local))
        ).prefetch(tf.data.AUTOTUNE)

    return strategy.distribute_datasets_from_function(dataset_fn)


@dataclasses.dataclass(frozen=True)
class ChunkedInput:
    """Training input as accumulation chunks: `DPModel.fit` takes a of them per update.

    Attributes:
      dataset: a `tf.data.Dataset` (one replica) or `tf.distribute.DistributedDataset`
        whose elements are chunks `(images [n, ...], labels [n], mask [n])`,
        consumed a per replica and update (`tfdp.data.train_chunks`).
      accumulation_steps: a, chunks per replica and update; must equal the
        DPModel's.
    """

    dataset: object
    accumulation_steps: int


def distribute_chunks(strategy, make_chunks, *, accumulation_steps):
    """Each host reads its own replicas' chunks of every logical batch (see module doc).

    Uses `strategy.distribute_datasets_from_function` for every strategy
    (MirroredStrategy, MultiWorkerMirroredStrategy, TPUStrategy): its
    `InputContext` tells each host (input pipeline) which replicas are its
    own, and each host builds a pipeline over only their slices. Consecutive
    elements of a host's pipeline go to its replicas in turn.

    Args:
      strategy: the run's strategy (R = `num_replicas_in_sync`).
      make_chunks: `fn(replicas: range) -> tf.data.Dataset` of the chunks of
        those global replica ids, in the order of `tfdp.data.train_chunks`.
      accumulation_steps: a, chunks per replica and update.

    Returns:
      A `ChunkedInput` for `DPModel.fit`.
    """
    num_replicas = strategy.num_replicas_in_sync
    if num_replicas == 1:
        return ChunkedInput(make_chunks(range(1)), int(accumulation_steps))

    def dataset_fn(input_context):
        return make_chunks(_local_replicas(num_replicas, input_context))

    return ChunkedInput(strategy.distribute_datasets_from_function(dataset_fn),
                        int(accumulation_steps))


def _local_replicas(num_replicas, input_context):
    """The global replica ids of this host (input pipeline): a contiguous range.

    Raises:
      ValueError: if the replicas do not split evenly over the hosts. Hosts with unequal
        replica counts would leave chunks unread and shift later steps' chunks: an update
        would no longer be one Poisson batch.
    """
    local, uneven = divmod(num_replicas, input_context.num_input_pipelines)
    if uneven or input_context.num_replicas_in_sync != num_replicas:
        raise ValueError(
            f"{num_replicas} replicas do not split evenly over "
            f"{input_context.num_input_pipelines} hosts (input pipelines); give every "
            "host the same number of devices.")
    first = input_context.input_pipeline_id * local
    return range(first, first + local)


class _MultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """`MultiWorkerMirroredStrategy` that Keras 3's `fit` can train with.

    Keras 3.15's `fit` under this strategy fails twice in
    `keras/src/backend/tensorflow/trainer.py` (keras-team/keras#20585, open):

    1. `_maybe_symbolic_build` calls `strategy.reduce("MEAN", batch, axis=None)`
       on the whole first input batch `(images, labels, mask)`, only to build a
       model symbolically (a no-op for a built model), and
       MultiWorkerMirroredStrategy cannot reduce a nested structure ("Attempt
       to convert a value (PerReplica...)"). For a nested structure this
       `reduce` returns this worker's first replica's values (enough for shapes
       and dtypes).
    2. `reduce_per_replica` averages the step's scalar metrics with
       `strategy.reduce("MEAN", v, axis=0)`, and a scalar has no axis 0. For
       per-replica scalars this `reduce` uses `axis=None`: the mean over the
       replicas, which is what Keras means.

    Every other call is `MultiWorkerMirroredStrategy.reduce` unchanged.
    """

    def reduce(self, reduce_op, value, axis):
        if isinstance(value, (tuple, list, dict)):
            return tf.nest.map_structure(lambda v: self.experimental_local_results(v)[0], value)
        if axis is not None and all(
            getattr(v, "shape", None) is not None and v.shape.rank == 0
            for v in self.experimental_local_results(value)
        ):
            axis = None
        return super().reduce(reduce_op, value, axis)


def _check_tf_config():
    """The parsed TF_CONFIG of a multi-worker run, every address checked.

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


def _check_no_cluster(name):
    """Refuses a TF_CONFIG cluster of several tasks under a single-process strategy.

    Every worker started with the same command and TF_CONFIG would then train
    its own model alone, on its own secret seeds. A cluster of one task (a
    launcher that always sets TF_CONFIG) is only logged.
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
      config: the parsed TF_CONFIG (`_check_tf_config`).
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
                continue  # refused by _check_tf_config, with its own message
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


def _join_cluster(config, timeout_s):
    """`_MultiWorkerMirroredStrategy()`, or this process stopped after `timeout_s`.

    Every worker has answered the start check (`wait_for_workers`), but one
    may stop before it joins TensorFlow's cluster, and TensorFlow would then
    wait for it forever. A watchdog process stops this one after `timeout_s`,
    with a message naming the other workers; its exit status is then that of
    SIGKILL (137 in a shell).

    Raises:
      ValueError: TensorFlow's cluster setup failed (e.g. a deadline).
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
        return _MultiWorkerMirroredStrategy()
    except tf.errors.OpError as e:
        raise ValueError(
            f"{me}: TensorFlow's cluster of TF_CONFIG did not form: "
            f"{(e.message or type(e).__name__).splitlines()[0]}. Check that every worker runs "
            f"with the same TF_CONFIG ({others}). Nothing was trained or written.") from None
    finally:
        watchdog.stdin.close()
        watchdog.wait()
