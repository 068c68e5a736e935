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
                                     reduce_retracing=True)

        def one_update(iterator):
            # A Python loop: automatic control dependencies then run the chunks strictly in
            # order (a tf.while_loop may overlap iterations, which reorders the float sums
            # and breaks bitwise determinism).
            zero()
            for _ in range(steps):
                accumulate(iterator.get_next())
            return update()

        if not self.run_eagerly:
            one_update = tf.function(one_update, reduce_retracing=True)
        self.train_function = one_update
        return one_update

    def _make_accumulators(self):
        """Replica-local zeros shaped like `_zero_contribution()`, made once."""
        if self._accumulators is not None:
            return
        with self.distribute_strategy.scope():
            variables = [
                tf.Variable(z, trainable=False, name=f"accumulator_{i}",
                            synchronization=tf.VariableSynchronization.ON_READ,
                            aggregation=tf.VariableAggregation.SUM)
                for i, z in enumerate(tf.nest.flatten(self._zero_contribution()))]
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

    def _update_from_accumulators(self):
        """Replica context: the update of the logical batch accumulated so far."""
        flat = [tf.identity(v) for v in self._accumulators.value]
        return self._update_from_total(tf.nest.pack_sequence_as(self._zero_contribution(), flat))


class _Untracked:
    """Holds a value out of Keras' and tf.train.Checkpoint's tracking."""

    def __init__(self, value):
        self.value = value
