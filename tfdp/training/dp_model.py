"""DPModel: a keras.Model whose train_step is DP-SGD."""

import inspect

import keras
import numpy as np
import tensorflow as tf

from tfdp import accounting
from tfdp import models
from tfdp.dp import clipping
from tfdp.dp.clipping import CLIPPING_PATHS
from tfdp.dp import device_arithmetic
from tfdp.dp import seeds
from tfdp.dp import noise
from tfdp.training import chunked
from tfdp.training import clip_paths
from tfdp.training import ema
from tfdp.training import optimizers
from tfdp.training import release_guard
from tfdp.training import microbatches
from tfdp.training.chunked import hits, masked
from tfdp.training import example_weights
from tfdp.training.example_weights import refuse_example_weights


class DPModel(chunked.ChunkedTraining, ema.EMAParameters, keras.Model):
    """Wraps a Keras classifier and trains it with DP-SGD.

    Every privacy fact comes from one `tfdp.accounting.DPMechanism`: the clip
    norm C, the noise std (`mechanism.noise_stddev()`) and the divisor
    (`mechanism.update_divisor`); nothing here recomputes them. One call of
    the train function is one LOGICAL batch and one optimizer update, made in
    three named steps (as Opacus' `DPOptimizer.pre_step`), each overridable:

    1. `clip_and_accumulate`: each example's gradient (the mean over its K
       views, De et al. 2022, eq. (4)) is clipped to global L2 norm <= C
       (divided by C with `normalize_update`, eq. (3)), and the clipped
       gradients are summed over `accumulation_steps` chunks processed one
       after another (virtual batching, De et al. 2022, App. A.1, Algorithm
       1). With microbatches (M), each microbatch's gradient MEAN is clipped
       instead, after accumulating over all chunks and replicas (sensitivity
       2C). `clipping` chooses how ("ghost" norms, Li et al. 2022; or
       `tf.vectorized_map` per-example gradients; `tfdp.training.clip_paths`).
    2. `add_noise`: Gaussian noise of std `mechanism.noise_stddev()` ONCE per
       logical batch, after accumulation (`noise_stddev / sqrt(R)` on each of
       R replicas, whose SUM Keras all-reduces).
    3. `scale_update`: divide by `mechanism.update_divisor`, the expected
       logical batch size B (public, never the realized size), or M.

    Both inputs run the same accumulation (`tfdp.training.chunked`): a
    `tfdp.training.distribute.ChunkedInput` (what the trainer and
    `tfdp.make_private` feed: one element per accumulation chunk, a chunks per
    update), or a `tf.data.Dataset` of whole logical batches, which
    `train_step` cuts into the same chunks. Why each step is exact, and the
    EMA: docs/design/dp_step.md.

    Inputs to `fit`: a `ChunkedInput` or a (distributed) `tf.data.Dataset`
    of batches drawn with the sampler the mechanism assumes (Poisson:
    `tfdp.data.train_batches`); arrays are refused (fixed-size shuffled
    batches are not what the accountant covers). Each element is `(images,
    labels)` or `(images, labels, mask)`: `images` float32 or uint8 `[batch,
    height, width, channels]` (one view) or `[batch, augmult, height, width,
    channels]` (K views), `labels` int `[batch]`, `mask` float32 `[batch]`,
    1 for real examples and 0 for padding (which contributes exactly
    nothing); `batch` may vary from step to step. The mask is never a
    weight: `fit` and `train_on_batch` refuse `class_weight` and
    `sample_weight`, and the step asserts that the mask is 0/1.

    Metrics: `loss`, `accuracy` (on the mean logits of the views), `grad_norm`
    (mean pre-clip norm of the clipped units: examples, or microbatches) and
    `clipped_fraction`.

    Args:
      model: the classifier, a built `keras.Model` mapping float32 images
        `[batch, height, width, channels]` in [0, 255] to logits
        `[batch, num_classes]`. It must not mix examples (no BatchNorm).
      mechanism: the run's `tfdp.accounting.DPMechanism` (clip norm, noise,
        divisor, microbatches).
      accumulation_steps: chunks per logical batch (per replica), processed
        sequentially to bound memory.
      noise_seed: None (default: secret, from OS entropy), or an int to
        reproduce a run. Not returned by `get_config` (a secret).
      ema_decay: None (no EMA) or the asymptotic EMA decay in [0, 1)
        (De et al. 2022, App. C.3).
      clipping: "auto" (default), "ghost" or "vectorized": how the clipped
        sum of per-example gradients is computed (step 1 above). The sum,
        and so the mechanism, is the same; only speed and memory differ.

    Raises:
      ValueError: on a model that mixes examples (`tfdp.models.validate_dp_model`:
        BatchNorm), mixed precision in the model or in the global dtype policy
        (`tfdp.models.validate_float32`), a `mechanism` that is not a DPMechanism, an
        `accumulation_steps` < 1, an `ema_decay` outside [0, 1), or an
        unknown `clipping`.

    Reference:
      Abadi et al. 2016, Algorithm 1; De et al. 2022, Sec. 2 and App. A.1;
      ghost clipping: Li et al. 2022, Sec. 4; Bu et al. 2022.
    """

    def __init__(self, model, mechanism, *, accumulation_steps=1, noise_seed=None,
                 ema_decay=None, clipping="auto", **kwargs):
        super().__init__(**kwargs)
        models.validate_float32(self)  # its own policy: compile would add loss scaling
        if not isinstance(mechanism, accounting.DPMechanism):
            raise ValueError(
                f"mechanism must be a tfdp.accounting.DPMechanism (e.g. from "
                f"tfdp.accounting.plan_mechanism), got {type(mechanism).__name__}.")
        if int(accumulation_steps) < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}.")
        models.validate_dp_model(model)
        if ema_decay is not None and not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1) or None, got {ema_decay}.")
        if clipping not in CLIPPING_PATHS:
            raise ValueError(f"clipping must be one of {CLIPPING_PATHS}, got {clipping!r}.")
        self.model = model
        self.clipping = clipping
        self._ghost = None  # the GhostClipping chosen in compile(), or None
        self._loop = False  # per-example gradients one example at a time (`clip_paths.checked`)
        self._mixing_checked = False  # models.refuse_example_mixing has passed (`compile`)
        # device_arithmetic.step_plan() of the traced step (`_chunk_contribution`)
        self._traced_plan = None
        self.mechanism = mechanism
        self.accumulation_steps = int(accumulation_steps)
        self.ema_decay = None if ema_decay is None else float(ema_decay)
        self.noise_generator = seeds.noise_generator(noise_seed)
        # Steps whose noisy update was withheld for an inf or NaN entry (`noise.finite_release`);
        # untracked: never in a checkpoint or an export.
        self._withheld = chunked._Untracked(tf.Variable(
            0, dtype=tf.int32, trainable=False, name="withheld_updates",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA))
        self._release_check = None  # `release_guard.refuse_withheld`'s check, made on first use
        self._stopped = None  # NonFiniteRelease's message, once the model's state was not finite
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.accuracy_tracker = keras.metrics.Mean(name="accuracy")
        self.grad_norm_tracker = keras.metrics.Mean(name="grad_norm")
        self.clipped_tracker = keras.metrics.Mean(name="clipped_fraction")
        self._loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                    reduction=None)
        inputs = getattr(model, "inputs", None)
        self._input_rank = len(inputs[0].shape) if inputs else 4  # incl. the batch axis
        # The wrapped model is built, so this wrapper is too. Otherwise Keras'
        # fit under a strategy would try a symbolic `call` on a training batch
        # (`_symbolic_build`), which fails on augmult views [batch, K, H, W, C].
        self.built = bool(getattr(model, "built", False))

    def get_config(self):
        # noise_seed is left out on purpose: a seed written into a saved
        # config would make the noise public.
        return {"model": keras.saving.serialize_keras_object(self.model),
                "mechanism": self.mechanism.to_dict(),
                "accumulation_steps": self.accumulation_steps,
                "ema_decay": self.ema_decay, "clipping": self.clipping}

    def call(self, inputs, training=False):
        return self.model(inputs, training=training)

    def fit(self, x=None, *args, **kwargs):
        """`keras.Model.fit` on a `ChunkedInput` or a `tf.data.Dataset` of logical batches.

        Raises:
          ValueError: if `x` is neither a `ChunkedInput` (of this model's
            accumulation_steps) nor a (distributed) `tf.data.Dataset`, or if
            `class_weight` or `sample_weight` is given (`refuse_example_weights`).
        """
        bound = inspect.signature(keras.Model.fit).bind(self, x, *args, **kwargs).arguments
        refuse_example_weights(bound.get("class_weight"), bound.get("sample_weight"),
                               where="DPModel.fit")
        x = self._chunked_fit_input(x)
        if not isinstance(x, (tf.data.Dataset, tf.distribute.DistributedDataset)):
            raise ValueError(
                f"DPModel.fit takes a tf.data.Dataset of Poisson batches, got "
                f"{type(x).__name__}. fit(x, y, batch_size=...) would train on fixed-size "
                "shuffled batches, which the accountant's epsilon (Poisson sampling, "
                "q = batch_size / N) does not cover. Use tfdp.make_private(model, (x, y), "
                "...), or tfdp.data.train_batches.")
        # The batches' order is the sampler's: Keras' default shuffle=True would
        # only warn that it is ignored for a Dataset.
        kwargs.setdefault("shuffle", False)
        return super().fit(x, *args, **kwargs)

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None,
                       return_dict=False):
        """`keras.Model.train_on_batch`: one DP-SGD step on one logical batch.

        `sample_weight`, if given, is the padding mask: float or bool `[batch]`
        of 0 (padding) and 1 (a real example) only.

        Raises:
          ValueError: on `class_weight`, or a `sample_weight` with a value other
            than 0 and 1 (`refuse_example_weights`).
        """
        refuse_example_weights(class_weight, None, where="DPModel.train_on_batch")
        if sample_weight is not None and not np.all(np.isin(np.asarray(sample_weight), (0, 1))):
            refuse_example_weights(None, sample_weight, where="DPModel.train_on_batch")
        self._chunked_fit_input(x)  # after a fit on chunked input: the whole-batch function
        return super().train_on_batch(x, y, sample_weight=sample_weight,
                                      return_dict=return_dict)

    def compile(self, optimizer, **kwargs):
        """Compiles with `optimizer` and creates the DP state.

        Loss and metrics are fixed (sparse categorical cross-entropy on logits,
        accuracy); passing `loss` or `metrics` raises.

        Raises:
          ValueError: if `loss` or `metrics` is given, or an optimizer with
            `gradient_accumulation_steps` (`optimizers.refuse_step_miscounting`:
            each update is one release, which `optimizer.iterations` counts).
          tfdp.dp.device_arithmetic.PrecisionRewrite: (a ValueError) if grappler's
            automatic mixed precision or XLA's fast math is on: either would
            rewrite the traced step's arithmetic behind its per-example norms.
        """
        for key in ("loss", "metrics"):
            if kwargs.get(key) is not None:
                raise ValueError(
                    f"DPModel.compile does not take {key!r}: the per-example loss is fixed "
                    "to sparse categorical cross-entropy on logits.")
        # Before anything is traced: settings that would rewrite the step's float32 arithmetic.
        device_arithmetic.refuse_precision_rewrites()
        optimizer = keras.optimizers.get(optimizer)
        optimizers.refuse_step_miscounting(optimizer, where="DPModel.compile")
        super().compile(optimizer=optimizer, **kwargs)
        # Build the optimizer (and the EMA) now, outside any tf.function.
        self.optimizer.build(self.trainable_variables)
        # Again here: trainability may have changed since __init__ (e.g. a BatchNorm unfrozen).
        models.validate_dp_model(self.model)
        # Behaviour, not names: a Lambda or a variable-less layer may mix examples too. A
        # model that does not state its input shape is checked on the first batch's (`clip_paths.checked`).
        self._mixing_checked = False
        if models.input_example_shape(self.model) is not None:
            models.refuse_example_mixing(self.model)
            self._mixing_checked = True
        self._ghost = clip_paths.plan_clipping(self)
        self._loop = False
        self._build_ema()
        self._make_accumulators()  # before any trace: `train_step` accumulates in them

    def make_train_function(self, force=False):
        """Keras' train function (or the chunked one), checked around every call.

        The checks (`tfdp.training.release_guard.guarded`): a changed device
        plan traces the step again, precision rewrites are refused before the
        step, a withheld non-finite update stops training after it.
        """
        if self.train_function is not None and not force:
            return self.train_function
        super().make_train_function(force=force)
        self.train_function = release_guard.guarded(self, self.train_function)
        return self.train_function

    @property
    def clipping_path(self):
        """"ghost", "vectorized" or "loop": the path of per-example clipping.

        `compile` chooses "ghost" or "vectorized"; the first trace of the
        train step changes it to "loop" where the chosen path's ops would
        meet oneDNN's broadcast-matmul bug, or where `tf.vectorized_map`
        cannot convert its graph (`clip_paths.checked`).
        """
        if self._loop:
            return "loop"
        return "vectorized" if self._ghost is None else "ghost"

    @property
    def traced_matmul_inputs(self):
        """The device's matmul inputs ("float32", "tf32", "bf16") the step was last traced
        for, None before the first trace: what its norms and clip margin planned for."""
        return None if self._traced_plan is None else self._traced_plan.inputs

    # -- The step: clip -> accumulate -> noise -> scale, on the chunked path ----

    def train_step(self, data):
        """One update from a logical batch: its `accumulation_steps` chunks are added up
        by the chunked train function's own accumulation (`tfdp.training.chunked`), then
        `_update_from_accumulators` (noise once, divide by B, apply)."""
        images, labels, mask = example_weights.unpack(data)
        self._accumulate_batch((images, labels, example_weights.binary(mask)))
        return self._update_from_accumulators()

    # -- Step 1: clip each example, and sum over chunks ---------------------

    def clip_and_accumulate(self, images, labels, mask):
        """This replica's share of the logical batch's clipped gradient sum.

        Args:
          images: `[batch, ...]` this replica's slice (one view or K views).
          labels: int `[batch]`.
          mask: float32 `[batch]`, 0 on padding; any value > 0 counts as 1 (a
            mask, never a weight).

        Returns:
          `(summed, stats)`: `summed[i]` float32 of `trainable_variables[i]`'s
          shape; over all replicas the SUM of `summed` is the clipped sum of
          the logical batch. `stats` are the metric sums (loss, correct,
          pre-clip norms, clipped units, examples, clipped units count).
        """
        self._accumulate_batch((images, labels, example_weights.binary(mask)))
        return self._finish_accumulation(self._accumulated())

    def _contribution(self, data):
        """Replica context: one chunk element's clipped sums (or microbatch sums)."""
        images, labels, mask = example_weights.unpack(data)
        mask = example_weights.binary(mask)
        ids = self.draw_microbatch_ids(mask) if self.mechanism.num_microbatches else None
        return self._chunk_contribution(images, labels, mask, ids)

    def _chunk_contribution(self, images, labels, mask, ids=None):
        """What one chunk adds to the accumulators: clipped sums (or microbatch sums)."""
        # Trace time: the precision the rules plan for is fixed now (`make_train_function`).
        device_arithmetic.refuse_precision_rewrites()
        self._traced_plan = device_arithmetic.step_plan()
        tensors = (images, labels, mask) if ids is None else (images, labels, mask, ids)
        if images.shape[0] is None:
            # At least two rows (zero, mask 0: they add nothing): tf.vectorized_map over a
            # loop of unknown length that turns out to be 1 reshapes wrongly in attention
            # models (TensorFlow 2.21, oneDNN off: "Input to reshape is a tensor with 8
            # values, but the requested shape has 2"; found by the DP-model fuzzer), while
            # a known length of 1, or any length of 2 or more, runs. Every path comes here:
            # chunks of a logical batch and elements of chunked input alike.
            tensors = tuple(chunked.pad_rows(tensors, 1, min_rows=2))
        return clip_paths.checked(self, self._chunk_contribution_on_path, tensors)

    def _chunk_contribution_on_path(self, images, labels, mask, ids=None):
        """`_chunk_contribution` on the current path, unchecked."""
        if not self.mechanism.num_microbatches:
            return self._clipped_chunk(images, labels, mask)
        return microbatches.chunk_sums(self, images, labels, mask, ids)

    def _clipped_chunk(self, images, labels, mask):
        """Clipped gradient sum of one chunk (per-example clipping) and its metric sums."""
        if self._ghost is not None and not self._loop:
            ghost = self._ghost.clipped_sum(
                images, labels, mask, l2_clip_norm=self.mechanism.l2_clip_norm,
                normalize=self.mechanism.normalize_update, loss_fn=self._loss_fn,
                example_loss_fn=self._example_loss)
            summed, norms, clipped, losses, logits = clip_paths.alone_where_not_finite(
                ghost, images, labels, mask, variables=self.trainable_variables,
                example_loss=self._example_loss, l2_clip_norm=self.mechanism.l2_clip_norm,
                normalize=self.mechanism.normalize_update)
        else:
            grads, (losses, logits) = clipping.per_example_gradients(
                self._example_loss, self.trainable_variables, (images, labels),
                method=self._per_example_method)
            summed, norms, clipped = clipping.clipped_sum(
                grads, self.mechanism.l2_clip_norm, normalize=self.mechanism.normalize_update,
                mask=mask)
        stats = (tf.reduce_sum(masked(losses, mask)),
                 tf.reduce_sum(masked(hits(logits, labels), mask)),
                 tf.reduce_sum(masked(norms, mask)), tf.reduce_sum(clipped),
                 tf.reduce_sum(mask), tf.reduce_sum(mask))
        return summed, stats

    def _example_loss(self, example, beside_zeros=False):
        """Loss of one example: the mean over its views (De et al. 2022, eq. (4)).

        `beside_zeros`: run the model on the example's views followed by as many zero
        rows, and take the loss of the views only (`clip_paths.alone_where_not_finite`).
        """
        images, label = example
        # One example is [H, W, C] (one view) or [K, H, W, C] (K views); the
        # model takes a batch, so add a batch axis unless there are K views.
        views = images if images.shape.rank == self._input_rank else images[tf.newaxis]
        views = tf.cast(views, tf.float32)
        if beside_zeros:
            num_views = tf.shape(views)[0]
            logits = self.model(tf.concat([views, tf.zeros_like(views)], 0),
                                training=True)[:num_views]
        else:
            logits = self.model(views, training=True)
        labels = tf.fill([tf.shape(logits)[0]], tf.cast(label, tf.int32))
        loss = tf.reduce_mean(self._loss_fn(labels, logits))
        return loss, (loss, tf.reduce_mean(logits, axis=0))

    @property
    def _per_example_method(self):
        return "loop" if self._loop else "vectorized"

    def draw_microbatch_ids(self, mask):
        """Each example's microbatch: i.i.d. Uniform{0..M-1}, int32 `[batch]`.

        Drawn from the (secret) noise generator, independent of the data and
        of the positions (see the class docstring).
        """
        return self.noise_generator.uniform(
            tf.shape(mask), 0, self.mechanism.num_microbatches, dtype=tf.int32)

    # -- The accumulators (`tfdp.training.chunked.ChunkedTraining`'s hooks) -----

    def _zero_contribution(self):
        """Zeros shaped like one chunk's contribution (`_chunk_contribution`)."""
        if self.mechanism.num_microbatches:
            m = self.mechanism.num_microbatches
            return ([tf.zeros([m, *v.shape]) for v in self.trainable_variables], tf.zeros([m]),
                    tuple(tf.zeros([]) for _ in range(3)))
        return ([tf.zeros(v.shape) for v in self.trainable_variables],
                tuple(tf.zeros([]) for _ in range(6)))

    def _finish_accumulation(self, total):
        """`(summed, stats)` from the accumulated contributions of all chunks."""
        if not self.mechanism.num_microbatches:
            return total
        return microbatches.clipped_means(self, *total)

    def _update_from_total(self, total):
        """Replica context: noise once, divide by B, apply, EMA, metrics."""
        return self._apply_update(*self._finish_accumulation(total))

    # -- Steps 2 and 3: noise once per logical batch, divide by the public size --

    def _apply_update(self, summed, stats):
        """Noise once, divide by B, apply, EMA, metrics: the step after accumulation.

        An update with an inf or NaN entry is never applied
        (`noise.finite_release`): the train function then raises
        `noise.NonFiniteRelease` (`make_train_function`).
        """
        gradients = noise.finite_release(self.scale_update(self.add_noise(summed)),
                                         self._withheld.value)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        self._update_ema()
        loss_sum, correct, norm_sum, clipped_count, examples, units = stats
        self.loss_tracker.update_state(_safe_mean(loss_sum, examples), sample_weight=examples)
        self.accuracy_tracker.update_state(_safe_mean(correct, examples), sample_weight=examples)
        self.grad_norm_tracker.update_state(_safe_mean(norm_sum, units), sample_weight=units)
        self.clipped_tracker.update_state(_safe_mean(clipped_count, units), sample_weight=units)
        return {m.name: m.result() for m in self.metrics}

    def add_noise(self, summed):
        """Adds this replica's share of the logical batch's noise (std split over R)."""
        stddev = noise.noise_stddev_per_replica(
            self.mechanism.noise_stddev(), self.distribute_strategy.num_replicas_in_sync)
        return noise.add_gaussian_noise(summed, stddev=stddev, generator=self.noise_generator)

    def scale_update(self, noisy):
        """Divides the noisy sum by the expected batch size B (or by M microbatches)."""
        return [g / self.mechanism.update_divisor for g in noisy]

    def test_step(self, data):
        images, labels, mask = keras.utils.unpack_x_y_sample_weight(data)
        logits = self.model(tf.cast(images, tf.float32), training=False)
        self.loss_tracker.update_state(self._loss_fn(labels, logits), sample_weight=mask)
        self.accuracy_tracker.update_state(hits(logits, labels), sample_weight=mask)
        return {"loss": self.loss_tracker.result(), "accuracy": self.accuracy_tracker.result()}

def _safe_mean(total, count):
    return tf.math.divide_no_nan(total, count)
