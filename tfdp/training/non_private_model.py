"""NonPrivateModel: a keras.Model whose train_step is plain, NON-PRIVATE minibatch SGD."""

import keras
import tensorflow as tf

from tfdp import models
from tfdp.training import chunked
from tfdp.training import ema
from tfdp.training import optimizers
from tfdp.training.chunked import dims as _dims, hits as _hits, pad_rows as _pad_rows
from tfdp.training.dp_model import _safe_mean


class NonPrivateModel(chunked.ChunkedTraining, ema.EMAParameters, keras.Model):
    """Wraps a Keras classifier and trains it WITHOUT differential privacy.

    NOT PRIVATE: no per-example clipping, no noise, no accounting. It is the
    trainer's `privacy=None` mode (`tfdp.train_and_evaluate`), for public
    pretraining and for the non-private ceiling that papers report beside a DP
    number (De et al. 2022, Sec. 4 and Table 5; Tramer & Boneh 2021, Table 1).

    It takes the same inputs as `tfdp.training.DPModel` (the same logical
    batches, augmult views and padding masks), so that a non-private run
    differs from a private one only in the gradient:

    - the loss of one example is the mean over its K views (as DPModel,
      De et al. 2022, eq. (4)), and the step's loss is the MEAN over the
      real (mask > 0) examples of the realized batch: the usual non-private
      mean loss, divided by the realized count, not by the expected B;
    - `accumulation_steps` = a cuts the batch into a chunks whose gradient
      sums are added in a `tf.while_loop` before the one update (virtual
      batching, to bound memory; the update equals that of the whole batch);
    - under a tf.distribute strategy every replica divides its gradient sum
      by the GLOBAL count of real examples (an all-reduce), and Keras' SUM of
      the replicas' gradients is the mean over the whole logical batch;
    - EMA of the parameters as DPModel (`ema_decay`, De et al. 2022, App. C.3).

    Nothing is checked about mixing examples: BatchNormalization in training
    mode is allowed (it is a privacy rule, and nothing here is private).

    Inputs to `fit`: elements `(images, labels)` or `(images, labels, mask)`:
    `images` float32 or uint8 `[batch, H, W, C]` (one view) or `[batch, K, H,
    W, C]` (K views), `labels` int `[batch]`, `mask` `[batch]` 1 for real
    examples and 0 for padding (a mask, never a weight: any value > 0 counts
    as 1).

    Chunked input (what the trainer feeds): `fit` also takes a
    `tfdp.training.distribute.ChunkedInput` of single accumulation chunks, as
    `DPModel` does (`tfdp.training.chunked`): one Keras step sums
    `accumulation_steps` chunks' gradients, then makes one update.

    Metrics: `loss` and `accuracy` (on the mean logits of the views).

    Args:
      model: the classifier, a built `keras.Model` mapping float32 images
        `[batch, height, width, channels]` in [0, 255] to logits
        `[batch, num_classes]`.
      accumulation_steps: chunks per logical batch (per replica), >= 1.
      ema_decay: None (no EMA) or the asymptotic EMA decay in [0, 1).

    Raises:
      ValueError: on mixed precision (`tfdp.models.validate_float32`), an
        `accumulation_steps` < 1 or an `ema_decay` outside [0, 1).
    """

    def __init__(self, model, *, accumulation_steps=1, ema_decay=None, **kwargs):
        super().__init__(**kwargs)
        models.validate_float32(self)
        if int(accumulation_steps) < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}.")
        if ema_decay is not None and not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1) or None, got {ema_decay}.")
        self.model = model
        self.accumulation_steps = int(accumulation_steps)
        self.ema_decay = None if ema_decay is None else float(ema_decay)
        self.ema_variables = None
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.accuracy_tracker = keras.metrics.Mean(name="accuracy")
        self._loss_fn = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=None)
        inputs = getattr(model, "inputs", None)
        self._input_rank = len(inputs[0].shape) if inputs else 4  # incl. the batch axis
        self.built = bool(getattr(model, "built", False))  # as DPModel: no symbolic build

    def get_config(self):
        return {
            "model": keras.saving.serialize_keras_object(self.model),
            "accumulation_steps": self.accumulation_steps,
            "ema_decay": self.ema_decay,
        }

    def call(self, inputs, training=False):
        return self.model(inputs, training=training)

    def fit(self, x=None, *args, **kwargs):
        """`keras.Model.fit`; a Dataset's batches keep the sampler's order (no shuffle).

        `x` may be a `ChunkedInput` (see the class doc).
        """
        x = self._chunked_fit_input(x)
        kwargs.setdefault("shuffle", False)
        return super().fit(x, *args, **kwargs)

    def compile(self, optimizer, **kwargs):
        """Compiles with `optimizer`; the loss (cross-entropy on logits) is fixed.

        Raises:
          ValueError: if `loss` or `metrics` is given, or an optimizer with
            `gradient_accumulation_steps` (`optimizers.refuse_step_miscounting`).
        """
        for key in ("loss", "metrics"):
            if kwargs.get(key) is not None:
                raise ValueError(f"NonPrivateModel.compile does not take {key!r}: the loss is "
                                 "fixed to sparse categorical cross-entropy on logits.")
        optimizer = keras.optimizers.get(optimizer)
        optimizers.refuse_step_miscounting(optimizer, where="NonPrivateModel.compile")
        super().compile(optimizer=optimizer, **kwargs)
        self.optimizer.build(self.trainable_variables)
        self._build_ema()

    def _chunk(self, images, labels, mask):
        """Gradient of the SUM of the chunk's example losses, and its metric sums."""
        with tf.GradientTape() as tape:
            if images.shape.rank == self._input_rank:  # one view: [b, H, W, C]
                logits = self.model(tf.cast(images, tf.float32), training=True)
                losses = self._loss_fn(labels, logits)
            else:  # K views: [b, K, H, W, C] -> [b * K, H, W, C]
                dims = _dims(images)
                views = tf.reshape(images, [-1, *dims[2:]])
                view_logits = self.model(tf.cast(views, tf.float32), training=True)
                view_logits = tf.reshape(view_logits, [dims[0], dims[1], -1])
                view_labels = tf.repeat(tf.cast(labels, tf.int32)[:, tf.newaxis], dims[1], 1)
                losses = tf.reduce_mean(self._loss_fn(view_labels, view_logits), axis=1)
                logits = tf.reduce_mean(view_logits, axis=1)
            loss_sum = tf.reduce_sum(losses * mask)
        grads = tape.gradient(loss_sum, self.trainable_variables,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return grads, (loss_sum, tf.reduce_sum(_hits(logits, labels) * mask),
                       tf.reduce_sum(mask))

    @staticmethod
    def _unpack(data):
        images, labels, mask = keras.utils.unpack_x_y_sample_weight(data)
        if mask is None:
            mask = tf.ones(tf.shape(labels)[:1], tf.float32)
        return images, labels, tf.cast(tf.cast(mask, tf.float32) > 0, tf.float32)

    def _zero_contribution(self):
        """Zeros shaped like one chunk's `_chunk` result."""
        return ([tf.zeros(v.shape) for v in self.trainable_variables],
                tuple(tf.zeros([]) for _ in range(3)))

    def _contribution(self, data):
        """Replica context: one chunk element's gradient sum and metric sums."""
        return self._chunk(*self._unpack(data))

    def train_step(self, data):
        images, labels, mask = self._unpack(data)
        a = self.accumulation_steps
        images, labels, mask = _pad_rows((images, labels, mask), a)
        if a == 1:
            total = self._chunk(images, labels, mask)
        else:
            split = [tf.reshape(t, [a, -1, *_dims(t)[1:]]) for t in (images, labels, mask)]

            def body(i, total):
                chunk = self._chunk(*[t[i] for t in split])
                return i + 1, tf.nest.map_structure(tf.add, total, chunk)

            _, total = tf.while_loop(lambda i, _: i < a, body,
                                     (tf.constant(0), self._zero_contribution()))
        return self._update_from_total(total)

    def _update_from_total(self, total):
        """The mean over the realized logical batch, applied; EMA; metrics."""
        summed, (loss_sum, correct, examples) = total
        count = examples
        if self.distribute_strategy.num_replicas_in_sync > 1:
            count = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, examples)
        # The mean over the realized logical batch (Keras then SUMs the replicas).
        gradients = [g / tf.maximum(count, 1.0) for g in summed]
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        self._update_ema()
        self.loss_tracker.update_state(_safe_mean(loss_sum, examples), sample_weight=examples)
        self.accuracy_tracker.update_state(_safe_mean(correct, examples), sample_weight=examples)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        images, labels, mask = keras.utils.unpack_x_y_sample_weight(data)
        logits = self.model(tf.cast(images, tf.float32), training=False)
        self.loss_tracker.update_state(self._loss_fn(labels, logits), sample_weight=mask)
        self.accuracy_tracker.update_state(_hits(logits, labels), sample_weight=mask)
        return {"loss": self.loss_tracker.result(), "accuracy": self.accuracy_tracker.result()}
