"""Arrays in memory as a source of examples read by index.

For what is small enough to hold: the pixels of a small dataset
(Fashion-MNIST: 47 MB, CIFAR-10: 154 MB, ImageNet 32x32: 3.9 GB), read
once with `tfdp.data.open_split(..., input="in_memory")`; and what must be
held: the ScatterNet features of Tramer & Boneh 2021 (App. C.1), computed
once from every image of a small dataset (Fashion-MNIST: 60000 x 7 x 7 x 81
float32, 950 MB; CIFAR-10 similar) and then trained on many times.

`read` is a `tf.gather`: TensorFlow ops only. With `pure_tf=True` the
trainer samples its batches in the graph too (`tfdp.data.index_stream`), so
the input calls no Python at all (the per-host input of a TPU pod).

The arrays are copied once into non-trainable tf.Variables on the host CPU and
gathered per batch (a tf.data graph would otherwise copy them in as constants,
which is slow and fails above 2 GB). So build the source outside any
`strategy.scope()` (else the copies would be mirrored onto every device; a
ValueError says so).
"""

import numpy as np
import tensorflow as tf


class ArraySource:
    """Images (or cached features) and labels in memory, read by index.

    The source for `tfdp.data.train_batches` and `tfdp.data.eval_batches`,
    like `TFDSSource`.

    Attributes:
      num_examples: int, N.
      num_classes: int, as given.
      image_shape: (height, width, channels) of one example (or the
        shape of its cached features).
      pure_tf: as given: whether the training batches are sampled in the
        graph (`tfdp.data.graph_sampling`) rather than in numpy.

    Args:
      images: uint8 [num_examples, height, width, channels], or float32
        cached features [num_examples, ...] of rank >= 2 (kept float32: a
        ScatterNet's [N, h, w, K] or a frozen trunk's [N, F]), numpy or tensor.
      labels: int32 [num_examples] (any integer dtype; cast to int32).
      num_classes: number of classes of the dataset.
      pure_tf: sample the training batches in the graph (True: the whole
        input is TensorFlow ops) or in numpy (False, the default: the same
        stream as the `TFDSSource` the arrays came from).

    Raises:
      ValueError: images not uint8 of rank 4 or float32 of rank >= 2; labels not
        [num_examples] integers; no examples; built inside a `tf.distribute`
        strategy scope.
    """

    def __init__(self, images, labels, num_classes, *, pure_tf=False):
        self.num_examples = _check_arrays(images, labels)
        self.num_classes = int(num_classes)
        self.pure_tf = bool(pure_tf)
        self.image_shape = tuple(int(d) for d in images.shape[1:])
        self._images, self._labels = _to_host_variables(images, labels)

    def arrays(self):
        """`(images, labels)` as NumPy arrays (copies of the host variables)."""
        return self._images.numpy(), self._labels.numpy()

    def read(self, indices):
        """`(images [n, ...], labels int32 [n])` at `indices` (int64 [n]), in that order."""
        return tf.gather(self._images, indices), tf.gather(self._labels, indices)


def _check_arrays(images, labels):
    """Checks shapes and dtypes; returns num_examples."""
    images_shape, labels_shape = tuple(images.shape), tuple(labels.shape)
    images_dtype = tf.as_dtype(images.dtype)
    if not ((images_dtype == tf.uint8 and len(images_shape) == 4)
            or (images_dtype == tf.float32 and len(images_shape) >= 2)):
        raise ValueError(
            f"images must be uint8 [num_examples, height, width, channels] (or float32 "
            f"cached features [num_examples, ...]), got {images_dtype.name} {list(images_shape)}; "
            "keep pixels uint8 (the model scales them) and add a channel axis to "
            "grayscale images."
        )
    if labels_shape != images_shape[:1] or not tf.as_dtype(labels.dtype).is_integer:
        raise ValueError(
            f"labels must be integers [num_examples] = [{images_shape[0]}], got "
            f"{tf.as_dtype(labels.dtype).name} {list(labels_shape)}."
        )
    if images_shape[0] == 0:
        raise ValueError("images and labels hold no examples; check the dataset split.")
    return int(images_shape[0])


def _to_host_variables(images, labels):
    """Non-trainable host-CPU copies, captured by reference in tf.data functions."""
    if tf.distribute.has_strategy():
        raise ValueError(
            "Build the data pipeline outside `strategy.scope()`: inside it the "
            "dataset arrays would be mirrored onto every device. Distribute the "
            "returned dataset with model.fit or strategy.experimental_distribute_dataset."
        )
    with tf.device("/CPU:0"):
        images_var = tf.Variable(
            images, trainable=False, dtype=tf.as_dtype(images.dtype), name="data_images"
        )
        labels_var = tf.Variable(
            tf.cast(labels, tf.int32), trainable=False, dtype=tf.int32, name="data_labels"
        )
    return images_var, labels_var
