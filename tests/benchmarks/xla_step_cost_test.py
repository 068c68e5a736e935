"""benchmarks/xla_step_cost.py: the export of the plain and DP steps, and (with JAX) their cost.

The export runs in tfdp's environment on Tramer & Boneh's CNN at B = 4 (a few
seconds). The cost part needs a side interpreter with JAX: set
TFDP_JAX_PYTHON to its path (e.g. /tmp/vjax/bin/python), else it is skipped.
"""

import importlib.util
import json
import os
import pathlib

import numpy as np
import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "xla_step_cost.py"
_spec = importlib.util.spec_from_file_location("xla_step_cost", SCRIPT)
xla_step_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(xla_step_cost)

CASE = "tramer_cnn:4"
JAX_PYTHON = os.environ.get("TFDP_JAX_PYTHON")


@pytest.fixture(autouse=True, scope="module")
def _precision_left_as_found():
    """The benchmark replaces tfdp's device plan and form choice in its process: put them back.

    Without this, an xdist worker's later tests traced their steps with the TF32 plan
    (tests/training/device_arithmetic_test.py failed after this file).
    """
    from tfdp.dp import ghost_norms  # pylint: disable=g-import-not-at-top
    from tfdp.dp import precision  # pylint: disable=g-import-not-at-top

    saved = precision.device_inputs, ghost_norms.choose_form
    yield
    precision.device_inputs, ghost_norms.choose_form = saved


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("xla_step_cost")
    return out_dir, xla_step_cost.export_case(CASE, str(out_dir), plan="tf32")


def test_parse_case():
    assert xla_step_cost.parse_case("wrn16_4:32") == ("wrn16_4", 32, 32, "wrn16_4_b32")
    assert xla_step_cost.parse_case("nf_resnet50:8@128") == ("nf_resnet50", 8, 128,
                                                            "nf_resnet50_b8_r128")
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
