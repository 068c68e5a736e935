"""benchmarks/tpu_step_estimate.py and tpu_layer_forms.py's tables: arithmetic over JSON lines.

Neither needs JAX or a TPU: they read the JSON lines `tpu_layer_forms.py` printed.
"""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
_spec = importlib.util.spec_from_file_location("tpu_step_estimate",
                                               BENCHMARKS / "tpu_step_estimate.py")
tpu_step_estimate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tpu_step_estimate)


def _record(layer, form, gflop, gb, mcycles, n=8, views=1):
    return {"layer": layer, "n": n, "K": views, "form": form, "precision": "DEFAULT",
            "GFLOP": gflop, "GB": gb, "Mcycles": mcycles}


@pytest.fixture
def lines(tmp_path):
    # Every WRN-16-4 shape: plain 1 / 0.1 / 1, norms 2 / 0.3 / 5, clipped sum 1.5 / 0.4 / 2.
    records = []
    for layer in tpu_step_estimate.COUNT:
        records += [_record(layer, "plain", 1.0, 0.1, 1.0),
                    _record(layer, "norm_each", 2.0, 0.3, 5.0),
                    _record(layer, "sum_each", 1.5, 0.4, 2.0)]
    path = tmp_path / "forms.jsonl"
    path.write_text("not json\n" + "\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_the_estimate_adds_each_layers_norms_and_the_sums_excess_per_chunk(lines):
    data = tpu_step_estimate.load([str(lines)])
    convs = sum(tpu_step_estimate.COUNT.values())  # 16 convolutions in WRN-16-4
    chunks = 32 // 8
    totals, rows = tpu_step_estimate.estimate(data, 32, 8, "norm_each")
    assert totals == pytest.approx({"GFLOP": convs * chunks * 2.0, "GB": convs * chunks * 0.3,
                                    "Mcycles": convs * chunks * 5.0})
    totals, rows = tpu_step_estimate.estimate(data, 32, 8, "norm_each", sum_form="sum_each")
    assert totals == pytest.approx({"GFLOP": convs * chunks * 2.5, "GB": convs * chunks * 0.6,
                                    "Mcycles": convs * chunks * 6.0})
    assert all(f == "norm_each" for _, f, _ in rows)


def test_a_layer_without_the_sums_form_is_reported_missing(lines):
    data = tpu_step_estimate.load([str(lines)])
    del data["s3_1x1s2_128_256", 8, "sum_each"]
    _, rows = tpu_step_estimate.estimate(data, 32, 8, "norm_each", sum_form="sum_each")
    assert [layer for layer, f, _ in rows if f is None] == ["s3_1x1s2_128_256"]
    _, rows = tpu_step_estimate.estimate(data, 32, 8, "norm_each")
    assert all(f is not None for _, f, _ in rows)


def test_augmult_records_are_read_only_for_their_views(lines, tmp_path):
    path = tmp_path / "k16.jsonl"
    path.write_text(json.dumps(_record("stem_3x3_3_16", "plain", 9.0, 9.0, 9.0, views=16)))
    assert ("stem_3x3_3_16", 8, "plain") not in tpu_step_estimate.load([str(path)])
    assert tpu_step_estimate.load([str(path)], views=16)["stem_3x3_3_16", 8, "plain"]["GB"] == 9.0


def test_the_forms_table_and_the_estimate_run_without_jax(lines):
    # tfdp's environment has no JAX: both read earlier runs' lines there.
    table = subprocess.run([sys.executable, str(BENCHMARKS / "tpu_layer_forms.py"), "--table",
                            "GB", str(lines)], capture_output=True, text=True, check=True).stdout
    assert "| s3_3x3_256_256 | 8 | 1 | DEFA | 0.1 | 0.3 | 0.4 |" in table
    out = subprocess.run([sys.executable, str(BENCHMARKS / "tpu_step_estimate.py"), str(lines),
                          "--batch", "32", "--chunk", "8", "--plain", "10,1,2",
                          "--forms", "norm_each", "--sum", "sum_each"],
                         capture_output=True, text=True, check=True).stdout
    assert "| norm_each | 170 (17.00x) | 39.4 (39.40x) | 386 (193.00x) | - |" in out
