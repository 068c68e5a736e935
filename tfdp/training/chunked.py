"""One Keras step from `accumulation_steps` chunk elements: the chunked train function.

`tfdp.training.distribute.distribute_chunks` feeds every accumulation chunk
as its own tf.data element (`ChunkedInput`), so a host holds a few chunks,
never a logical batch. `ChunkedTraining` is the part of a trainer model
(`DPModel`, `NonPrivateModel`) that turns those elements back into one update
per logical batch: one call of the train function, i.e. one Keras step
(callbacks, metrics, the optimizer's iteration count), zeroes this replica's
accumulators, runs `accumulation_steps` times, in order,
`strategy.run(accumulate one chunk)` on the next element of the (distributed)
iterator, then once `strategy.run(update)`.

A model using it defines three hooks, all in replica context:
  - `_zero_contribution()`: zeros shaped like one chunk's contribution;
  - `_contribution(data)`: what one chunk element adds (DPModel: clipped sums;
    NonPrivateModel: plain gradient sums), a nest of tensors;
  - `_update_from_total(total)`: the update of the logical batch from the
    summed contributions (DPModel: noise once, divide by B, apply, EMA,
    metrics), returning the logs dict.

A logical batch fed whole (DPModel's `train_step`) takes the same path:
`_accumulate_batch` cuts it into `accumulation_steps` chunks (`split_chunks`)
and runs the same zero, then `_accumulate_chunk` per chunk in order, then
`_update_from_accumulators`, in replica context.
"""

import tensorflow as tf

from tfdp.training import distribute


class ChunkedTraining:
    """Mixin for a `keras.Model` whose `fit` may take a `ChunkedInput`."""

    _chunked_input = False  # fit's input: logical batches, or ChunkedInput
    _accumulators = None

    def _chunked_fit_input(self, x):
        """`fit`'s `x` unwrapped; sets up the chunked train function for a `ChunkedInput`.

        Raises:
          ValueError: if the input's accumulation_steps differs from the
            model's, or steps_per_execution is not 1.
        """
        chunked = isinstance(x, distribute.ChunkedInput)
        if chunked:
            if x.accumulation_steps != self.accumulation_steps:
                raise ValueError(
                    f"The input is cut into {x.accumulation_steps} accumulation chunks per "
                    f"replica, but this {type(self).__name__} has accumulation_steps="
                    f"{self.accumulation_steps}; build both with the same value.")
            if self.steps_per_execution != 1:
                raise ValueError("Chunked input needs steps_per_execution = 1 (one call of "
                                 "the train function is one logical batch).")
            self._make_accumulators()
            x = x.dataset
        if chunked != self._chunked_input:  # the other input layout: a new train function
            self._chunked_input = chunked
            self.train_function = None
        return x

    def make_train_function(self, force=False):
        """Keras' train function, or for `ChunkedInput` one that takes a chunks per update.

        The accumulators are replica-local variables (`ON_READ`), one copy of
        the accumulated state per replica, kept out of checkpoints (they are
        zero between updates). Logs are the mean of the replicas' metric
        results, as Keras' own reduction gives outside TPUs.
        """
        if not self._chunked_input:
            return super().make_train_function(force=force)
        if self.train_function is not None and not force:
            return self.train_function
        strategy = self.distribute_strategy
        steps = self.accumulation_steps

        def zero():
            strategy.run(self._zero_accumulators)

        def accumulate(data):
            strategy.run(self._accumulate_chunk, args=(data,))

        def update():
            logs = strategy.run(self._update_from_accumulators)
            return {name: strategy.reduce(tf.distribute.ReduceOp.MEAN, value, axis=None)
                    for name, value in logs.items()}

        if not self.run_eagerly:
            accumulate = tf.function(accumulate, jit_compile=self.jit_compile,
                                     reduce_retracing=True, autograph=False)

        def one_update(iterator):
            # A Python loop: automatic control dependencies then run the chunks strictly in
            # order (a tf.while_loop may overlap iterations, which reorders the float sums
            # and breaks bitwise determinism).
            zero()
            for _ in range(steps):
                accumulate(iterator.get_next())
            return update()

        if not self.run_eagerly:
            one_update = tf.function(one_update, reduce_retracing=True, autograph=False)
        self.train_function = one_update
        return one_update

    def _accumulate_batch(self, tensors):
        """Replica context: this replica's accumulators hold the sum of `tensors`' chunks.

        `tensors` (images, labels, mask), each `[batch, ...]`, are cut into
        `accumulation_steps` chunks (`split_chunks`); the accumulators are
        zeroed and each chunk is added with `_accumulate_chunk`, in order, as
        the chunked train function adds its chunk elements. Each chunk's
        accumulation is traced once as a function of its own, called once per
        chunk: the calls touch the same variables, so automatic control
        dependencies run them one after another and, outside XLA, only one
        chunk's per-example gradients are in memory (virtual batching). Under
        `jit_compile` the unrolled calls are one XLA program whose schedule
        XLA chooses; the chunked train function compiles each chunk alone.

        Args:
          tensors: `(images [batch, ...], labels int [batch], mask float32
            [batch] of 0 and 1)`.
        """
        self._make_accumulators()
        self._zero_accumulators()
        accumulate = self._accumulate_chunk
        if not tf.executing_eagerly():
            # No autograph, as Keras traces train_step: an error of a check raised while
            # tracing (e.g. `models.ExampleMixingError`) keeps its type.
            accumulate = tf.function(accumulate, reduce_retracing=True, autograph=False)
        for chunk in split_chunks(tensors, self.accumulation_steps):
            accumulate(chunk)

    def _make_accumulators(self):
        """Replica-local zeros shaped like `_zero_contribution()`, made once per shape."""
        zeros = tf.nest.flatten(self._zero_contribution())
        if self._accumulators is not None and [v.shape for v in self._accumulators.value] == [
                z.shape for z in zeros]:
            return
        with tf.init_scope(), self.distribute_strategy.scope():
            variables = [
                tf.Variable(z, trainable=False, name=f"accumulator_{i}",
                            synchronization=tf.VariableSynchronization.ON_READ,
                            aggregation=tf.VariableAggregation.SUM)
                for i, z in enumerate(zeros)]
        # A plain tuple in a plain object: no Keras or checkpoint tracking.
        self._accumulators = _Untracked(tuple(variables))

    def _zero_accumulators(self):
        for v in self._accumulators.value:
            v.assign(tf.zeros_like(v))

    def _accumulate_chunk(self, data):
        """Replica context: adds one chunk's contribution to this replica's accumulators."""
        contribution = self._contribution(data)
        for v, c in zip(self._accumulators.value, tf.nest.flatten(contribution)):
            v.assign_add(c)

    def _accumulated(self):
        """Replica context: the accumulators' sum, structured as `_zero_contribution()`."""
        flat = [tf.identity(v) for v in self._accumulators.value]
        return tf.nest.pack_sequence_as(self._zero_contribution(), flat)

    def _update_from_accumulators(self):
        """Replica context: the update of the logical batch accumulated so far."""
        return self._update_from_total(self._accumulated())


def split_chunks(tensors, accumulation_steps):
    """`tensors` `[batch, ...]` cut into `accumulation_steps` chunks of equal size, in order.

    The batch is padded with zero rows (mask 0, contributing nothing) to a
    positive multiple of `accumulation_steps` (`pad_rows`), so that every
    chunk has the same shape and at least one row, then cut with a
    `reshape`: chunk i is rows `[i n, (i + 1) n)`, as `tfdp.data.train_chunks`
    cuts a replica's slice. A static batch that already splits evenly is not
    padded, so its chunks keep one static shape, as XLA and TPUs need.

    Returns:
      A list of `accumulation_steps` tuples, each `tensors`' chunk i.
    """
    a = int(accumulation_steps)
    tensors = pad_rows(tuple(tensors), a)
    if a == 1:
        return [tuple(tensors)]
    split = [tf.reshape(t, [a, -1, *dims(t)[1:]]) for t in tensors]
    return [tuple(t[i] for t in split) for i in range(a)]


def pad_rows(tensors, multiple, min_rows=1):
    """Pads `[batch, ...]` tensors with zero rows to a multiple of `multiple`, >= `min_rows` each.

    Every chunk (`batch / multiple` rows) gets at least `min_rows` rows. A no-op
    when the static batch size already is a positive multiple with chunks of
    at least `min_rows`.
    """
    static = tensors[0].shape[0]
    if static is not None and static >= min_rows * multiple and static % multiple == 0:
        return tensors
    size = tf.shape(tensors[0])[0]
    pad = tf.maximum(min_rows, (size + multiple - 1) // multiple) * multiple - size
    # tf.pad with a tensor amount forgets every static dimension; keep the inner ones.
    return [tf.ensure_shape(
        tf.pad(t, tf.concat([[[0, pad]], tf.zeros([t.shape.rank - 1, 2], tf.int32)], 0)),
        [None, *t.shape[1:]]) for t in tensors]


def dims(t):
    """The shape of `t` as a list: static dimensions as ints, others as tensors."""
    dynamic = tf.shape(t)
    return [d if d is not None else dynamic[k] for k, d in enumerate(t.shape)]


class _Untracked:
    """Holds a value out of Keras' and tf.train.Checkpoint's tracking."""

    def __init__(self, value):
        self.value = value


def hits(logits, labels):
    """float32 [batch]: 1 where the arg-max logit is the label."""
    predicted = tf.argmax(logits, -1, output_type=tf.int32)
    return tf.cast(tf.equal(predicted, tf.cast(labels, tf.int32)), tf.float32)


def expand(vector, like):
    """`vector` [n] reshaped to broadcast against `like` [n, ...]."""
    return tf.reshape(vector, [-1] + [1] * (like.shape.rank - 1))


def masked(values, mask):
    """`values` [n, ...] with padding rows (mask 0) set to 0: a padding row's NaN or inf
    (a loss, a norm, a gradient) adds nothing, where `values * mask` would add NaN."""
    return tf.where(expand(mask, values) > 0, values, tf.zeros_like(values))
