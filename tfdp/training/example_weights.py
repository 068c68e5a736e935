"""Per-example loss weights are refused: they would scale an example's sensitivity."""


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
