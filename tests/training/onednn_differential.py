"""DPModel's clipped sum against a float64 brute force, run in a process of its own.

Not a test module: `tests/training/onednn_differential_test.py` runs it with
`python -m tests.training.onednn_differential GROUP` under
`TF_ENABLE_ONEDNN_OPTS=1` and `=0`, so that a crash (TensorFlow 2.21's oneDNN
broadcast batch matmul corrupts the heap: tfdp.graph_checks) fails the
test instead of killing a pytest worker.

For every case of GROUP (a model and a clipping path: "auto", "ghost",
"vectorized", or "auto" with 2 microbatches), it computes the contribution
of one chunk the way the train step does (`DPModel._chunk_contribution`,
traced, with its oneDNN check) and compares it with a float64 brute force:
the model rebuilt in float64 with the same weights, one GradientTape per
example (`ghost_testing.float64_example_gradients`), clipped and summed in
float64 (microbatches: with the same microbatch ids). It prints one line
`CASE name` before each case and one JSON line per case:
  - `sum_error`: |fast sum - float64 sum| / C (relative to the clip norm),
    on a random batch. (On near-constant images the float32 forward pass
    itself is ill-conditioned for some families, e.g. 9e-2 C for the
    NF-ResNet blocks on every path, oneDNN on or off: the fuzzer's business,
    not this test's. The bug this test is for gives garbage or 0.6 C.)
  - `max_contribution`: the largest leave-one-out change of the fast sum
    (full batch minus the batch with example i masked), over C, on a batch
    whose first two examples are constant at the top and the bottom of the
    range (per-example paths only; None for microbatches, whose unit is the
    microbatch); `max_removed`: the same with example i removed from the
    batch (Poisson adjacency; a masked example still sits in the forward
    pass, where a layer that mixes examples would hide);
  - the step is traced for a batch of unknown size, as Poisson batches are;
  - `path`: the path that ran (`DPModel.clipping_path`);
or, where TensorFlow raised an error, `error` (its message).
The test asserts the bounds; this script asserts nothing, so that every
number is printed.
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

from tfdp import accounting
from tfdp import host
from tfdp.training.dp_model import DPModel

from tests.training import ghost_testing

C = 0.05  # small: every example is clipped, so the bound is what is measured
BATCH = 6


def _mha(causal):
    """MultiHeadAttention (causal or not) on [batch, 5, 4], then Dense on the flattened output."""

    def build(num_classes=10):
        inputs = keras.Input((5, 4))
        x = keras.layers.MultiHeadAttention(2, 3, name="attention")(
            inputs, inputs, use_causal_mask=causal)
        return keras.Model(inputs, keras.layers.Dense(num_classes)(keras.layers.Flatten()(x)))

    return build


def _dense_on_rank4(num_classes=10):
    """Dense on 4-D activations [batch, 1, T, C] (a second axis of 1, as in the bug)."""
    inputs = keras.Input((1, 6, 3))
    x = keras.layers.Dense(4, activation="tanh", name="on_rank4")(inputs)
    x = keras.layers.EinsumDense("abcd,de->abce", (1, 6, 2), name="einsum_rank4")(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(keras.layers.Flatten()(x)))


SEQUENCE = {
    "mha_causal": (_mha(True), (5, 4), 3.0),
    "mha": (_mha(False), (5, 4), 3.0),
    "dense_on_rank4": (_dense_on_rank4, (1, 6, 3), 3.0),
    **ghost_testing.LOOP_FAMILIES,
}
GROUPS = {
    "shipped": dict(ghost_testing.FAMILIES),
    "sequence": SEQUENCE,
}
# (clipping, num_microbatches). "ghost" is "auto" for the shipped families (every layer
# has a rule), so it is run for the sequence models only.
PATHS = {
    "shipped": (("auto", None), ("vectorized", None), ("auto", 2)),
    "sequence": (("auto", None), ("ghost", None), ("vectorized", None), ("auto", 2)),
}


def _inputs(shape, scale, seed, *, adversarial):
    """A random batch; `adversarial`: its first two examples constant, at the range's ends."""
    rng = np.random.default_rng(seed)
    images = (rng.random((BATCH, *shape)) * scale).astype(np.float32)
    if adversarial:
        images[0] = scale * 0.999  # near the top of the range (ids stay < scale)
        images[1] = 0.0
    labels = rng.integers(0, 10, BATCH).astype(np.int32)
    return images, labels


def _reference(twin, images, labels, ids, num_microbatches):
    """The float64 clipped sum: per example, or of microbatch means."""
    grads = ghost_testing.float64_example_gradients(twin, images, labels)
    if not num_microbatches:
        total = [np.zeros_like(g) for g in grads[0]]
        for g in grads:
            factor = min(1.0, C / max(ghost_testing.global_norm64(g), 1e-300))
            total = [t + factor * x for t, x in zip(total, g)]
        return total
    total = [np.zeros_like(g) for g in grads[0]]
    for j in range(num_microbatches):
        members = [g for g, i in zip(grads, ids) if i == j]
        if not members:
            continue
        mean = [sum(parts) / len(members) for parts in zip(*members)]
        factor = min(1.0, C / max(ghost_testing.global_norm64(mean), 1e-300))
        total = [t + factor * x for t, x in zip(total, mean)]
    return total


def run_case(name, builder, shape, scale, clipping, num_microbatches, seed=0):
    keras.utils.set_random_seed(seed)
    model = builder()
    mechanism = accounting.DPMechanism(
        num_examples=1000, batch_size=BATCH, num_steps=10, noise_multiplier=1.0,
        l2_clip_norm=C, delta=1e-5, num_microbatches=num_microbatches)
    dp = DPModel(model, mechanism, clipping=clipping)
    dp.compile(optimizer=keras.optimizers.SGD(1.0))
    images, labels = _inputs(shape, scale, seed, adversarial=False)
    ids = tf.constant(np.arange(BATCH) % (num_microbatches or 1), tf.int32)
    # A batch of unknown size, as Poisson batches are (make_private): the step is traced once.
    signature = [tf.TensorSpec([None, *shape], tf.float32), tf.TensorSpec([None], tf.int32),
                 tf.TensorSpec([None], tf.float32)]
    if num_microbatches:
        contribution = tf.function(
            lambda x, y, m: dp._finish_accumulation(dp._chunk_contribution(x, y, m, ids))[0],
            input_signature=signature[:2] + [tf.TensorSpec([BATCH], tf.float32)])
    else:
        contribution = tf.function(lambda x, y, m: dp._chunk_contribution(x, y, m)[0],
                                   input_signature=signature)
    full = [t.numpy().astype(np.float64) for t in contribution(images, labels, tf.ones([BATCH]))]
    twin = ghost_testing.float64_twin(builder, model)
    reference = _reference(twin, images, labels, ids.numpy(), num_microbatches)
    sum_error = ghost_testing.global_norm64([f - r for f, r in zip(full, reference)]) / C
    max_contribution = max_removed = None
    if not num_microbatches:
        images, labels = _inputs(shape, scale, seed + 1, adversarial=True)
        full = [t.numpy().astype(np.float64)
                for t in contribution(images, labels, tf.ones([BATCH]))]
        changes, removed = [], []
        for i in range(BATCH):
            mask = np.ones(BATCH, np.float32)
            mask[i] = 0.0
            without = [t.numpy().astype(np.float64) for t in contribution(images, labels, mask)]
            changes.append(ghost_testing.global_norm64([a - b for a, b in zip(full, without)]))
            # Adjacent batches as Poisson sampling makes them: the example removed, not masked
            # (a masked example still sits in the forward pass, where mixing would hide).
            keep = np.arange(BATCH) != i
            gone = [t.numpy().astype(np.float64) for t in contribution(
                images[keep], labels[keep], np.ones(BATCH - 1, np.float32))]
            removed.append(ghost_testing.global_norm64([a - b for a, b in zip(full, gone)]))
        max_contribution = max(changes) / C
        max_removed = max(removed) / C
    return {"case": name, "clipping": clipping, "num_microbatches": num_microbatches,
            "path": dp.clipping_path, "sum_error": sum_error,
            "max_contribution": max_contribution, "max_removed": max_removed,
            "onednn": host.onednn_enabled()}


def _mixing_models():
    """Two layers that mix examples without variables: both must be refused."""
    def conv_then(layer):
        inputs = keras.Input((6, 6, 2))
        x = layer(keras.layers.Conv2D(3, 3)(inputs))
        return keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Flatten()(x)))

    return {
        "lambda_batch_mean": lambda: conv_then(keras.layers.Lambda(
            lambda t: t - keras.ops.mean(t, axis=0), name="batch_center")),
        "layer_norm_axis0": lambda: conv_then(keras.layers.LayerNormalization(
            axis=0, center=False, scale=False, name="batch_norm_axis0")),
    }


def run_mixing_case(name, builder):
    """Whether DPModel.compile refuses the model, and the message."""
    mechanism = accounting.DPMechanism(num_examples=1000, batch_size=BATCH, num_steps=10,
                                       noise_multiplier=1.0, l2_clip_norm=C, delta=1e-5)
    dp = DPModel(builder(), mechanism)
    try:
        dp.compile(optimizer=keras.optimizers.SGD(1.0))
    except ValueError as error:
        return {"case": name, "refused": True, "message": str(error)}
    return {"case": name, "refused": False, "message": ""}


def main(group):
    for name, (builder, shape, scale) in GROUPS[group].items():
        for clipping, microbatches in PATHS[group]:
            print(f"CASE {name} {clipping} {microbatches}", flush=True)
            try:
                result = run_case(name, builder, shape, scale, clipping, microbatches)
            except tf.errors.OpError as error:  # an error TensorFlow raised, not a crash
                result = {"case": name, "clipping": clipping,
                          "num_microbatches": microbatches, "error": error.message[:500],
                          "onednn": host.onednn_enabled()}
            print(json.dumps(result), flush=True)
    if group == "sequence":
        for name, builder in _mixing_models().items():
            print(f"CASE {name}", flush=True)
            print(json.dumps(run_mixing_case(name, builder)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: only the printed results matter
