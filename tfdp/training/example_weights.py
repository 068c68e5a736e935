"""Per-example loss weights are refused: they would scale an example's sensitivity.

The third element of a training batch is read only as a 0/1 padding mask:
`refuse_example_weights` refuses Keras' `class_weight` and `sample_weight`,
`unpack` asserts that a batch's mask is 0/1, and `binary` makes it 0/1 by
construction, whatever it holds.
"""

import keras
import tensorflow as tf


def refuse_example_weights(class_weight, sample_weight, *, where):
    """Raises if per-example loss weights are given: they scale the sensitivity.

    DP-SGD clips each example's gradient to C; a weight w on its loss
    multiplies that gradient AFTER nothing clips it (Keras applies sample
    weights to the loss), so the example moves the sum by up to w C while
    the privacy report claims C (How to DP-fy ML, Ponomareva et al. 2023,
    Sec. 5.2: sensitivity). `class_weight={1: 50}` would let one example
    contribute 50 C. For imbalanced classes, resample the public class
    frequencies into the model's bias, or weight classes inside a
    per-example loss that is clipped afterwards (tfdp offers neither yet).

    Args:
      class_weight, sample_weight: what the caller passed (None: nothing).
      where: the function named in the message.

    Raises:
      ValueError: if either is not None.
    """
    for name, value in (("class_weight", class_weight), ("sample_weight", sample_weight)):
        if value is not None:
            raise ValueError(
                f"{where} does not take {name}: weighting an example's loss scales its "
                "gradient after clipping, so one example could move the update by more than "
                "l2_clip_norm and the reported epsilon would not hold. Remove it; for "
                "imbalanced classes, resample the data or set the classifier's bias from "
                "public class frequencies. (A third element of each batch is read only as "
                "a 0/1 padding mask.)")


def unpack(data):
    """`(images, labels, mask)` of a batch or chunk element; asserts that the mask is 0/1.

    Args:
      data: `(images, labels)` or `(images, labels, mask)`; `mask` `[batch]`
        of any real or bool dtype.

    Returns:
      `images` and `labels` as given, and `mask` float32 `[batch]` (all ones
      when none is given).

    Raises:
      tf.errors.InvalidArgumentError: (when run) a mask value other than 0
        and 1: per-example weights would scale the sensitivity.
    """
    images, labels, mask = keras.utils.unpack_x_y_sample_weight(data)
    if mask is None:
        mask = tf.ones(tf.shape(labels)[:1], tf.float32)
    mask = tf.cast(mask, tf.float32)
    # Tell a user who passed weights (the sum uses the mask as 0/1 whatever this says).
    tf.debugging.assert_equal(
        mask * (1.0 - mask), tf.zeros_like(mask),
        message="The third element of a training batch is the padding mask and must be 0 "
                "or 1: per-example weights scale the sensitivity (DPModel refuses "
                "class_weight and sample_weight).")
    return images, labels, mask


def binary(mask):
    """float32 `[batch]` of 0 and 1 by construction (any value > 0 counts as 1): a mask is
    never a weight."""
    return tf.cast(tf.cast(mask, tf.float32) > 0, tf.float32)
