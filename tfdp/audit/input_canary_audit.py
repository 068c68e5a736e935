"""InputCanaryAudit: the `train_and_evaluate(audit=...)` hook for mislabelled-image canaries."""

import secrets

import keras
import numpy as np
import tensorflow as tf

from tfdp.accounting import audit as audit_lib
from tfdp.training.dp_model import DPModel


class InputCanaryAudit:
    """Black-box audit of a run with mislabelled training images as canaries.

    Steinke, Nasr & Jagielski 2023, Sec. 7 (input-space canaries): m images
    of the training split become canaries. Each gets a wrong label, drawn
    uniformly among the other classes; each is included in the training set,
    with that label, independently with probability 1/2, and left out
    otherwise (its correctly labelled original is removed either way). After
    training, a canary's score is minus the cross-entropy of its wrong label
    under the exported model (EMA parameters with EMA): the attack a holder
    of the released model can run.

    The training set then has N' = N - m + (included canaries) examples; the
    run's mechanism must be planned for N' (`num_examples_with_canaries`;
    `tools/audit.py input` passes it), so its q = B / N' depends on how many
    coins came up "in", by about B / N'^2 per canary: a negligible departure
    from the paper's setting, where the mechanism does not depend on the
    coins.

    Args:
      num_canaries: m, 2 <= m <= num_examples.
      num_examples: N, the size of the training split as loaded.
      beta, guesses, seed, command: as `GradientCanaryAudit`.

    Raises:
      ValueError: on m outside [2, N].
    """

    def __init__(self, num_canaries, *, num_examples, beta=0.05, guesses=None, seed=None,
                 command=None):
        if not 2 <= int(num_canaries) <= int(num_examples):
            raise ValueError(f"num_canaries must be in [2, num_examples={num_examples}], got "
                             f"{num_canaries}.")
        self.num_canaries = int(num_canaries)
        self.num_examples = int(num_examples)
        self.beta = beta
        self.guesses = guesses
        self.command = command
        self._rng = np.random.default_rng(secrets.randbits(64) if seed is None else seed)
        self.indices = self._rng.choice(self.num_examples, self.num_canaries, replace=False)
        self.included = audit_lib.draw_inclusion(self.num_canaries, self._rng)
        self.images = self.labels = None

    @property
    def num_examples_with_canaries(self):
        """N' = N - m + (included canaries): the NUM_EXAMPLES of the audited run."""
        return self.num_examples - self.num_canaries + int(self.included.sum())

    def prepare_train(self, train):
        """The training split with the canaries' originals out and the included canaries in.

        Args:
          train: the split's source (`tfdp.data.TFDSSource` or `ArraySource`).

        Returns:
          A source of N' examples that reads `train` by index (nothing more is
          held in memory than the m canary images, kept for scoring).

        Raises:
          ValueError: if the split does not have `num_examples` examples.
        """
        if train.num_examples != self.num_examples:
            raise ValueError(f"The training split has {train.num_examples} examples, but the "
                             f"audit was planned for num_examples={self.num_examples}.")
        offsets = self._rng.integers(1, train.num_classes, size=self.num_canaries)
        images, labels = train.read(tf.constant(self.indices, tf.int64))
        self.images = images.numpy()
        self.labels = ((labels.numpy() + offsets) % train.num_classes).astype(np.int32)
        keep = np.ones(self.num_examples, bool)
        keep[self.indices] = False
        order = np.concatenate([np.flatnonzero(keep), self.indices[self.included]])
        wrong_labels = np.concatenate([np.full(keep.sum(), -1, np.int32),
                                       self.labels[self.included]])
        return _CanarySource(train, order, wrong_labels)

    def build_dp_model(self, model, mechanism, **kwargs):
        """The run's usual `DPModel`."""
        return DPModel(model, mechanism, **kwargs)

    def scores(self, dp_model, batch_size=1000):
        """Minus each canary's loss on its wrong label, under the exported parameters: [m]."""
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
        losses = []
        with dp_model.use_ema_parameters():
            for start in range(0, self.num_canaries, batch_size):
                images = self.images[start:start + batch_size].astype(np.float32)
                logits = dp_model.model(images, training=False)
                losses.append(np.asarray(loss_fn(self.labels[start:start + batch_size], logits)))
        return -np.concatenate(losses)

    def result(self, dp_model, mechanism):
        """The report's "audit" section, from the trained model."""
        epsilon, delta = mechanism.guarantee(int(dp_model.optimizer.iterations.numpy()))
        result = audit_lib.audit(self.scores(dp_model), self.included, delta=delta,
                                 beta=self.beta, guesses=self.guesses)
        return audit_lib.report_section(
            result, canaries="input: mislabelled training images (wrong label uniform among "
                             "the other classes)",
            score="minus the cross-entropy of the canary's wrong label under the exported model",
            num_included=int(self.included.sum()), claimed_epsilon=epsilon,
            command=self.command)


class _CanarySource:
    """`base` read through an index map, with some labels replaced.

    Example i of this source is example `order[i]` of `base`, with label
    `wrong_labels[i]` where that is >= 0 and its own label otherwise.
    """

    def __init__(self, base, order, wrong_labels):
        self._base = base
        self._order = tf.constant(order, tf.int64)
        self._wrong_labels = tf.constant(wrong_labels, tf.int32)
        self.num_examples = len(order)
        self.num_classes = base.num_classes
        self.image_shape = base.image_shape
        self.pure_tf = base.pure_tf  # the index map is a tf.gather

    def read(self, indices):
        """`(images, labels int32)` at `indices` (int64 [n]), as the base source's `read`."""
        images, labels = self._base.read(tf.gather(self._order, indices))
        wrong = tf.gather(self._wrong_labels, indices)
        return images, tf.where(wrong >= 0, wrong, labels)
