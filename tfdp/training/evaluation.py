"""Test accuracy of the last or EMA parameters, plain or with AugTest voting."""

import keras
import tensorflow as tf

from tfdp import augment


def test_accuracy(model, dataset, *, augtest=None, check=None):
    """Accuracy of `model` on `dataset`, optionally by AugTest majority vote.

    Args:
      model: maps float32 `[batch, H, W, C]` in [0, 255] to logits.
      dataset: `tf.data.Dataset` of `(images uint8 [batch, H, W, C],
        labels int [batch])`, in a fixed order.
      augtest: None, or `(augment_fn, augmult, seed)`: every test image gets the
        same K = augmult augmented views (seeded by (seed, batch index)) and the
        predicted class is the majority vote of the K predictions (TAN, Sander
        et al. 2023, Sec. 4.2, Table 2; ties: `tfdp.augment.majority_vote`).
      check: None, or a function of no argument called before every batch
        (the run's `tfdp.workdir.check_held`: a run that no longer holds its
        workdir stops within one batch).

    Returns:
      Accuracy in [0, 1], a Python float.

    Raises:
      Whatever `check` raises.
    """

    @tf.function
    def predict(step, images):
        if augtest is None:
            return tf.argmax(model(tf.cast(images, tf.float32), training=False), -1,
                             output_type=tf.int32)
        augment_fn, augmult, seed = augtest
        views = augment.augtest_views(
            images, tf.random.fold_in(augment.as_seed(seed), step),
            augment_fn=augment_fn, augmult=augmult,
        )
        shape = tf.shape(views)
        flat = tf.reshape(views, tf.concat([[shape[0] * shape[1]], shape[2:]], 0))
        logits = model(flat, training=False)
        return augment.majority_vote(tf.reshape(logits, [shape[0], shape[1], -1]))

    correct = total = 0
    for step, (images, labels) in dataset.enumerate():
        if check is not None:
            check()
        predictions = predict(step, images)
        correct += int(tf.reduce_sum(tf.cast(predictions == tf.cast(labels, tf.int32), tf.int32)))
        total += int(tf.shape(labels)[0])
    return correct / max(total, 1)


class ExtraEvaluation(keras.callbacks.Callback):
    """Adds `val_ema_accuracy` and `val_augtest_accuracy` to the epoch logs.

    Place it after Keras' own validation (it runs in `on_epoch_end`) and before
    the loggers. AugTest uses the exported parameters: EMA when EMA is on.

    Args:
      dp_model: the `DPModel` being trained.
      dataset: the evaluation dataset (see `test_accuracy`).
      augtest: None or `(augment_fn, augmult, seed)`.
      check: None, or a function called before every batch (`test_accuracy`).
    """

    def __init__(self, dp_model, dataset, *, augtest=None, check=None):
        super().__init__()
        self.dp_model = dp_model
        self.dataset = dataset
        self.augtest = augtest
        self.check = check

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        with self.dp_model.use_ema_parameters():
            if self.dp_model.ema_variables:
                logs["val_ema_accuracy"] = test_accuracy(self.dp_model.model, self.dataset,
                                                         check=self.check)
            if self.augtest is not None:
                logs["val_augtest_accuracy"] = test_accuracy(
                    self.dp_model.model, self.dataset, augtest=self.augtest, check=self.check
                )
