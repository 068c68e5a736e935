"""The JAX side of `xla_step_cost.py`: XLA's cost of exported steps, and optionally their time.

Runs in a Python with JAX (never in tfdp's environment; no TensorFlow, no
tfdp import). For each NAME (written by `xla_step_cost.py`: DIR/NAME.hlo.pb,
DIR/NAME.npz), compiles the HLO for `--target` and prints one JSON line:
XLA's cost analysis of the compiled program (`GFLOP`, `GB_accessed`), its
memory assignment (`temp_MB`, `arg_MB`, `out_MB`) and its while loops
(`loops`: each loop's trip count as the compiler knows it, its
`known_trip_count`, or "?" where it is not static); with `--seconds=S`
(S > 0, a target with a device here) also `step_ms`, the median time of one
step run as a training loop for S seconds (at least 5 steps, after 2 warm-up
steps), each step's updated variables (the outputs aliased to parameters)
fed to the next.

    $JAX_PYTHON benchmarks/xla_step_cost_jax.py DIR NAME... [--target=T] [--seconds=S] [--rewrite]

`--target`: `default` (JAX's default backend), `cpu`, `gpu`, or
`tpu:v4`, `tpu:v5e`, `tpu:v5p`, `tpu:v6e`: one chip of that TPU, compiled
with libtpu's compile-only client (deviceless ahead-of-time compilation; no
TPU attached; a venv with `pip install "jax[tpu]"`). A TPU target rewrites
`mhlo.copy` as `--rewrite` does. `--rewrite`: writes every `mhlo.copy` as an
identity `stablehlo.convert` (jax >= 0.11 refuses `mhlo.copy`).
"""

import json
import os
import re
import sys
import time

# libtpu's compile-only client: no TPU metadata server to ask, and other libtpu users may run
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.extend
import numpy as np  # noqa: E402
from jax._src.lib import xla_client as xc  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "device_replay"))
from hlo_import import aliases_of, without_mhlo_copy  # noqa: E402

jax.config.update("jax_enable_x64", True)  # int64 parameters (the optimizer's iteration) stay int64


# One chip of each TPU generation: the smallest topology libtpu's compile-only client knows.
TPU_TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


def target_device(target):
    """(device, loaded): the device `target` compiles for, and whether it can run here."""
    if target.startswith("tpu:"):
        from jax.experimental import topologies
        chip = target.split(":", 1)[1]
        if chip not in TPU_TOPOLOGIES:
            raise ValueError(f"unknown TPU {chip!r} (one of {sorted(TPU_TOPOLOGIES)})")
        topology = topologies.get_topology_desc(topology_name=TPU_TOPOLOGIES[chip], platform="tpu")
        return topology.devices[0], False
    backend = (jax.extend.backend.get_backend() if target == "default"
               else jax.extend.backend.get_backend(target))
    return backend.local_devices()[0], True


def compile_hlo(device, loaded, proto, rewrite):
    mlir = xc._xla.mlir.hlo_to_stablehlo(proto)
    aliases = aliases_of(mlir)
    if not loaded:  # the compile-only client: a module parsed in JAX's MLIR context
        from jax._src.interpreters import mlir as jm
        from jax._src.lib.mlir import ir
        text, _ = without_mhlo_copy(mlir)
        context = jm.make_ir_context()
        context.allow_unregistered_dialects = True
        with context:
            module = ir.Module.parse(text)
            exe = device.client.compile(module, executable_devices=xc.DeviceList((device,)),
                                        compile_options=xc.CompileOptions())
        return exe, aliases
    if rewrite:
        mlir, _ = without_mhlo_copy(mlir)
    backend = device.client
    try:
        exe = backend.compile_and_load(mlir, [device], xc.CompileOptions())
    except TypeError:
        exe = backend.compile_and_load(mlir, xc.DeviceList((device,)), xc.CompileOptions())
    return exe, aliases


def while_loops(exe):
    """Each while loop of the compiled program: its `known_trip_count` (an int), or "?"."""
    try:
        text = "\n".join(m.to_string() for m in exe.hlo_modules())
    except Exception:  # pylint: disable=broad-except
        return None
    loops = []
    for line in text.splitlines():
        if re.search(r"=\s*\S.*?\swhile\(", line) and "condition=" in line:
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
            loops.append(int(trips.group(1)) if trips else "?")
    return loops


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
    target = "default"
    for flag in flags:
        if flag.startswith("--target="):
            target = flag.split("=", 1)[1]
    directory, names = positional[0], positional[1:]
    device, loaded = target_device(target)
    versions = {"jax": jax.__version__}
    try:
        import importlib.metadata as metadata
        versions["libtpu"] = metadata.version("libtpu")
    except Exception:  # pylint: disable=broad-except
        pass
    print(json.dumps({"backend": device.platform, "target": target,
                      "device": getattr(device, "device_kind", str(device)), **versions}),
          flush=True)
    for name in names:
        record = {"name": name}
        start = time.time()
        try:
            with open(f"{directory}/{name}.hlo.pb", "rb") as f:
                exe, aliases = compile_hlo(device, loaded, f.read(), rewrite)
        except Exception as e:  # pylint: disable=broad-except
            record["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            print(json.dumps(record), flush=True)
            continue
        record["compile_s"] = round(time.time() - start, 1)
        record.update(cost(exe))
        record["loops"] = while_loops(exe)
        if seconds > 0 and loaded:
            params = np.load(f"{directory}/{name}.npz")
            arrays = [params[f"p{i}"] for i in range(len(params.files))]
            record.update(time_step(exe, aliases, arrays, device, seconds))
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    main(sys.argv[1:])
