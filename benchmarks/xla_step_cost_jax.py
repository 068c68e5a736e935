"""The JAX side of `xla_step_cost.py`: XLA's cost of exported steps, and optionally their time.

Runs in a Python with JAX (never in tfdp's environment; no TensorFlow, no
tfdp import). The same analysis as benchmarks/device_replay/cost.py. For each
NAME (written by `xla_step_cost.py`: DIR/NAME.hlo.pb, DIR/NAME.npz), compiles
the HLO on JAX's default backend and prints one JSON line: XLA's cost
analysis (`GFLOP`, `GB_accessed`) and memory analysis (`temp_MB`,
`arg_MB`, `out_MB`); with `--seconds=S` (S > 0) also `step_ms`, the median
time of one step run as a training loop for S seconds (at least 5 steps,
after 2 warm-up steps), each step's updated variables (the outputs aliased
to parameters) fed to the next.

    /tmp/vjax/bin/python benchmarks/xla_step_cost_jax.py DIR NAME... [--seconds=S] [--rewrite]

`--rewrite`: writes every `mhlo.copy` as an identity `stablehlo.convert`
(jax >= 0.11 refuses `mhlo.copy`).
"""

import json
import os
import sys
import time

import jax
import jax.extend
import numpy as np
from jax._src.lib import xla_client as xc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "device_replay"))
from hlo_import import aliases_of, without_mhlo_copy  # noqa: E402

jax.config.update("jax_enable_x64", True)  # int64 parameters (the optimizer's iteration) stay int64


def compile_hlo(backend, proto, rewrite):
    mlir = xc._xla.mlir.hlo_to_stablehlo(proto)
    aliases = aliases_of(mlir)
    if rewrite:
        mlir, _ = without_mhlo_copy(mlir)
    devices = backend.local_devices()[:1]
    try:
        exe = backend.compile_and_load(mlir, devices, xc.CompileOptions())
    except TypeError:
        exe = backend.compile_and_load(mlir, xc.DeviceList(tuple(devices)), xc.CompileOptions())
    return exe, aliases


def cost(exe):
    analysis = exe.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    record = {"GFLOP": round(analysis.get("flops", 0.0) / 1e9, 4),
              "GB_accessed": round(analysis.get("bytes accessed", 0.0) / 1e9, 4)}
    try:
        mem = exe.get_compiled_memory_stats()
        record.update(temp_MB=round(mem.temp_size_in_bytes / 1e6, 2),
                      arg_MB=round(mem.argument_size_in_bytes / 1e6, 2),
                      out_MB=round(mem.output_size_in_bytes / 1e6, 2))
    except Exception as e:  # pylint: disable=broad-except
        record["temp_MB"] = float("nan")
        record["memory"] = f"n/a ({type(e).__name__})"
    return record


def time_step(exe, aliases, arrays, device, seconds):
    bufs = [jax.device_put(a, device) for a in arrays]

    def step():
        outs = exe.execute(bufs)
        for p, o in aliases:
            bufs[p] = outs[o]
        for o in outs:
            o.block_until_ready()

    for _ in range(2):
        step()
    times, start = [], time.time()
    while time.time() - start < seconds or len(times) < 5:
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    times.sort()
    return {"step_ms": round(1e3 * times[len(times) // 2], 3), "step_ms_min": round(1e3 * times[0], 3),
            "steps_timed": len(times)}


def main(argv):
    flags = [a for a in argv if a.startswith("--")]
    positional = [a for a in argv if not a.startswith("--")]
    seconds = 0.0
    for flag in flags:
        if flag.startswith("--seconds="):
            seconds = float(flag.split("=", 1)[1])
    rewrite = "--rewrite" in flags
    directory, names = positional[0], positional[1:]
    backend = jax.extend.backend.get_backend()
    device = backend.local_devices()[0]
    print(json.dumps({"backend": backend.platform, "device": str(device), "jax": jax.__version__}),
          flush=True)
    for name in names:
        record = {"name": name}
        start = time.time()
        with open(f"{directory}/{name}.hlo.pb", "rb") as f:
            exe, aliases = compile_hlo(backend, f.read(), rewrite)
        record["compile_s"] = round(time.time() - start, 1)
        record.update(cost(exe))
        if seconds > 0:
            params = np.load(f"{directory}/{name}.npz")
            arrays = [params[f"p{i}"] for i in range(len(params.files))]
            record.update(time_step(exe, aliases, arrays, device, seconds))
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
