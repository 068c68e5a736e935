"""The privacy fuzzer through DPModel's train step, run in a process of its own.

Not a test module: `tests/training/dp_model_fuzz_test.py` runs
`python -m tests.training.dp_model_fuzz EXAMPLES` under
`TF_ENABLE_ONEDNN_OPTS=1` and `=0`, so that a crash (TensorFlow 2.21's oneDNN
broadcast batch matmul corrupts the heap: tfdp.graph_checks) fails the
test instead of killing a pytest worker.

`tests/training/ghost_fuzz_test.py` fuzzes the ghost rules (`GhostClipping`)
against a float64 brute force. This fuzzer measures what DPModel's step adds
(`DPModel.clip_and_accumulate`, traced, with its oneDNN check and the
per-example loop it may take), on models the ghost fuzzer does not draw:
  - its model specs (`ghost_fuzz_test.model_specs`), plus blocks that fall
    back inside sequence models (MultiHeadAttention with an attention mask
    computed from the input, a rule-less scale, a user layer that calls
    `tf.einsum` on `[batch, T, D]`), causal attention (which has a rule),
    non-square kernels, strides and dilations, variable-less layers
    (pooling, padding, upsampling, a Lambda), and layers that mix examples
    (a Lambda subtracting the batch mean, LayerNormalization over the batch
    axis, a Lambda adding the first example): a model with one of those
    must be refused by `DPModel.compile`, never trained, unless nothing the
    layer does reaches an output or a gradient (a GroupNorm over groups of
    one entry after it: every output is the head's bias), which
    `assert_mixing_is_dead` checks on perturbed weights before the model
    is held to the assertions below like any other;
  - image inputs of 1 x 1, 1 x N and N x 1 pixels;
  - clipping "auto", "ghost" or "vectorized", and 1 or 2 accumulation chunks;
  - batches of `ghost_fuzz_test` (near-constant images at 0 and 255, huge
    ranges, padding rows of copies, huge values or NaN), and all-masked ones.

For every real example i, with the mask one-hot(i):
  1. its contribution (the clipped sum) has norm <= C (1 + 1e-6);
  2. the contribution points where the float64 brute force's clipped
     gradient does: |contribution - factor_i g64_i| <= 1e-2 C, relaxed by
     twice the float32 per-example loop's own error (as `ghost_fuzz_test`,
     assertion 3);
and for the drawn mask: 3. the clipped sum equals the sum of the real rows'
contributions (1e-4 C per row), whatever the padding rows hold; an
all-masked batch adds exactly zero; 4. removing the first real example from
the batch moves the clipped sum by at most C (1 + 1e-5). The step is traced
for a batch of unknown size, as Poisson batches are. The mixing layers
include a custom gradient that mixes, a running mean, and layers that mix
only from the second or beyond the fourth example (all must be refused).

It prints one line per case (`CASE ...`) and, at the end, `FUZZ OK n` with
the number of cases; a failing case raises with Hypothesis' falsifying
example.
"""

import os
import sys

import hypothesis
import keras
import numpy as np
import tensorflow as tf
from hypothesis import strategies as st

from tfdp import accounting
from tfdp import host
from tfdp import models
from tfdp.training.dp_model import DPModel

from tests.training import ghost_fuzz_test as ghost_fuzz
from tests.training import ghost_testing

CONTRIBUTION_RTOL = ghost_fuzz.CONTRIBUTION_RTOL
DIRECTION_TOL = ghost_fuzz.DIRECTION_TOL
PADDING_TOL = ghost_fuzz.PADDING_TOL

IMAGE_EXTRA = ["conv_rect", "variable_less", "unruled", "mixing"]
SEQUENCE_EXTRA = ["attention_causal", "attention_masked", "unruled", "user_einsum", "mixing"]
VARIABLE_LESS = ["max_pool", "average_pool", "zero_padding", "upsampling", "lambda", "relu"]
# Layers that mix examples, or keep a statistic of the batch: every one must be refused. The
# last four passed the first version of the probe (outputs only, at the first and last example).
MIXING = ["batch_center", "norm_axis0", "add_first", "add_second", "beyond_fourth",
          "gradient_mix", "running_mean"]


class UserEinsum(keras.layers.Layer):
    """A user layer without a ghost rule: `tf.einsum("btd,de->bte", x, kernel)`."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 4), name="kernel")

    def call(self, x):
        return tf.einsum("btd,de->bte", x, self.kernel)


@st.composite
def image_extra(draw):
    kind = draw(st.sampled_from(IMAGE_EXTRA))
    block = {"kind": kind}
    if kind == "conv_rect":
        block["kernel"] = draw(st.sampled_from([(1, 3), (3, 1), (2, 3), (3, 2), (1, 1)]))
        block["step"] = draw(st.sampled_from(
            [((1, 1), (1, 1)), ((1, 2), (1, 1)), ((2, 1), (1, 1)), ((2, 2), (1, 1)),
             ((1, 1), (1, 2)), ((1, 1), (2, 1))]))  # (strides, dilation): never both > 1
        block["padding"] = draw(st.sampled_from(["same", "valid"]))
        block["filters"] = draw(st.sampled_from([2, 5]))
    if kind == "variable_less":
        block["layer"] = draw(st.sampled_from(VARIABLE_LESS))
    if kind == "mixing":
        block["layer"] = draw(st.sampled_from(MIXING))
    return block


@st.composite
def sequence_extra(draw):
    kind = draw(st.sampled_from(SEQUENCE_EXTRA))
    block = {"kind": kind, "heads": draw(st.sampled_from([1, 2]))}
    if kind == "mixing":
        block["layer"] = draw(st.sampled_from(MIXING))
    return block


@st.composite
def dp_cases(draw):
    spec = draw(ghost_fuzz.model_specs())
    if spec["sequence"] is None:
        blocks = spec["blocks"]
        for block in draw(st.lists(image_extra(), min_size=1, max_size=2)):
            blocks.insert(draw(st.integers(0, len(blocks))), block)
        thin = draw(st.sampled_from([None, "1x1", "1xN", "Nx1"]))
        h, w, c = spec["input_shape"]
        spec["input_shape"] = {None: (h, w, c), "1x1": (1, 1, c), "1xN": (1, w, c),
                               "Nx1": (h, 1, c)}[thin]
    else:
        blocks = spec["sequence"]["blocks"]
        for block in draw(st.lists(sequence_extra(), min_size=1, max_size=2)):
            blocks.insert(draw(st.integers(0, len(blocks))), block)
    tokens = spec["sequence"] and spec["sequence"].get("tokens")
    if tokens:
        images, labels, mask = draw(ghost_fuzz.token_batches(
            spec["input_shape"][0], tokens["vocabulary"], spec["num_classes"]))
    else:
        images, labels, mask = draw(ghost_fuzz.batches(spec["input_shape"],
                                                       spec["num_classes"]))
    if draw(st.integers(0, 9)) == 0:
        mask = np.zeros_like(mask)  # an all-masked batch (an empty Poisson draw, padded)
    clip_ratio = draw(st.sampled_from([0.01, 0.5, 0.99, 2.0]))
    clipping = draw(st.sampled_from(["auto", "ghost", "vectorized"]))
    accumulation = draw(st.sampled_from([1, 2]))
    return spec, images, labels, mask, clip_ratio, clipping, accumulation


class GradientMix(keras.layers.Layer):
    """The identity forward; its gradient adds the batch's mean gradient (a mixing backward)."""

    def call(self, x):
        @tf.custom_gradient
        def identity(t):
            return tf.identity(t), lambda dy: dy + tf.reduce_mean(dy, axis=0, keepdims=True)

        return identity(x)


class RunningMean(keras.layers.Layer):
    """Subtracts a running mean of past batches, updated in training (a user's BatchNorm)."""

    def build(self, shape):
        self.mean = self.add_weight(shape=shape[1:], initializer="zeros", trainable=False,
                                    name="running_mean")

    def call(self, x, training=False):
        if training:
            self.mean.assign(0.9 * self.mean + 0.1 * keras.ops.mean(x, axis=0))
        return x - self.mean


def _mixing_layer(name):
    ops = keras.ops
    if name == "batch_center":
        return keras.layers.Lambda(lambda t: t - ops.mean(t, axis=0))
    if name == "norm_axis0":
        return keras.layers.LayerNormalization(axis=0, center=False, scale=False)
    if name == "add_second":
        return keras.layers.Lambda(lambda t: t + t[1:2])
    if name == "beyond_fourth":
        return keras.layers.Lambda(lambda t: t + ops.sum(t[4:], axis=0))
    if name == "gradient_mix":
        return GradientMix()
    if name == "running_mean":
        return RunningMean()
    return keras.layers.Lambda(lambda t: t + ops.mean(t[:1], axis=0))  # add_first


def _add_block(block, x):
    kind = block["kind"]
    layers = keras.layers
    if kind == "conv_rect":
        strides, dilation = block["step"]
        size, kernel = x.shape[1:3], block["kernel"]
        padding = block["padding"]
        if any(s < (k - 1) * d + 1 for s, k, d in zip(size, kernel, dilation)):
            padding = "same"
        return layers.Conv2D(block["filters"], kernel, strides=strides, dilation_rate=dilation,
                             padding=padding, activation="tanh")(x)
    if kind == "variable_less":
        layer = block["layer"]
        if layer == "max_pool":
            return layers.MaxPooling2D(2, padding="same")(x)
        if layer == "average_pool":
            return layers.AveragePooling2D(2, padding="same")(x)
        if layer == "zero_padding":
            return layers.ZeroPadding2D(1)(x)
        if layer == "upsampling":
            return layers.UpSampling2D(2)(x)
        if layer == "lambda":
            return layers.Lambda(lambda t: 2.0 * t + 1.0)(x)
        return layers.Activation("relu")(x)
    if kind == "unruled":
        return ghost_testing.UnruledScale()(x)
    if kind == "mixing":
        return _mixing_layer(block["layer"])(x)
    return ghost_fuzz._add_block(block, x)


def _add_sequence_block(block, x):
    kind = block["kind"]
    layers = keras.layers
    if kind == "attention_causal":
        return x + layers.MultiHeadAttention(block["heads"], 2)(x, x, use_causal_mask=True)
    if kind == "attention_masked":  # a padding mask from the input: positions of all zeros
        keep = keras.ops.any(keras.ops.not_equal(x, 0.0), axis=-1)  # [batch, T]
        mask = keras.ops.expand_dims(keep, 1)  # [batch, 1, T]: every query, these keys
        return x + layers.MultiHeadAttention(block["heads"], 2)(x, x, attention_mask=mask)
    if kind == "unruled":
        return ghost_testing.UnruledScale()(x)
    if kind == "user_einsum":
        return UserEinsum()(x)
    if kind == "mixing":
        return _mixing_layer(block["layer"])(x)
    return ghost_fuzz._add_sequence_block(block, x)


def _mixes(spec):
    blocks = spec["blocks"] + ((spec["sequence"] or {}).get("blocks") or [])
    return any(block["kind"] == "mixing" for block in blocks)


def _only_gradient_mixing(spec):
    blocks = spec["blocks"] + ((spec["sequence"] or {}).get("blocks") or [])
    return all(block.get("layer") == "gradient_mix" for block in blocks
               if block["kind"] == "mixing")


def build(spec):
    return ghost_fuzz.build_model(spec, _add_block, _add_sequence_block)


def _grouped(spec):
    return any(block["kind"] == "grouped_conv" for block in spec["blocks"])


def _mechanism(c):
    return accounting.DPMechanism(num_examples=1000, batch_size=4, num_steps=10,
                                  noise_multiplier=1.0, l2_clip_norm=c, delta=1e-5)


def _row_gradient(model, batch, labels, k):
    """Row k's output and its own loss's gradient (float64), within `batch`."""
    with tf.GradientTape() as tape:
        logits = model(batch, training=True)
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels[k:k + 1],
                                                              logits[k:k + 1])[0]
    grads = tape.gradient(loss, model.trainable_variables,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    # An Embedding's gradient is IndexedSlices: dense, as the per-example paths make it.
    return [np.asarray(tf.convert_to_tensor(t), np.float64) for t in [logits[k], *grads]]


def assert_mixing_is_dead(spec, model):
    """Raises unless every example's output and gradient ignore the other examples.

    A model with a mixing layer that `DPModel.compile` accepts must be one where
    the mixing cannot reach anything (e.g. a GroupNorm over groups of one entry
    after it: every output is the head's bias). This oracle does not share the
    probe's code: on weights perturbed at random (a zero head hides nothing), a
    fresh batch of 6 examples in the model's input shape (pixels in [0, 255],
    or token ids), then for each row k, every other row drawn anew: row k's
    output and its own loss's gradient must stay bitwise equal (the same ops
    on the same shapes), and finite.
    """
    rng = np.random.default_rng(spec["seed"])
    for v in model.trainable_variables:
        v.assign(v + rng.normal(0.0, 0.5, v.shape).astype(np.float32))
    tokens = (spec["sequence"] or {}).get("tokens")
    shape = tuple(model.inputs[0].shape[1:])

    def draw(n):
        if tokens:
            return rng.integers(0, tokens["vocabulary"], (n, *shape)).astype(np.float32)
        return rng.uniform(0.0, 255.0, (n, *shape)).astype(np.float32)

    batch = draw(6)
    labels = tf.constant(rng.integers(0, spec["num_classes"], 6), tf.int32)
    for k in range(6):
        changed = draw(6)
        changed[k] = batch[k]
        for a, b in zip(_row_gradient(model, batch, labels, k),
                        _row_gradient(model, changed, labels, k)):
            assert np.all(np.isfinite(a)), "the dead-mixing oracle drew a non-finite output"
            assert np.array_equal(a, b), (
                f"a model with a live mixing layer was not refused: example {k}'s output or "
                "gradient moved when the other examples changed")


def check_case(case):
    spec, images, labels, mask, clip_ratio, clipping, accumulation = case
    # With oneDNN off, TensorFlow cannot run a grouped Conv2D's gradient under
    # tf.vectorized_map ("Fused conv implementation does not support grouped convolutions",
    # an error, not a wrong number; docs/design/limitations.md): the oneDNN-on run covers them.
    hypothesis.assume(host.onednn_enabled() or not _grouped(spec))
    if _mixes(spec):
        # Refused or not before anything runs the model on the case's batch: a mixing layer
        # may not even run on it (`t + t[1:2]` on one example gives no output at all).
        keras.utils.set_random_seed(spec["seed"])
        probed = build(spec)
        try:
            DPModel(probed, _mechanism(1.0), clipping=clipping,
                    accumulation_steps=accumulation).compile(optimizer=keras.optimizers.SGD(0.0))
        except models.ExampleMixingError:
            return "refused"
        if not _only_gradient_mixing(spec):
            assert_mixing_is_dead(spec, probed)
    keras.utils.set_random_seed(spec["seed"])
    model = build(spec)
    real = np.flatnonzero(mask)
    twin = ghost_testing.float64_twin(lambda: build(spec), model)
    if len(real):
        reference = ghost_testing.float64_example_gradients(twin, images[real], labels[real])
        norms64 = [ghost_testing.global_norm64(g) for g in reference]
        c = max(clip_ratio * float(np.median(norms64)), ghost_fuzz.MIN_CLIP_NORM)
    else:
        c = 1.0
    dp = DPModel(model, _mechanism(c), clipping=clipping, accumulation_steps=accumulation)
    dp.compile(optimizer=keras.optimizers.SGD(0.0))
    # A backward-only mix that no trainable variable sits before (GradientMix as the
    # first block: it mixes only the gradients wrt the images) may be accepted; the
    # checks below then hold it to the same bounds as any other model.
    # A batch of unknown size, as Poisson batches are.
    signature = [tf.TensorSpec([None, *images.shape[1:]], tf.float32),
                 tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.float32)]
    step = tf.function(lambda x, y, m: dp.clip_and_accumulate(x, y, m),
                       input_signature=signature)
    total = None
    for j, i in enumerate(real):
        one_hot = np.zeros_like(mask)
        one_hot[i] = 1.0
        summed, stats = step(images, labels, one_hot)
        contribution = [np.asarray(s.numpy(), np.float64) for s in summed]
        total = contribution if total is None else [a + b for a, b in zip(total, contribution)]
        size = ghost_testing.global_norm64(contribution)
        norm = float(stats[2])  # the pre-clip norm of the one real example
        factor = min(1.0, c / norm) if norm > 0 else 1.0
        what = (f"example {i}: contribution {size / c:.9f} C, path {dp.clipping_path}, "
                f"norm {norm:.9g}, norm64 {norms64[j]:.9g}")
        # 1. The sensitivity.
        assert np.isfinite(size) and size <= c * (1 + CONTRIBUTION_RTOL), what
        # 2. The direction, relaxed by the float32 per-example loop's own error.
        expected = [factor * g for g in reference[j]]
        error = ghost_testing.global_norm64([a - b for a, b in zip(contribution, expected)])
        if error > DIRECTION_TOL * c:
            loop = ghost_fuzz._vectorized(model, images[real][j:j + 1], labels[real][j:j + 1],
                                          loop=True)[0]
            vec_error = ghost_testing.global_norm64([a - b for a, b in zip(loop, reference[j])])
            assert error <= DIRECTION_TOL * c + 2 * factor * vec_error, (
                what + f"; |contribution - factor g64| = {error / c:.3g} C")
    # 3. The drawn mask: the sum of the real rows; nothing at all if every row is masked.
    summed, _ = step(images, labels, mask)
    summed = [np.asarray(s.numpy(), np.float64) for s in summed]
    # 4. Poisson adjacency: the first real example removed from the batch (not masked: a
    # masked row still sits in the forward pass) changes the sum by its contribution alone.
    if len(real) and len(mask) > 1:
        keep = np.arange(len(mask)) != real[0]
        fewer, _ = step(images[keep], labels[keep], mask[keep])
        removed = [a - np.asarray(b.numpy(), np.float64) for a, b in zip(summed, fewer)]
        assert ghost_testing.global_norm64(removed) <= c * (1 + 1e-5), (
            f"removing example {real[0]} moved the sum by "
            f"{ghost_testing.global_norm64(removed) / c:.9f} C")
    if total is None:
        assert all(np.all(s == 0.0) for s in summed), "an all-masked batch added something"
    else:
        error = ghost_testing.global_norm64([a - b for a, b in zip(summed, total)])
        assert error <= PADDING_TOL * c * len(real), f"masked sum off by {error / c:.3g} C"
    return dp.clipping_path


def main(examples):
    counts = {}

    @hypothesis.settings(max_examples=examples, deadline=None, derandomize=True,
                         database=None, print_blob=True, phases=ghost_fuzz._PHASES,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(dp_cases())
    def fuzz(case):
        try:
            outcome = check_case(case)
        except Exception:
            # The case itself, to rebuild it (`check_case`): derandomized runs are long.
            np.set_printoptions(threshold=100000, precision=9)
            print(f"FAILED CASE {case!r}", flush=True)
            raise
        counts[outcome] = counts.get(outcome, 0) + 1
        print(f"CASE {outcome} clipping={case[5]} chunks={case[6]} "
              f"real={int(np.sum(case[3]))}", flush=True)

    fuzz()
    print(f"FUZZ OK {sum(counts.values())} {counts} onednn={host.onednn_enabled()}",
          flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: only the printed results matter
