"""How much the float32 ghost norms over-count, per example, on ordinary images.

The ghost rules return, per example, an upper bound on the norm of what the
clipped sum adds for it (`tfdp.dp.ghost_norms.forms`, "Rounding"). This measures by
how much that bound exceeds:
  - the vector actually added: `slack_i = norm_i / |v_i| - 1`, where v_i is
    `GhostClipping.clipped_sum`'s sum for a batch whose mask is one-hot on
    example i, with C = 1e30 (factor 1); its L2 norm is taken in float64.
    Never negative: that is the contract (a negative value is a bug);
  - with `--float64`, the float64 brute-force norm of the same model's
    per-example gradient (`vs64_i = norm_i / norm64_i - 1`), which adds the
    float32 forward and backward passes' own rounding (either sign).

Models and data (at initialization, seed 0): the Tramer & Boneh CNN on the
first `--examples` real Fashion-MNIST training images (fashion_mnist.gin's
model; read from /usr/share/datasets/fashion-mnist, `apt-get install
dataset-fashion-mnist`), and WRN-16-4 (GN + WS) on synthetic ImageNet images
at 32 x 32 (`tfdp.data.synthetic_image`: smooth random fields plus noise).
`--emulate=bf16|tf32` rounds the rules' matmul inputs as a TPU or GPU does.

    PYTHONPATH=$PWD python benchmarks/ghost_overcount.py [--examples=64] [--float64]
        [--models=tramer_cnn,wrn16_4] [--emulate=bf16]

Prints the host line, then per model the median, 90th and 99th percentiles,
minimum and maximum of each quantity.
"""

import argparse
import gzip
import sys

from tfdp import host

host.enable_onednn()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfdp import models  # noqa: E402
from tfdp.data import synthetic_imagenet  # noqa: E402
from tfdp.dp import device_arithmetic  # noqa: E402
from tfdp.training import ghost_clipping  # noqa: E402

sys.path.insert(0, ".")
from tests.training import ghost_testing  # noqa: E402  (the float64 reference)

FASHION_MNIST = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"


def fashion_mnist_images(count):
    """The first `count` Fashion-MNIST training images, float32 [count, 28, 28, 1] in [0, 255]."""
    with gzip.open(FASHION_MNIST, "rb") as f:
        data = np.frombuffer(f.read(), np.uint8)
    # IDX: magic (4 bytes), count, rows, columns (big-endian int32), then the pixels.
    rows, columns = int.from_bytes(data[8:12], "big"), int.from_bytes(data[12:16], "big")
    pixels = data[16:16 + count * rows * columns]
    return pixels.reshape(count, rows, columns, 1).astype(np.float32)


def synthetic_images(count, size=32):
    """`count` synthetic ImageNet images resized to `size` x `size`, float32 in [0, 255]."""
    images = [synthetic_imagenet.synthetic_image(0, "train", i, size)[0] for i in range(count)]
    return np.stack([tf.image.resize(tf.cast(image, tf.float32), [size, size]).numpy()
                     for image in images])


MODELS = {
    "tramer_cnn": (lambda: models.build_tramer_cnn(10), fashion_mnist_images),
    "wrn16_4": (lambda: models.build_wide_resnet(16, 4, 10), synthetic_images),
}


def measure(name, count, float64):
    builder, images_of = MODELS[name]
    keras.utils.set_random_seed(0)
    model = builder()
    images = images_of(count)
    labels = np.random.default_rng(0).integers(0, 10, count).astype(np.int32)
    ghost = ghost_clipping.GhostClipping(model, model.trainable_variables)
    assert not ghost.fallback_variables

    @tf.function(reduce_retracing=True)
    def added(mask):
        summed, norms, _, _, _ = ghost.clipped_sum(
            tf.constant(images), tf.constant(labels), mask, l2_clip_norm=1e30, normalize=False,
            loss_fn=ghost_testing.LOSS, example_loss_fn=None)
        size = tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(tf.cast(s, tf.float64)))
                                 for s in summed]))
        return norms, size

    norms, sizes = None, []
    for i in range(count):
        mask = np.zeros(count, np.float32)
        mask[i] = 1.0
        all_norms, size = added(tf.constant(mask))
        norms = all_norms.numpy().astype(np.float64) if norms is None else norms
        sizes.append(float(size))
    result = {"slack (norm / |added| - 1)": norms / np.array(sizes) - 1.0}
    if float64:
        twin = ghost_testing.float64_twin(builder, model)
        reference = ghost_testing.float64_example_gradients(twin, images, labels)
        norms64 = np.array([ghost_testing.global_norm64(g) for g in reference])
        result["vs float64 (norm / norm64 - 1)"] = norms / norms64 - 1.0
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--float64", action="store_true")
    parser.add_argument("--emulate", choices=("none", "bf16", "tf32"), default="none")
    args = parser.parse_args()
    print(host.describe_host())
    if args.emulate != "none":
        device = {"bf16": device_arithmetic.BF16, "tf32": device_arithmetic.TF32}[args.emulate]
        emulation = device_arithmetic.emulate(device)  # kept: a dropped context manager exits
        emulation.__enter__()
    print(f"rules' matmul inputs: {device_arithmetic.device_inputs().name} "
          f"(products split: {device_arithmetic.splits()}); {args.examples} examples per model")
    print("| model | quantity | median | 90th pct | 99th pct | min | max |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for quantity, values in measure(name, args.examples, args.float64).items():
            q = np.percentile(values, [50, 90, 99])
            print(f"| {name} | {quantity} | {q[0]:.2e} | {q[1]:.2e} | {q[2]:.2e} | "
                  f"{values.min():.2e} | {values.max():.2e} |", flush=True)


if __name__ == "__main__":
    main()
