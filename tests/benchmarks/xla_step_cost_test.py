"""benchmarks/xla_step_cost.py: the export of the plain and DP steps, and (with JAX) their cost.

The export runs in tfdp's environment on Tramer & Boneh's CNN at B = 4 (a few
seconds). The cost part needs a side interpreter with JAX: set
TFDP_JAX_PYTHON to its path (e.g. $JAX_VENV/bin/python), else it is skipped.
The TPU compile of imagenet.gin's DP step (slow) needs one with jax[tpu]
(libtpu's compile-only client; no TPU): set TFDP_TPU_PYTHON to its path.
"""

import importlib.util
import json
import os
import pathlib
import re
import subprocess

import numpy as np
import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "xla_step_cost.py"
_spec = importlib.util.spec_from_file_location("xla_step_cost", SCRIPT)
xla_step_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(xla_step_cost)

CASE = "tramer_cnn:4"
JAX_PYTHON = os.environ.get("TFDP_JAX_PYTHON")
TPU_PYTHON = os.environ.get("TFDP_TPU_PYTHON")
IMAGENET_GIN = pathlib.Path(__file__).resolve().parents[2] / "gin" / "imagenet.gin"


@pytest.fixture(autouse=True, scope="module")
def _precision_left_as_found():
    """The benchmark replaces tfdp's device plan and form choice in its process: put them back.

    Without this, an xdist worker's later tests traced their steps with the TF32 plan
    (tests/training/device_arithmetic_test.py failed after this file).
    """
    from tfdp.dp import device_arithmetic  # pylint: disable=g-import-not-at-top
    from tfdp.dp.ghost_norms import forms  # pylint: disable=g-import-not-at-top

    saved = device_arithmetic.device_inputs, forms.choose_form
    yield
    device_arithmetic.device_inputs, forms.choose_form = saved


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("xla_step_cost")
    return out_dir, xla_step_cost.export_case(CASE, str(out_dir), plan="tf32")


def test_the_plan_reaches_the_rules():
    # `set_plan` replaces the device where the rules read it: a replacement elsewhere would
    # leave the TF32 and bf16 plans tracing this CPU's one-pass products.
    from tfdp.dp import device_arithmetic  # pylint: disable=g-import-not-at-top
    from tfdp.dp import precision  # pylint: disable=g-import-not-at-top

    for plan in ("tf32", "bf16"):
        xla_step_cost.set_plan(plan)
        assert device_arithmetic.planned_inputs().name == plan and device_arithmetic.splits()
        assert precision.clip_margin() == precision.CLIP_MARGINS[plan]
        assert precision.contraction_chunk() == precision.SPLIT_CHUNK
    xla_step_cost.set_plan("host")
    assert device_arithmetic.device_inputs() == xla_step_cost.set_plan.real()


def test_parse_case():
    assert xla_step_cost.parse_case("wrn16_4:32") == ("wrn16_4", 32, 1, 32, "wrn16_4_b32")
    assert xla_step_cost.parse_case("nf_resnet50:8@128") == ("nf_resnet50", 8, 1, 128,
                                                            "nf_resnet50_b8_r128")
    assert xla_step_cost.parse_case("wrn16_4:64:16") == ("wrn16_4", 64, 16, 32, "wrn16_4_b64_k16")
    assert xla_step_cost.parse_case("nf_resnet50:2:4@64") == ("nf_resnet50", 2, 4, 64,
                                                             "nf_resnet50_b2_k4_r64")
    with pytest.raises(ValueError, match="unknown model"):
        xla_step_cost.parse_case("resnet:8")


@pytest.mark.slow
def test_export_writes_both_steps(exported):
    out_dir, metas = exported
    assert [m["name"] for m in metas] == ["tramer_cnn_b4_plain", "tramer_cnn_b4_dp"]
    assert metas[1]["clipping_path"] == "ghost"
    for meta in metas:
        proto = (out_dir / f"{meta['name']}.hlo.pb").read_bytes()
        assert len(proto) == meta["hlo_bytes"] > 1000
        params = np.load(out_dir / f"{meta['name']}.npz")
        assert len(params.files) == meta["n_params"] > meta["n_args"]
        assert params["p0"].shape == (4, 28, 28, 1)  # the images come first
        assert json.loads((out_dir / f"{meta['name']}.json").read_text())["name"] == meta["name"]
    # the DP step takes (x, y, mask)
    assert metas[1]["n_args"] == 3 and metas[0]["n_args"] == 2


def test_jax_python_required_for_the_cost_part():
    with pytest.raises(SystemExit):
        xla_step_cost.main(["--cases", CASE])


@pytest.mark.skipif(not JAX_PYTHON, reason="TFDP_JAX_PYTHON (a Python with JAX) not set")
def test_cost_in_the_side_interpreter(exported):
    out_dir, metas = exported
    costs = xla_step_cost.run_jax(JAX_PYTHON, str(out_dir), [m["name"] for m in metas], 0)
    plain, dp = costs["tramer_cnn_b4_plain"], costs["tramer_cnn_b4_dp"]
    assert plain["GFLOP"] > 0 and dp["GFLOP"] >= plain["GFLOP"]
    assert dp["GB_accessed"] > 0 and dp["temp_MB"] >= 0
    table = xla_step_cost.step_table([CASE], costs)
    assert table[2].startswith(f"| {CASE} |")


@pytest.mark.slow
def test_layers_export_each_kernels_rule(tmp_path):
    metas = xla_step_cost.export_layers("tramer_cnn:2", str(tmp_path), plan="tf32", first=2)
    assert len(metas) == 2
    assert [(m["T"], m["p"], m["d"]) for m in metas] == [(13 * 13, 8 * 8, 16), (5 * 5, 4 * 4 * 16, 32)]
    assert [m["tfdp_form"] for m in metas] == ["direct", "direct"]
    assert [m["bu_form"] for m in metas] == ["direct", "gram"]  # 2 T^2 = 1250 < p d = 8192
    for meta in metas:
        assert (tmp_path / f"{meta['name']}.hlo.pb").stat().st_size > 100
    lines, total = xla_step_cost.layer_table(
        metas, {m["name"]: {"GFLOP": 1e-3} for m in metas}, batch=2)
    assert len(lines) == 2 + len(metas) + 1 and total["rule"] == pytest.approx(2e-3)


@pytest.mark.slow
def test_unrolled_loops_trace_the_same_rules_without_their_chunk_loops(monkeypatch):
    # The recomputed route's two loops over 3 chunks (2 examples of K = 2 views each), a plain
    # and a WS conv kernel, compiled by XLA: traced unrolled, the graph has no while loop, each
    # loop ran its 3 trips, and the squares and weighted sums are the looped program's, bit
    # for bit.
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdp.dp import ghost_norms  # pylint: disable=g-import-not-at-top
    from tfdp.dp.ghost_norms import forms  # pylint: disable=g-import-not-at-top

    monkeypatch.setattr(forms, "GROUPED_CONV_GRADIENTS", True)
    monkeypatch.setattr(forms, "RECOMPUTED_GRADIENTS", True)
    monkeypatch.setattr(forms, "choose_form", lambda *_: ghost_norms.DIRECT)
    monkeypatch.setattr(forms, "RECOMPUTE_CHUNK_EXAMPLES", 2)
    batch, views = 6, 2
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(batch * views, 7, 7, 3)).astype(np.float32))
    g = tf.constant(rng.normal(size=(batch * views, 4, 4, 5)).astype(np.float32))
    kernel = tf.Variable(rng.normal(size=(3, 3, 3, 5)).astype(np.float32))
    factors = tf.constant(rng.uniform(0.1, 1.0, size=(2, batch)).astype(np.float32))
    geometry = dict(kernel_size=(3, 3), strides=(2, 2), dilation_rate=(1, 1), padding="same")

    def rules(x, factors):
        plain = ghost_norms.conv2d_kernel_sq_norms(x, g, num_views=views, **geometry)
        ws = ghost_norms.ws_kernel_sq_norms(ghost_norms.conv2d_patches(x, **geometry), g, kernel,
                                            epsilon=1e-4, num_views=views)
        return ([plain[0], ws[0]],
                [tf.stack([rule[1](f) for f in tf.unstack(factors)]) for rule in (plain, ws)])

    def whiles(fn):
        graph = fn.get_concrete_function(x, factors).graph
        ops = [op for f in [graph, *graph._functions.values()]  # pylint: disable=protected-access
               for op in (f.get_operations() if hasattr(f, "get_operations") else f.graph.get_operations())]
        return sum(op.type in ("While", "StatelessWhile") for op in ops)

    looped = tf.function(rules, jit_compile=True)
    expected = looped(x, factors)
    assert whiles(looped) > 0
    with xla_step_cost.unrolled_loops() as patched:
        unrolled = tf.function(rules, jit_compile=True)
        got = unrolled(x, factors)
        assert whiles(unrolled) == 0
    assert forms.tf is tf  # put back
    # each rule: its squares' loop, and its weighted sum's loop once per row of factors
    assert patched.trips == [3] * (2 * (1 + len(factors)))
    for want, have in zip(tf.nest.flatten(expected), tf.nest.flatten(got)):
        np.testing.assert_array_equal(have.numpy(), want.numpy())


def test_a_loop_without_a_static_trip_count_stays_a_loop():
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    static = xla_step_cost._StaticLoops(tf)  # pylint: disable=protected-access

    @tf.function
    def run(n):
        return static.while_loop(lambda i, total: i < n, lambda i, total: (i + 1, total + 2.0),
                                 (tf.constant(0), tf.constant(0.0)))

    assert run(tf.constant(4))[1].numpy() == 8.0
    assert static.trips == []


def test_every_trip_counted_takes_the_unrolled_programs_flops_and_the_steps_memory():
    metas = [{"name": "c_plain", "kind": "plain"},
             {"name": "c_dp", "kind": "dp", "recompute_chunks": 4},
             {"name": "c_dp_unrolled", "kind": "dp_unrolled", "recompute_chunks": 4,
              "unrolled_trips": [4, 4]}]
    costs = {"c_plain": {"GFLOP": 1.0, "GB_accessed": 1.0, "temp_MB": 1.0},
             "c_dp": {"GFLOP": 2.0, "GB_accessed": 3.0, "temp_MB": 5.0, "loops": ["?", 4, 4]},
             "c_dp_unrolled": {"GFLOP": 5.0, "GB_accessed": 6.0, "temp_MB": 9.0, "loops": ["?"]}}
    dp = xla_step_cost.every_trip_counted(metas, costs)
    assert (dp["GFLOP"], dp["GB_accessed"], dp["temp_MB"]) == (5.0, 6.0, 5.0)
    assert (dp["GFLOP_loops_once"], dp["count"], dp["exact"]) == (2.0, "unrolled", True)
    costs["c_dp_unrolled"]["loops"] = ["?", "?"]  # a loop left that the trace unrolled: not exact
    assert not xla_step_cost.every_trip_counted(metas, costs)["exact"]


def _without_libtpu(python):
    """Why `python` cannot compile for a TPU here (None if it has jax and libtpu)."""
    if not python:
        return "TFDP_TPU_PYTHON (a Python with jax[tpu]: libtpu's compile-only client) not set"
    probe = subprocess.run([python, "-c", "import jax, libtpu"], capture_output=True, text=True,
                           check=False)
    if probe.returncode != 0:
        return f"TFDP_TPU_PYTHON={python} has no jax[tpu]: {probe.stderr.strip()[-200:]}"
    return None


@pytest.mark.slow
def test_imagenet_gin_dp_step_compiles_for_a_tpu(tmp_path):
    # imagenet.gin's DP step (its model, augmult, input size, normalized update and EMA) at
    # B = 2, compiled for one TPU v5e chip by libtpu's compile-only client: an op the TPU
    # cannot run (or that its compiler refuses) fails here, before any TPU is rented.
    reason = _without_libtpu(TPU_PYTHON)
    if reason:
        pytest.skip(reason)
    gin = IMAGENET_GIN.read_text()

    def setting(pattern):
        found = re.search(pattern, gin, re.MULTILINE)
        assert found, f"imagenet.gin no longer says {pattern!r}: update this test"
        return found.group(1)

    assert setting(r"^tfdp\.train_and_evaluate\.model_fn = @tfdp\.models\.(\w+)") == "build_nf_resnet"
    assert setting(r"^tfdp\.models\.build_nf_resnet\.depth = (\d+)") == "50"
    views, size = int(setting(r"^AUGMULT = (\d+)")), int(setting(r"^IMAGE_SIZE = (\d+)"))
    normalize = setting(r"^tfdp\.PrivacyConfig\.normalize_update = (\w+)") == "True"
    ema_decay = float(setting(r"^tfdp\.OptimizationConfig\.ema_decay = ([0-9.]+)"))
    case = f"nf_resnet50:2:{views}@{size}"
    metas = xla_step_cost.export_case(case, str(tmp_path), plan="bf16", loops="none",
                                      normalize_update=normalize, ema_decay=ema_decay)
    dp = next(m for m in metas if m["kind"] == "dp")
    assert (dp["views"], dp["normalize_update"], dp["ema_decay"]) == (4, True, 0.99999)
    # raises, with the TPU compiler's message, where it refuses the step
    costs = xla_step_cost.run_jax(TPU_PYTHON, str(tmp_path), [dp["name"]], 0, target="tpu:v5e")
    assert costs["_backend"]["backend"] == "tpu"
    assert costs[dp["name"]]["GFLOP"] > 0 and costs[dp["name"]]["temp_MB"] > 0


def test_two_trips_per_loop_trip_keep_the_loop_and_its_result():
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    doubled = xla_step_cost._StaticLoops(tf, per_trip=2)  # pylint: disable=protected-access
    odd = xla_step_cost._StaticLoops(tf, per_trip=2)  # pylint: disable=protected-access

    def run(static, n):
        @tf.function
        def fn():
            return static.while_loop(lambda i, total: i < n,
                                     lambda i, total: (i + 1, total * 2.0 + tf.cast(i, tf.float32)),
                                     (tf.constant(0), tf.constant(1.0)))
        graph = fn.get_concrete_function().graph
        loops = sum(op.type in ("While", "StatelessWhile") for op in graph.get_operations())
        return fn()[1].numpy(), loops

    assert run(doubled, 4) == (run(tf, 4)[0], 1) and doubled.trips == [4]
    assert run(odd, 3) == (run(tf, 3)[0], 0) and odd.trips == [3]  # 3 trips: unrolled
