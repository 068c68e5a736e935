#!/usr/bin/env python3
"""Scores a tfdp export on a held-out split through its `serve` signature.

The accuracy a user of the export gets: the SavedModel is loaded with
`tf.saved_model.load` (not Keras), its `serve` signature gets the split's uint8
images, and the argmax of its logits is compared with the labels. This is how
the final runs of fashion_mnist_best.gin (`benchmarks/fashion_mnist.sh`) are
scored on Fashion-MNIST's 10,000 test images.

    python tools/score_export.py WORKDIR/export --dataset fashion_mnist --split test
    python tools/score_export.py WORKDIR/export --dataset fashion_mnist --split test --json

Exits with status 2 and a one-line message on stderr when the export or the
split cannot be read, or their image shapes differ.
"""

import argparse
import json
import os
import sys

# Runnable as `python tools/score_export.py` from any directory, installed or not.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import numpy as np  # noqa: E402

# Scored this many images per call of the signature.
_BATCH_SIZE = 1000


def score(serve, images, labels, *, batch_size=_BATCH_SIZE):
    """Top-1 accuracy of a `serve` signature on images.

    Args:
      serve: a signature `serve(images=[b, H, W, C]) -> {"logits": [b, classes]}`,
        e.g. `tf.saved_model.load(path).signatures["serve"]`; the images are
        passed in the dtype its input signature names (float32 for tfdp's
        exports, uint8 for earlier ones).
      images: uint8 [num_examples, H, W, C].
      labels: int [num_examples], class ids.
      batch_size: images per call.

    Returns:
      A dict: "accuracy" (float in [0, 1]), "correct" and "num_examples" (ints).

    Raises:
      ValueError: images and labels of different lengths, no images, or
        images that are not uint8.
    """
    images, labels = np.asarray(images), np.asarray(labels)
    if images.dtype != np.uint8:
        raise ValueError(f"score: images must be uint8 (pixel values 0 to 255); got "
                         f"{images.dtype}.")
    if len(images) != len(labels) or not len(images):
        raise ValueError(f"score: {len(images)} images and {len(labels)} labels; need the same "
                         "number, at least one.")
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    dtype = serve.structured_input_signature[1]["images"].dtype
    correct = 0
    for start in range(0, len(images), batch_size):
        batch = tf.cast(tf.constant(images[start:start + batch_size]), dtype)
        logits = serve(images=batch)["logits"]
        predictions = np.argmax(logits.numpy(), axis=-1)
        correct += int(np.sum(predictions == labels[start:start + batch_size]))
    return {"accuracy": correct / len(images), "correct": correct, "num_examples": len(images)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", help="the export folder (WORKDIR/export)")
    parser.add_argument("--dataset", required=True, help='TFDS name, e.g. "fashion_mnist"')
    parser.add_argument("--split", default="test", help='TFDS split, e.g. "test"')
    parser.add_argument("--data_dir", default=None, help="TFDS data_dir (default: TFDS's)")
    parser.add_argument("--json", action="store_true", help="print JSON as the last line")
    args = parser.parse_args(argv)
    from tfdp import data  # pylint: disable=g-import-not-at-top
    from tfdp import storage  # pylint: disable=g-import-not-at-top
    from tfdp.data import loading  # pylint: disable=g-import-not-at-top
    from tfdp.export import saved_model  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    if not saved_model.is_export(args.export):
        return _fail(f"{args.export} is not a tfdp export (no saved_model.pb there); pass the "
                     "workdir's export/ folder of a finished run.")
    try:
        split = loading.read_split(data.open_split(args.dataset, args.split,
                                                   data_dir=args.data_dir))
    except (data.DatasetNotFoundError, ValueError) as error:
        return _fail(str(error))
    # TensorFlow reads the variables' path as a glob pattern: an export in `sweep[lr=0.5]/`
    # is loaded through its open folder, a path without `[` `]`.
    with storage.folder_aliased(args.export):
        serve = tf.saved_model.load(storage.tf_path(args.export)).signatures["serve"]
    expected = tuple(serve.structured_input_signature[1]["images"].shape[1:])
    if tuple(split.images.shape[1:]) != expected:
        return _fail(f"the export takes images of shape {expected}, but {args.dataset} "
                     f"{args.split} has {tuple(split.images.shape[1:])}.")
    result = score(serve, split.images, split.labels)
    result.update(export=args.export, dataset=args.dataset, split=args.split)
    print(f"{args.export}: {100 * result['accuracy']:.2f}% top-1 on {args.dataset} {args.split} "
          f"({result['correct']} of {result['num_examples']}), through its serve signature")
    if args.json:
        print(json.dumps(result))
    return 0


def _fail(message):
    from tfdp import gin_bindings  # pylint: disable=g-import-not-at-top

    print(f"score_export: {gin_bindings.error_message(message)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
