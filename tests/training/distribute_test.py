"""DP-SGD under tf.distribute: exact noise, replica invariance, masking, EMA, strategies.

Logical CPU devices must be configured before TensorFlow initializes, so the
multi-replica scenarios run once per session in subprocesses (`_SCRIPT`) that split the
CPU into 4 logical devices and, for R = 1, 2 and 4 replicas of a
`MirroredStrategy`, train a DPModel through `fit` (Keras' own distribution
path) on batches split by `tfdp.training.distribute`. They write the weight
updates to .npy files that the tests below check. The noise and the
microbatch-sensitivity scenarios run on both input layouts: whole logical
batches (`distribute_logical_batches`) and the path the trainer runs,
accumulation chunks (`distribute_chunks` -> `ChunkedInput`, a = 2). The
default suite runs R = 2 on the trainer's layout and R = 1's reference update;
R = 2 on whole logical batches (its updates without noise are checked by
default), R = 1's noise and microbatch scenarios (one replica:
`tests/training/dp_model_test.py` checks the same std and sensitivity) and R = 4
run under `-m slow`.
"""

import functools
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from tfdp import accounting
from tfdp.dp import precision
from tfdp.training import distribute
from tfdp.training.dp_model import DPModel

REPLICAS = (1, 2, 4)


class _Noiseless(DPModel):
    """A test double without noise: the arithmetic of clipping and division alone."""

    def add_noise(self, summed):
        return summed


def _mechanism(l2_clip_norm, batch_size):
    return accounting.DPMechanism(num_examples=1000, batch_size=batch_size, num_steps=10,
                                  noise_multiplier=1.0, l2_clip_norm=l2_clip_norm, delta=1e-5)
SIGMA, CLIP, BATCH = 2.0, 0.5, 50  # noise std of the update: 2 * 0.5 / 50 = 0.02

_SCRIPT = r'''
import sys
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
import keras
from tfdp import accounting
from tfdp import data
from tfdp.training import distribute
from tfdp.training.dp_model import DPModel

# A run is R and what it does: "1u" R = 1's reference update (scenario 2) alone; "2c" the
# update and the chunked layout's scenarios; "2b" the logical batches' scenarios alone; "4"
# all of them.
out, runs = sys.argv[1], sys.argv[2].split(",")
SIGMA, CLIP, BATCH = 2.0, 0.5, 50
devices = [d.name for d in tf.config.list_logical_devices("CPU")]


class Noiseless(DPModel):
    def add_noise(self, summed):
        return summed


class FixedIds(Noiseless):
    """Microbatch ids of the whole logical batch from a table; replica r takes its slice."""

    def draw_microbatch_ids(self, mask):
        n = tf.shape(mask)[0]
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        return tf.slice(self.id_table, [replica * n], [n])


class IdsInData(Noiseless):
    """Chunked input: each slot's microbatch id is its third input column, which the
    model slices off (so it changes no gradient)."""

    def _contribution(self, data):
        self._ids = tf.cast(data[0][:, 2], tf.int32)
        return super()._contribution(data)

    def draw_microbatch_ids(self, mask):
        return self._ids


def mechanism(l2_clip_norm, noise_multiplier, batch_size, num_microbatches=None):
    return accounting.DPMechanism(
        num_examples=1000, batch_size=int(batch_size), num_steps=10,
        noise_multiplier=noise_multiplier or 1.0, l2_clip_norm=l2_clip_norm, delta=1e-5,
        num_microbatches=num_microbatches)


def build(strategy, hidden, *, l2_clip_norm, noise_multiplier, batch_size, cls=None, **kwargs):
    cls = cls or (Noiseless if noise_multiplier == 0 else DPModel)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        x = keras.layers.Dense(hidden, activation="tanh")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(10)(x))
        dp = cls(model, mechanism(l2_clip_norm, noise_multiplier, batch_size), noise_seed=3,
                 **kwargs)
        dp.compile(optimizer=keras.optimizers.SGD(1.0))
    return model, dp


def clipped_sums(dp, kernel, fit_input, steps, before_step=None):
    """ONE `fit` of `steps` updates, each from a zero kernel: the clipped sum of each step.

    A callback zeroes the kernel (and calls `before_step(step)`) before every step and
    reads the update after it; a fit per step cost 0.3-0.4 s each (32 per layout and R).
    """
    sums = []

    class FromZero(keras.callbacks.Callback):
        def on_train_batch_begin(self, step, logs=None):
            kernel.assign(tf.zeros_like(kernel))
            if before_step is not None:
                before_step(step)

        def on_train_batch_end(self, step, logs=None):
            sums.append(-2.0 * kernel.numpy())  # SGD lr 1: update = -clipped sum / M, M = 2

    dp.fit(fit_input, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[FromZero()])
    assert len(sums) == steps and int(dp.optimizer.iterations.numpy()) == steps
    return sums


def adjacent_pairs():
    """(ids of D's 3 examples, ids of D''s 4) for every assignment of 2 microbatches."""
    return [(list(ids), [added, *ids]) for ids in np.ndindex(2, 2, 2) for added in range(2)]


def microbatch_deltas(strategy, r):
    """||clipped sum(D') - clipped sum(D)|| over every assignment of 2 microbatches.

    D = [-3, 2, -1] and D' = [4, -3, 2, -1] (times 10 e_1), padded with masked slots
    to 4 rows, so replica r holds a different slice of D and D' (R = 2: [d0, d1 | d2, pad]
    vs [x, d0 | d1, d2]). Linear model, zero kernel, label 0, C = 1; the shared examples
    keep their ids.
    """
    with strategy.scope():
        inputs = keras.Input((2,))
        model = keras.Model(inputs, keras.layers.Dense(
            10, use_bias=False, kernel_initializer="zeros")(inputs))
        dp = FixedIds(model, mechanism(1.0, 0.0, 4, num_microbatches=2))
        dp.compile(optimizer=keras.optimizers.SGD(1.0))
        dp.id_table = tf.Variable(tf.zeros([8], tf.int32), trainable=False)

    def batch(cs):
        rows = [[10.0 * c, 0.0] for c in cs] + [[0.0, 0.0]] * (4 - len(cs))
        mask = [1.0] * len(cs) + [0.0] * (4 - len(cs))
        return np.array(rows, np.float32), np.zeros([4], np.int32), np.array(mask, np.float32)

    # Steps 2k and 2k + 1: D, then D', under the k-th assignment.
    batches, tables = [], []
    for ids, ids_added in adjacent_pairs():
        batches += [batch([-3, 2, -1]), batch([4, -3, 2, -1])]
        tables += [ids + [0] * 5, ids_added + [0] * 4]
    ds = tf.data.Dataset.from_tensor_slices(tuple(np.stack(t) for t in zip(*batches)))
    sums = clipped_sums(dp, model.trainable_variables[0],
                        distribute.distribute_logical_batches(strategy, ds), len(batches),
                        lambda step: dp.id_table.assign(tables[step]))
    return np.array([np.linalg.norm(sums[2 * k + 1] - sums[2 * k])
                     for k in range(len(sums) // 2)])


A = 2  # accumulation chunks per replica on the chunked path


def chunk_elements(slots, r):
    """The chunk elements of one logical batch [S, ...] (S = r A n) in the order a host deals
    them to its replicas: chunk 0 of every replica, then chunk 1 (tfdp.data.train_chunks)."""
    n = len(slots) // (r * A)
    return [slots[(q * A + j) * n:(q * A + j + 1) * n] for j in range(A) for q in range(r)]


def chunked_input(strategy, r, elements):
    """A ChunkedInput of `elements` ((images, labels, mask) chunks, dealing order)."""
    ds = tf.data.Dataset.from_tensor_slices(tuple(np.stack(t) for t in zip(*elements)))
    return distribute.distribute_chunks(strategy, lambda replicas: ds, accumulation_steps=A)


def microbatch_deltas_chunked(strategy, r):
    """`microbatch_deltas` on the trainer's path: R replicas x A chunks of n slots.

    The slots hold D = [-3, 2, -1] or D' = [4, -3, 2, -1] (times 10 e_1) then masked
    padding; replica q's chunk j is slots [(q A + j) n, (q A + j + 1) n), so adding the
    first example shifts every other one into another chunk or replica. Each slot's
    microbatch id rides in its third input column; the shared examples keep theirs.
    """
    slots_total = max(4, r * A)
    with strategy.scope():
        inputs = keras.Input((3,))
        features = keras.layers.Lambda(lambda t: t[:, :2])(inputs)
        model = keras.Model(inputs, keras.layers.Dense(
            10, use_bias=False, kernel_initializer="zeros")(features))
        dp = IdsInData(model, mechanism(1.0, 0.0, 4, num_microbatches=2), accumulation_steps=A)
        dp.compile(optimizer=keras.optimizers.SGD(1.0))

    def step_elements(cs, ids):
        pad = slots_total - len(cs)
        rows = [[10.0 * c, 0.0, float(i)] for c, i in zip(cs, ids)] + [[0.0, 0.0, 0.0]] * pad
        slots = list(zip(np.array(rows, np.float32), np.zeros(slots_total, np.int32),
                         np.array([1.0] * len(cs) + [0.0] * pad, np.float32)))
        return [tuple(np.stack(t) for t in zip(*chunk)) for chunk in chunk_elements(slots, r)]

    # Steps 2k and 2k + 1: D, then D', under the k-th assignment (r A chunks a step).
    elements = []
    for ids, ids_added in adjacent_pairs():
        elements += step_elements([-3, 2, -1], ids) + step_elements([4, -3, 2, -1], ids_added)
    steps = len(elements) // (r * A)
    sums = clipped_sums(dp, model.trainable_variables[0], chunked_input(strategy, r, elements),
                        steps)
    return np.array([np.linalg.norm(sums[2 * k + 1] - sums[2 * k]) for k in range(steps // 2)])


def fit(strategy, dp, model, ds, steps):
    before = [w.numpy().copy() for w in model.trainable_variables]
    dp.fit(distribute.distribute_logical_batches(strategy, ds), epochs=1, steps_per_epoch=steps,
           verbose=0)
    assert int(dp.optimizer.iterations.numpy()) == steps
    return np.concatenate([(w.numpy() - b).ravel()
                           for w, b in zip(model.trainable_variables, before)])


rng = np.random.default_rng(0)
sizes = [7, 3, 0, 5]  # Poisson-like: uneven, one empty batch
xs = [rng.normal(size=(n, 8)).astype(np.float32) for n in sizes]
ys = [rng.integers(0, 10, n).astype(np.int32) for n in sizes]
spec = (tf.TensorSpec([None, 8], tf.float32), tf.TensorSpec([None], tf.int32))


def variable_batches():
    return tf.data.Dataset.from_generator(lambda: iter(zip(xs, ys)), output_signature=spec)


for run in runs:
    r, only = int(run.rstrip("ubc")), run.lstrip("0123456789")
    strategy = tf.distribute.MirroredStrategy(devices[:r])
    batches, chunks = only in ("", "b"), only in ("", "c")
    # 1. All examples masked: the update is exactly -noise / B.
    if batches:
        model, dp = build(strategy, 400, l2_clip_norm=CLIP, noise_multiplier=SIGMA,
                          batch_size=BATCH)
        zero = tf.data.Dataset.from_tensors((tf.ones([8, 8]), tf.zeros([8], tf.int32),
                                             tf.zeros([8])))
        np.save(f"{out}/noise_batches_{r}.npy", fit(strategy, dp, model, zero, 1))
        # 3. Microbatches that span replicas: the sensitivity stays 2C.
        np.save(f"{out}/microbatch_deltas_batches_{r}.npy", microbatch_deltas(strategy, r))
    if only == "b":
        continue
    # 2. No noise, variable batches padded with masked zeros to a multiple of R
    #    (R = 2: 7 -> 8, 3 -> 4, 0 -> 2, 5 -> 6 slots), EMA on, 4 updates.
    model, dp = build(strategy, 16, l2_clip_norm=0.05, noise_multiplier=0.0, batch_size=10.0,
                      ema_decay=0.9, accumulation_steps=2)
    padded = data.pad_batches(variable_batches(), multiple=r)
    np.save(f"{out}/update_{r}.npy", fit(strategy, dp, model, padded, 4))
    # Every replica's own copy of the EMA variables: [r, num_ema_values].
    np.save(f"{out}/ema_{r}.npy", np.stack([
        np.concatenate([strategy.experimental_local_results(e.value)[i].numpy().ravel()
                        for e in dp.ema_variables]) for i in range(r)]))
    if not chunks:
        continue
    # 1b. Scenario 1 on the chunked path: A all-masked chunks per replica, one update.
    model, dp = build(strategy, 400, l2_clip_norm=CLIP, noise_multiplier=SIGMA, batch_size=BATCH,
                      accumulation_steps=A)
    masked = (np.ones([2, 8], np.float32), np.zeros([2], np.int32), np.zeros([2], np.float32))
    before = [w.numpy().copy() for w in model.trainable_variables]
    dp.fit(chunked_input(strategy, r, [masked] * (r * A)), epochs=1, steps_per_epoch=1,
           verbose=0)
    assert int(dp.optimizer.iterations.numpy()) == 1
    np.save(f"{out}/noise_chunks_{r}.npy", np.concatenate(
        [(w.numpy() - b).ravel() for w, b in zip(model.trainable_variables, before)]))
    # 3b. Microbatches that span replicas and chunks: the sensitivity stays 2C.
    np.save(f"{out}/microbatch_deltas_chunks_{r}.npy", microbatch_deltas_chunked(strategy, r))
'''


def _run_replica_script(counts, out):
    script = out / "replicas.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(script), str(out), counts], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def replica_runs(once_per_session):
    """A loader of `_SCRIPT`'s .npy files (`name_R`), running the script on first use.

    R = 1's reference update and R = 2 (but its logical-batch scenarios) in one
    process, R = 4 in another (MirroredStrategy's collective group keys clash
    when strategies over 2 and then 4 of the same devices are created in one
    process; R = 1 never all-reduces), each once for both xdist workers. The
    R = 4 process, R = 1's other scenarios and R = 2's logical-batch ones start
    only when a `-m slow` test asks.
    """
    folders = {}

    def load(name):
        if name.endswith("_4"):
            counts = "4"
        elif name.endswith("_1") and not name.startswith(("update_", "ema_")):
            counts = "1"
        elif name.endswith("_batches_2"):
            counts = "2b"
        else:
            counts = "1u,2c"
        if counts not in folders:
            try:
                folders[counts] = once_per_session(
                    f"distribute_replicas_{counts}",
                    functools.partial(_run_replica_script, counts))
            except (AssertionError, subprocess.TimeoutExpired) as failed:
                folders[counts] = failed  # the next tests fail at once, not after another run
        if isinstance(folders[counts], Exception):
            raise folders[counts]
        return np.load(folders[counts] / f"{name}.npy")

    return load


# The default suite runs R = 2 and R = 1's reference update; R = 4 (its own process: 20 s of
# the 2 cores) runs under -m slow, and so do R = 1's noise and microbatch cases (one replica:
# dp_model_test.py's noise and sensitivity tests). R = 2 already splits every logical batch,
# chunk and microbatch over replicas: R = 4 checks the same arithmetic. The noise and
# microbatch cases of R = 2 run on the trainer's layout (chunks) by default; on whole logical
# batches (Keras' own distribution of a user's `fit`) under -m slow (8 s of the 2 cores),
# while R = 2's updates without noise take that layout by default.
REPLICA_PARAMS = [pytest.param(r, marks=[pytest.mark.slow] if r == 4 else []) for r in REPLICAS]
SPLIT_PARAMS = [
    pytest.param(r, layout, marks=[pytest.mark.slow] if (r, layout) != (2, "chunks") else [])
    for r in REPLICAS for layout in ("batches", "chunks")]


@pytest.mark.parametrize("replicas, layout", SPLIT_PARAMS)
def test_summed_noise_has_std_sigma_c_over_b_for_every_replica_count(replica_runs, replicas,
                                                                   layout):
    # Zero gradients (all-zero mask), SGD at lr 1: the update is -(sum of the R
    # replicas' draws) / B, each draw N(0, (sigma C / sqrt(R))^2): std sigma C / B.
    # Shared draws would give sqrt(R) times that and fail the first KS test; noise per
    # chunk instead of per logical batch would give sqrt(2) times that.
    deltas = replica_runs(f"noise_{layout}_{replicas}")
    assert deltas.size == 8 * 400 + 400 + 400 * 10 + 10
    expected = SIGMA * CLIP / BATCH
    assert stats.kstest(deltas, "norm", args=(0, expected)).pvalue > 1e-3
    for wrong in (expected * 2 / 3, expected * 3 / 2):
        assert stats.kstest(deltas, "norm", args=(0, wrong)).pvalue < 1e-6


@pytest.mark.parametrize("replicas", REPLICA_PARAMS[1:])
def test_without_noise_replicas_give_the_single_replica_update(replica_runs, replicas):
    # 4 updates on batches of 7, 3, 0 and 5 examples, accumulation_steps = 2.
    np.testing.assert_allclose(replica_runs(f"update_{replicas}"), replica_runs("update_1"),
                               rtol=1e-5, atol=1e-7)
    assert np.abs(replica_runs("update_1")).sum() > 0


def test_masked_padding_contributes_nothing():
    # Replicas: the padded slots above (zero images, label 0, mask 0) would change
    # update_2 and update_4 if they counted. Here: 5 real examples plus 3 garbage
    # rows (1e3 * N(0, 1) inputs, label 9, mask 0) give the update of the 5 alone.
    rng = np.random.default_rng(2)
    x = rng.normal(size=(5, 8)).astype(np.float32)
    y = rng.integers(0, 9, 5).astype(np.int32)
    garbage = (1e3 * rng.normal(size=(3, 8))).astype(np.float32)
    updates = []
    for batch in ((x, y), (np.concatenate([x, garbage]), np.concatenate([y, [9, 9, 9]]),
                           np.array([1, 1, 1, 1, 1, 0, 0, 0], np.float32))):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Dense(16)(inputs)))
        dp = _Noiseless(model, _mechanism(0.05, 10))
        dp.compile(optimizer=keras.optimizers.SGD(1.0))
        before = [w.numpy().copy() for w in model.trainable_variables]
        logs = dp.train_step(tuple(tf.constant(t) for t in batch))
        assert float(logs["loss"]) < 100  # garbage is not counted in the metrics either
        updates.append([w.numpy() - b for w, b in zip(model.trainable_variables, before)])
    for a, b in zip(*updates):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("replicas, layout", SPLIT_PARAMS)
def test_microbatched_sensitivity_is_2c_across_replicas(replica_runs, replicas, layout):
    # Adjacent batches built by hand (tests/training/dp_model_test.py has the same with
    # 1, 2 and 4 accumulation chunks of one batch): adding one example moves the others
    # to another replica (and chunk), but microbatches are summed over all chunks and
    # replicas before clipping, so only the added example's microbatch changes.
    # Each unit is clipped to C / (1 + kappa): 2C becomes 2C / (1 + kappa).
    deltas = replica_runs(f"microbatch_deltas_{layout}_{replicas}")
    assert deltas.shape == (16,)
    clipped_to = 1.0 / (1 + precision.CLIP_MARGINS["float32"])
    assert deltas.max() <= 2.0 * clipped_to + 3e-6
    assert deltas.max() >= 2.0 * clipped_to - 3e-6


@pytest.mark.parametrize("replicas", REPLICA_PARAMS[1:])
def test_ema_copies_stay_identical_and_equal_the_single_replica_ema(replica_runs, replicas):
    copies = replica_runs(f"ema_{replicas}")  # [replicas, num_ema_values]
    assert copies.shape[0] == replicas
    for copy in copies[1:]:
        np.testing.assert_array_equal(copy, copies[0])
    np.testing.assert_allclose(copies[0], replica_runs("ema_1")[0], rtol=1e-5, atol=1e-7)


def test_make_strategy_lists_the_valid_names():
    with pytest.raises(ValueError, match="default, mirrored, multi_worker_mirrored, tpu"):
        distribute.make_strategy("horovod")
    strategy = distribute.make_strategy("default")
    assert strategy.num_replicas_in_sync == 1 and distribute.is_chief(strategy)


def test_per_replica_batch_size_reports_a_mismatch():
    assert distribute.per_replica_batch_size(48, 4, accumulation_steps=2) == 12  # 48 / 4
    with pytest.raises(ValueError, match=r"multiple of 8 \(e.g. 48 or 56\)"):
        distribute.per_replica_batch_size(50, 4, accumulation_steps=2)


def test_one_replica_keeps_the_dataset():
    ds = tf.data.Dataset.range(3)
    assert distribute.distribute_logical_batches(tf.distribute.get_strategy(), ds) is ds


@pytest.mark.slow
def test_static_chunks_give_the_update_of_variable_chunks():
    # The same 8 examples (2 masked) in 4 chunks: static [4, 2, ...] reshape
    # (XLA/TPU path) vs dynamic slicing of a batch of unknown size.
    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(size=(8, 8)), tf.float32)
    y = tf.constant(rng.integers(0, 10, 8), tf.int32)
    mask = tf.constant([1, 1, 0, 1, 1, 1, 0, 1], tf.float32)
    updates = []
    for signature in (tf.TensorSpec([8], tf.int32), tf.TensorSpec([None], tf.int32)):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Dense(16)(inputs)))
        dp = _Noiseless(model, _mechanism(0.05, 10), accumulation_steps=4)
        dp.compile(optimizer=keras.optimizers.SGD(1.0))
        step = tf.function(dp.train_step, input_signature=[(
            tf.TensorSpec([signature.shape[0], 8], tf.float32), signature,
            tf.TensorSpec(signature.shape, tf.float32))])
        before = [w.numpy().copy() for w in model.trainable_variables]
        step((x, y, mask))
        updates.append([w.numpy() - b for w, b in zip(model.trainable_variables, before)])
    for a, b in zip(*updates):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)


def test_replicas_that_do_not_split_evenly_over_hosts_are_refused():
    class ThreeHosts:  # 4 replicas over 3 input pipelines
        num_replicas_in_sync = 4

        @staticmethod
        def distribute_datasets_from_function(dataset_fn):
            return dataset_fn(tf.distribute.InputContext(
                num_input_pipelines=3, input_pipeline_id=0, num_replicas_in_sync=4))

    with pytest.raises(ValueError, match="do not split evenly over 3 hosts"):
        distribute.distribute_chunks(ThreeHosts(), lambda replicas: None, accumulation_steps=1)
