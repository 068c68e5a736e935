"""docs/runbooks.md's v4-32 pod runbook command, run here up to the TPU itself.

The command is read from docs/runbooks.md (so the documented command is what is
tested), with ram:// (TensorFlow's in-memory file system) standing in for
gs:// (the data: a synthetic ImageNet-shaped JPEG folder written there and
indexed; the workdir: locked by a lease object), the default strategy
standing in for the TPU, and smoke.gin's sizes. Everything else is the
runbook's: imagenet.gin, the pure-TF JPEG-folder input, static batches.
"""

import json
import os
import re
import shlex
import uuid

import pytest
import tensorflow as tf

from tests.conftest import SYNTHETIC_IMAGENET
from tests.imagenet_local_test import SMOKE_PARAMS
from tfdp import workdir as workdir_lib
from tfdp.data import synthetic_imagenet

RUNBOOKS_MD = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "runbooks.md")


def _runbook_command():
    text = open(RUNBOOKS_MD, encoding="utf-8").read()
    block = text.split("<!-- runbook:v4-32 -->", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    args = shlex.split(block.replace("\\\n", " "))
    assert args[:3] == ["python", "-m", "tfdp.main"], args
    files = [a.split("=", 1)[1] for a in args if a.startswith("--gin_file=")]
    params = [a.split("=", 1)[1] for a in args if a.startswith("--gin_param=")]
    (workdir,) = [a.split("=", 1)[1] for a in args if a.startswith("--workdir=")]
    return files, params, workdir


@pytest.mark.slow  # end to end (tests/run_slow.sh); the default suite has the parse below
def test_the_pod_runbook_command_runs_up_to_the_tpu(run_smoke, monkeypatch):
    # A pod's other hosts run their input as graphs: the pure-TF JPEG-folder input never
    # calls the numpy sampler or the ArrayRecord reader (tf.numpy_function).
    from tfdp.data import sampling  # pylint: disable=g-import-not-at-top
    from tfdp.data import tfds_source  # pylint: disable=g-import-not-at-top

    def python_input(*args, **kwargs):
        raise AssertionError("the pure-TF input called the Python input path")

    monkeypatch.setattr(sampling, "poisson_indices", python_input)
    monkeypatch.setattr(tfds_source.TFDSSource, "_fetch", python_input)
    files, params, workdir = _runbook_command()
    assert files == ["imagenet.gin"] and workdir.startswith("gs://BUCKET/")
    assert "tfdp.data.open_split.source='jpeg_folder'" in params
    assert "tfdp.RuntimeConfig.strategy='tpu'" in params
    bucket = f"ram://runbook-{uuid.uuid4().hex}"
    data_dir = synthetic_imagenet.write_jpeg_folder(f"{bucket}/imagenet", **SYNTHETIC_IMAGENET)
    # What stands in for what: ram:// for gs://, no TPU (the default strategy), smoke sizes.
    # (make_strategy.tpu goes with the TPU strategy: under the default one it is refused.)
    local = [p.replace("gs://BUCKET", bucket) for p in params
             if "strategy='tpu'" not in p and "make_strategy.tpu" not in p
             and "ACCUMULATION_STEPS" not in p]
    assert f"DATA_DIR='{data_dir}'" in local
    url = workdir.replace("gs://BUCKET", bucket)
    report = run_smoke(url, files, [
        *local, *SMOKE_PARAMS, "tfdp.DataConfig.train_split = 'train'",
        f"NUM_EXAMPLES = {SYNTHETIC_IMAGENET['num_train']}"], mock=False)
    assert report["steps"] == 2 and report["truncation"]["static_batch_size"] > 0
    record = workdir_lib.finished(url)
    assert record is not None and record["epsilon"] == report["epsilon"]
    assert json.loads(tf.io.gfile.GFile(f"{url}/privacy_report.json").read())["steps"] == 2
    assert not tf.io.gfile.exists(f"{url}/{workdir_lib.LOCK_FILE}")
    config = tf.io.gfile.GFile(f"{url}/operative_config.gin").read()
    assert re.search(r"open_split\.source = 'jpeg_folder'", config)


def test_the_pod_runbook_command_parses_with_every_binding_read(tmp_path):
    # The fast check of the end-to-end run above: the documented command's configs and
    # bindings parse, none unused or unread, with the TPU strategy the runbook names.
    import gin  # pylint: disable=g-import-not-at-top

    from tfdp import main  # pylint: disable=g-import-not-at-top

    files, params, workdir = _runbook_command()
    assert workdir.startswith("gs://") and any("strategy" in p and "tpu" in p for p in params)
    gin.clear_config()
    try:
        main.parse_config(files, params)
        assert gin.query_parameter("tfdp.data.open_split.source") == "jpeg_folder"
    finally:
        gin.clear_config()
