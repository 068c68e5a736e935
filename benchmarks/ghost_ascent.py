"""Searches for the input image that makes one example contribute the most, per model family.

For every shipped model family (`tests/training/ghost_testing.FAMILIES`,
at their test sizes) and for the model of README's `make_private` example, maximizes
contribution / C over the input image, where the contribution is the L2 norm
(float64) of what `GhostClipping.clipped_sum` (DPModel's clipping="auto" path)
adds to the clipped sum for a batch of that one example (the fuzzer's
definition, `tests/training/ghost_fuzz_test.py`). C is far below every norm, so
every example is clipped and contribution / C = |summed gradient| / |ghost norm|:
above 1 means the ghost norm came out too small. It must stay <= 1 + 1e-6.

The contribution is computed inside gradient functions (the norms are taken
in the backward pass), so it is not differentiable with respect to the image;
the search is a random-restart hill climb instead of gradient ascent. It starts
from the adversarial images of the fuzzer (constant 0 or full-scale with one
entry off, constant at full scale, uniform noise, a random constant with one
entry off) and keeps every mutation that does not decrease the objective:
1, 2 or 4 entries moved by one pixel step, 1e-3 of one or a random amount;
an entry reset to the image's median; a new label. Two "canary" models
(a Conv2D and a WSConv2D before a GroupNormalization) show that the search
finds the float32 cancellation where it exists (1.5-2.3 C on naive float32
rules).

    PYTHONPATH=$PWD python benchmarks/ghost_ascent.py [--seconds_per_model=20] [--seed=0]
        [--emulate=bf16|tf32 [--unhandled]]

`--emulate` rounds the inputs of every matmul of the ghost-norm rules as a TPU
(one bf16 pass) or an Ampere GPU (TF32) would (`tfdp.dp.device_arithmetic.emulate`);
`--unhandled` keeps the rules planning for float32 products there, the
float32 rules without their precision handling.

Prints one line per model (its maximum, the number of evaluations and the
start it came from), the host's CPU flags, the TensorFlow version and the date.
"""

import argparse
import datetime
import platform
import sys
import time

import keras
import numpy as np
import tensorflow as tf

from tfdp import models
from tfdp.dp import device_arithmetic
from tfdp.training import ghost_clipping

sys.path.insert(0, ".")
from tests.training import ghost_testing  # noqa: E402  (the model families of the tests)

L2_CLIP_NORM = 1e-9  # far below every norm: every example is clipped


def readme_model():
    """The model of README.md's `make_private` example (uint8-range pixels in, 2 classes)."""
    return keras.Sequential([keras.Input((16, 16, 1)), keras.layers.Rescaling(1 / 255),
                             keras.layers.Conv2D(8, 3, activation="tanh"),
                             keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(2)])


def targets():
    """name -> (builder, input shape, input scale, number of classes)."""
    found = {name: (builder, shape, scale, 10)
             for name, (builder, shape, scale) in ghost_testing.FAMILIES.items()}
    found["readme_make_private"] = (readme_model, (16, 16, 1), 255.0, 2)
    found["canary_conv_gn"] = (ghost_testing.conv_group_norm(
        keras.layers.Conv2D, (5, 5, 3), strides=2, groups=16, pool=False), (5, 5, 3), 255.0, 10)
    found["canary_ws_conv_gn"] = (ghost_testing.conv_group_norm(
        models.WSConv2D, (8, 8, 3), strides=1, groups=1, pool=True), (8, 8, 3), 255.0, 10)
    return found


def objective(model):
    """`(image, label) -> contribution / C` of a batch of that one example."""
    ghost = ghost_clipping.GhostClipping(model, model.trainable_variables)
    if ghost.fallback_variables:
        print(f"  note: {len(ghost.fallback_variables)} variables fall back: "
              f"{ghost.uncovered_layers}")
    example_loss = ghost_testing.example_loss_fn(model)

    @tf.function(reduce_retracing=True)
    def contribution(image, label):
        summed = ghost.clipped_sum(image[tf.newaxis], label[tf.newaxis], tf.ones([1]),
                                   l2_clip_norm=L2_CLIP_NORM, normalize=False,
                                   loss_fn=ghost_testing.LOSS, example_loss_fn=example_loss)[0]
        squares = [tf.reduce_sum(tf.square(tf.cast(s, tf.float64))) for s in summed]
        return tf.sqrt(tf.add_n(squares)) / L2_CLIP_NORM

    return lambda image, label: float(contribution(tf.constant(image, tf.float32),
                                                   tf.constant(label, tf.int32)))


def starts(shape, scale, rng):
    """The adversarial starting images: name -> image."""
    step = scale / 255.0  # one pixel step in the input's units
    flat = int(np.prod(shape))

    def one_off(base, value):
        image = np.full(flat, base)
        image[rng.integers(flat)] = value
        return image.reshape(shape)

    mid = rng.uniform(0, scale)
    return {
        "zeros_one_up": one_off(0.0, step),
        "full_one_down": one_off(scale, scale - step),
        "full": np.full(shape, scale),
        "uniform": rng.uniform(0, scale, shape),
        "constant_one_off": one_off(mid, mid + step),
    }


def mutate(image, label, scale, num_classes, rng):
    image = image.copy()
    flat = image.reshape(-1)
    kind = rng.integers(4)
    if kind == 3:
        return image, int(rng.integers(num_classes))
    if kind == 2:
        flat[rng.integers(flat.size)] = np.median(flat)
        return image, label
    where = rng.choice(flat.size, size=rng.choice([1, 2, 4]), replace=False)
    size = [scale / 255.0, 1e-3 * scale, rng.uniform(0, scale)][kind] * rng.choice([-1, 1])
    flat[where] = np.clip(flat[where] + size, 0.0, scale)
    return image, label


def search(name, builder, shape, scale, num_classes, seconds, seed):
    keras.utils.set_random_seed(seed)
    model = builder()
    evaluate = objective(model)
    rng = np.random.default_rng(seed)
    best = (-np.inf, None)
    evaluations = 0
    first = starts(shape, scale, rng)
    budget = seconds / len(first)
    for start, image in first.items():
        label = int(rng.integers(num_classes))
        value = evaluate(image, label)
        evaluations += 1
        deadline = time.monotonic() + budget
        while time.monotonic() < deadline:
            candidate, candidate_label = mutate(image, label, scale, num_classes, rng)
            candidate_value = evaluate(candidate, candidate_label)
            evaluations += 1
            if candidate_value >= value:
                image, label, value = candidate, candidate_label, candidate_value
        if value > best[0]:
            best = (value, start)
    return best[0], best[1], evaluations


def host_line():
    flags = set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    flags = set(line.split(":")[1].split())
                    break
    except OSError:
        pass
    shown = sorted(f for f in flags if f.startswith(("avx512", "avx2", "amx", "fma")))
    return (f"host: {platform.machine()}, CPU flags {' '.join(shown) or 'unknown'} (oneDNN on by "
            f"default with AVX-512), TensorFlow {tf.__version__}, Keras {keras.__version__}, "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds_per_model", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="comma-separated model names")
    parser.add_argument("--emulate", choices=("none", "bf16", "tf32"), default="none",
                        help="round the rules' matmul inputs as this device does")
    parser.add_argument("--unhandled", action="store_true",
                        help="with --emulate: the rules plan for float32 products")
    args = parser.parse_args()
    print(host_line(), flush=True)
    if args.emulate != "none":
        device = {"bf16": device_arithmetic.BF16, "tf32": device_arithmetic.TF32}[args.emulate]
        emulation = device_arithmetic.emulate(device, handled=not args.unhandled)
        emulation.__enter__()  # kept in `emulation`: a dropped context manager exits
        print(f"emulated matmul inputs: {device.name}, rules "
              f"{'NOT told (float32 plan)' if args.unhandled else 'told (split products)'}",
              flush=True)
    worst = 0.0
    for name, (builder, shape, scale, num_classes) in targets().items():
        if args.only and name not in args.only.split(","):
            continue
        value, start, evaluations = search(name, builder, shape, scale, num_classes,
                                           args.seconds_per_model, args.seed)
        flag = "" if value <= 1 + 1e-6 else "   <-- ABOVE C (1 + 1e-6)"
        print(f"{name:22s} max contribution / C = {value:.9f}  ({evaluations} evaluations, "
              f"best start {start}){flag}", flush=True)
        if not name.startswith("canary"):
            worst = max(worst, value)
    print(f"worst over the shipped families and the README model: {worst:.9f} C", flush=True)


if __name__ == "__main__":
    main()
