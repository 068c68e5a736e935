"""What DPModel's check of the traced ops costs per step: checked vs inline, interleaved.

With oneDNN on, `clip_paths.checked` traces each chunk's contribution as a function of
its own and calls that function from the train step (docs/design/dp_step.md, "The ops a step runs").
This times two DPModels of the same model side by side in one process: one as shipped
("nested"), one whose check is skipped so that the contribution is built inline in the
train function ("inline"); each round times `--steps` steps of each, after warm-up, and
the script prints every round and the median of the per-round ratios nested / inline.

    python benchmarks/checked_step_cost.py --model=tramer_cnn --batch_size=512 --rounds=16
    python benchmarks/checked_step_cost.py --model=wrn16_4 --batch_size=32 --rounds=10
"""

import argparse
import statistics
import time

from tfdp import host

host.enable_onednn()  # before TensorFlow's import

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfdp import accounting  # noqa: E402
from tfdp import models  # noqa: E402
from tfdp.training.dp_model import DPModel  # noqa: E402

MODELS = {
    "tramer_cnn": (lambda: models.build_tramer_cnn(10), (28, 28, 1)),
    "wrn16_4": (lambda: models.build_wide_resnet(16, 4, 10), (32, 32, 3)),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tramer_cnn")
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(host.describe_host())
    builder, shape = MODELS[args.model]
    mechanism = accounting.DPMechanism(num_examples=60000, batch_size=args.batch_size,
                                       num_steps=10, noise_multiplier=1.0, l2_clip_norm=1.0,
                                       delta=1e-5)
    onednn = host.onednn_enabled
    trainers = {}
    for name in ("nested", "inline"):
        keras.utils.set_random_seed(0)
        trainers[name] = DPModel(builder(), mechanism)
        trainers[name].compile(optimizer=keras.optimizers.SGD(0.1))
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (args.batch_size, *shape)).astype(np.float32)
    y = rng.integers(0, 10, args.batch_size)

    def seconds_per_step(name, steps):
        # The check runs at trace time only: "inline" traces with it switched off.
        host.onednn_enabled = onednn if name == "nested" else (lambda: False)
        try:
            trainers[name].train_on_batch(x, y)
            start = time.perf_counter()
            for _ in range(steps):
                trainers[name].train_on_batch(x, y)
            return (time.perf_counter() - start) / steps
        finally:
            host.onednn_enabled = onednn

    for name in trainers:
        seconds_per_step(name, 1)  # trace and warm up
    ratios = []
    for r in range(args.rounds):
        nested, inline = seconds_per_step("nested", args.steps), seconds_per_step(
            "inline", args.steps)
        ratios.append(nested / inline)
        print(f"round {r}: nested {nested * 1e3:.1f} ms, inline {inline * 1e3:.1f} ms, "
              f"ratio {ratios[-1]:.3f}", flush=True)
    print(f"median nested / inline over {args.rounds} rounds: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
