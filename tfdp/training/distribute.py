"""tf.distribute strategies for DP training, and how a logical batch is split.

`make_strategy(name)` builds one of `STRATEGIES`:

| name                    | what it is                                               |
|-------------------------|----------------------------------------------------------|
| `default`               | one device, no replicas (`tf.distribute.get_strategy()`) |
| `mirrored`              | all local GPUs (or the CPU), `MirroredStrategy`          |
| `multi_worker_mirrored` | one process per worker, cluster from `TF_CONFIG`         |
| `tpu`                   | `TPUStrategy` on a Cloud TPU (VM: `tpu="local"`)         |

Before `multi_worker_mirrored` is built, `tfdp.cluster` checks TF_CONFIG,
finds every other worker, and bounds the wait for TensorFlow's cluster.

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
import shutil
import tempfile

import gin
import tensorflow as tf

from tfdp import cluster
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


@gin.configurable(module="tfdp.training", denylist=["name"])
def make_strategy(name="default", *, tpu="local", devices=None,
                  worker_timeout_s=cluster.WORKER_TIMEOUT_S,
                  wait_log_every_s=cluster.WAIT_LOG_EVERY_S):
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
        other worker of TF_CONFIG to start (`tfdp.cluster.wait_for_workers`)
        before stopping with an error, and again for TensorFlow's cluster to
        form after that (`tfdp.cluster.join_cluster`); TensorFlow itself would
        wait forever, silently.
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
        stopped (SIGKILL) with a message on stderr
        (`tfdp.cluster.join_cluster`).
      tf.errors.NotFoundError: for `tpu` when no TPU is reachable.
    """
    if name not in STRATEGIES:
        raise ValueError(
            f"Unknown strategy {name!r}; use one of {', '.join(STRATEGIES)} "
            "(e.g. --gin_param=\"tfdp.RuntimeConfig.strategy = 'mirrored'\")."
        )
    if name != "multi_worker_mirrored":
        cluster.check_no_cluster(name)
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "mirrored":
        return tf.distribute.MirroredStrategy(devices=devices)
    if name == "multi_worker_mirrored":
        config = cluster.check_tf_config()
        cluster.wait_for_workers(config, timeout_s=worker_timeout_s,
                                 log_every_s=wait_log_every_s)
        return cluster.join_cluster(config, worker_timeout_s, _MultiWorkerMirroredStrategy)
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
