"""tfdp's DP step against Opacus 1.6's, each library in its own process; prints the ratio.

The same two models in both libraries, trained on the same
kind of random in-memory batch, C = 1, sigma = 1, SGD:
  - Tramer & Boneh's Fashion-MNIST CNN (26,010 parameters), B = 512;
  - WRN-16-4 with GroupNorm (16 groups), B = 32. tfdp's has weight
    standardization (`tfdp.models.build_wide_resnet`); Opacus' hooks and ghost
    modes have no per-sample rule for a weight-standardized convolution, so
    its WRN uses plain `nn.Conv2d` (less work than tfdp's: the comparison
    favours Opacus).
tfdp runs `DPModel(clipping="auto")` (ghost norms); Opacus runs
`PrivacyEngine.make_private` in each of its modes, "hooks", "functorch" and
"ghost" (fast gradient clipping, `grad_sample_mode="ghost"`), and its best
mode is compared. Each round starts one process per (library, mode), in
alternating order, each warming up then timing `--steps` steps; the medians
over `--rounds` rounds are compared. Both use `--threads` intra-op threads.

tfdp runs in this interpreter's environment, Opacus in `--opacus_python`
(a separate venv: `python3 -m venv .venv-opacus && .venv-opacus/bin/pip install
torch==2.13.0+cpu opacus==1.6.0`; tfdp's own environment never gets torch):

    python benchmarks/vs_opacus.py --model=wrn16_4 --opacus_python=.venv-opacus/bin/python
    python benchmarks/vs_opacus.py --model=tramer_cnn --opacus_python=.venv-opacus/bin/python
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BATCH = {"tramer_cnn": 512, "wrn16_4": 32}
SHAPE = {"tramer_cnn": (28, 28, 1), "wrn16_4": (32, 32, 3)}
MODES = ("hooks", "functorch", "ghost")


def run_tfdp(model_name, steps, threads):
    from tfdp import host
    host.enable_onednn()
    import keras
    import numpy as np
    import tensorflow as tf
    from tfdp import accounting, models
    from tfdp.training.dp_model import DPModel

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    keras.utils.set_random_seed(0)
    model = (models.build_tramer_cnn(10) if model_name == "tramer_cnn"
             else models.build_wide_resnet(16, 4, 10))
    batch = BATCH[model_name]
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 255, (batch, *SHAPE[model_name])).astype(np.float32)
    y = rng.integers(0, 10, batch).astype(np.int32)
    mechanism = accounting.DPMechanism(num_examples=60000, batch_size=batch, num_steps=1000,
                                       noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5)
    dp = DPModel(model, mechanism, clipping="auto", noise_seed=0)
    dp.compile(optimizer=keras.optimizers.SGD(0.01))
    assert dp.clipping_path == "ghost"
    for _ in range(2):
        dp.train_on_batch(x, y)
    start = time.perf_counter()
    for _ in range(steps):
        dp.train_on_batch(x, y)
    return batch * steps / (time.perf_counter() - start)


def _torch_models(model_name):
    import torch
    from torch import nn

    if model_name == "tramer_cnn":
        return nn.Sequential(
            nn.Conv2d(1, 16, 8, stride=2, padding=2), nn.Tanh(), nn.MaxPool2d(2, 1),
            nn.Conv2d(16, 32, 4, stride=2), nn.Tanh(), nn.MaxPool2d(2, 1), nn.Flatten(),
            nn.Linear(32 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, 10))

    def gn(channels):
        return nn.GroupNorm(16, channels)

    class Block(nn.Module):  # pre-activation basic block, as tfdp.models.build_wide_resnet
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.pre = gn(cin)
            self.a = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.mid = gn(cout)
            self.b = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.shortcut = (nn.Conv2d(cin, cout, 1, stride, bias=False)
                             if cin != cout or stride != 1 else None)

        def forward(self, x):
            o = torch.relu(self.pre(x))
            z = self.b(torch.relu(self.mid(self.a(o))))
            return z + (x if self.shortcut is None else self.shortcut(o))

    layers = [nn.Conv2d(3, 16, 3, 1, 1, bias=False)]
    cin = 16
    for stage, (cout, stride) in enumerate([(64, 1), (128, 2), (256, 2)]):
        for block in range(2):
            layers.append(Block(cin, cout, stride if block == 0 else 1))
            cin = cout
    layers += [gn(cin), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return nn.Sequential(*layers)


def run_opacus(model_name, steps, threads, mode):
    import numpy as np
    import torch
    from opacus import PrivacyEngine

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = _torch_models(model_name)
    batch = BATCH[model_name]
    rng = np.random.default_rng(0)
    shape = SHAPE[model_name]
    # Pixels in [0, 1]: tfdp's models rescale their [0, 255] input inside; fed 0..255,
    # the torch CNN's tanh units saturate and its gradients go denormal (10x slower).
    x = torch.tensor(rng.uniform(0, 1, (batch, shape[2], shape[0], shape[1])),
                     dtype=torch.float32)
    y = torch.tensor(rng.integers(0, 10, batch))
    dataset = torch.utils.data.TensorDataset(x, y)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = torch.nn.CrossEntropyLoss()
    engine = PrivacyEngine()
    kwargs = dict(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
                  max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode=mode)
    if mode == "ghost":
        model, optimizer, criterion, loader = engine.make_private(criterion=criterion, **kwargs)
    else:
        model, optimizer, loader = engine.make_private(**kwargs)

    def step():
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()

    for _ in range(2):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return batch * steps / (time.perf_counter() - start)


def child(args):
    if args.library == "tfdp":
        rate = run_tfdp(args.model, args.steps, args.threads)
    else:
        rate = run_opacus(args.model, args.steps, args.threads, args.mode)
    print(json.dumps({"examples_per_second": rate}))


def parent(args):
    runs = [("tfdp", "ghost", sys.executable)] + [
        ("opacus", mode, args.opacus_python) for mode in args.modes.split(",")]
    rates = {(lib, mode): [] for lib, mode, _ in runs}
    for round_index in range(args.rounds):
        order = runs if round_index % 2 == 0 else list(reversed(runs))
        for library, mode, python in order:
            command = [python, os.path.abspath(__file__), "--child", f"--library={library}",
                       f"--mode={mode}", f"--model={args.model}", f"--steps={args.steps}",
                       f"--threads={args.threads}"]
            env = dict(os.environ, PYTHONPATH=os.getcwd())
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                print(f"{library} {mode}: failed: {done.stderr.strip().splitlines()[-1:]}")
                rates[(library, mode)].append(float("nan"))
                continue
            rate = json.loads(done.stdout.strip().splitlines()[-1])["examples_per_second"]
            rates[(library, mode)].append(rate)
    from tfdp import host
    print(host.describe_host())
    print(f"{args.model}, B = {BATCH[args.model]}, {args.rounds} rounds (alternating order), "
          f"{args.steps} timed steps per process after 2 warm-up steps, {args.threads} threads")
    print("| library, mode | ex/s each round | median ex/s |")
    print("|---|---|---|")
    medians = {}
    for key, values in rates.items():
        good = [v for v in values if v == v]
        medians[key] = statistics.median(good) if good else float("nan")
        print(f"| {key[0]}, {key[1]} | {', '.join(f'{v:,.1f}' for v in values)} | "
              f"{medians[key]:,.1f} |")
    opacus = {k: v for k, v in medians.items() if k[0] == "opacus" and v == v}
    best = max(opacus, key=opacus.get)
    ratio = medians[("tfdp", "ghost")] / opacus[best]
    print(f"tfdp / Opacus' best mode ({best[1]}): {ratio:.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(BATCH), default="tramer_cnn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--opacus_python", default=".venv-opacus/bin/python")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--library", choices=("tfdp", "opacus"))
    parser.add_argument("--mode", default="ghost")
    args = parser.parse_args()
    (child if args.child else parent)(args)


if __name__ == "__main__":
    main()
