"""The trainer on the pure-TF input (`tfdp.data.open_split.source = 'in_memory'`).

The same mechanism as the ArrayRecord path (the privacy report's sampling
section is the same), with batches drawn in the graph: the secret seed is
written nowhere but the checkpoint, and a resumed run continues the very
stream an uninterrupted run draws.
"""

import glob
import os

import numpy as np
import pytest
import tensorflow as tf

IN_MEMORY = "tfdp.data.open_split.source = 'in_memory'"
FIXED_NOISE = ["tfdp.PrivacyConfig.noise_seed = 11",
               "tfdp.RuntimeConfig.deterministic = True",
               "TARGET_EPSILON = None", "NOISE_MULTIPLIER = 1.0"]


def _reader(workdir):
    return tf.train.load_checkpoint(tf.train.latest_checkpoint(str(workdir / "checkpoints")))


def _floats(workdir):
    reader = _reader(workdir)
    dtypes = reader.get_variable_to_dtype_map()
    return {name: reader.get_tensor(name) for name in dtypes
            if dtypes[name].is_floating and "ledger" not in name}


@pytest.mark.slow  # end to end (tests/run_slow.sh); the default suite has the in-graph
# sampler's resume (tests/data/graph_sampling_test.py)
def test_a_resumed_pure_tf_run_continues_the_secret_stream_and_keeps_the_seed_secret(
        tmp_path, run_smoke):
    # Run A: 2 steps with a secret sampling seed, then the same command with 4 steps (resume).
    resumed = tmp_path / "resumed"
    first = run_smoke(resumed, ["fashion_mnist.gin"], [IN_MEMORY, *FIXED_NOISE])
    run_smoke(resumed, ["fashion_mnist.gin"], [IN_MEMORY, *FIXED_NOISE, "NUM_STEPS = 4"])
    seed = int(_reader(resumed).get_tensor("ledger/sampling_seed/.ATTRIBUTES/VARIABLE_VALUE"))
    assert first["seeds"]["sampling_seed"].startswith("secret")
    # Run B: 4 steps at once, with A's seed fixed: the same batches, so the same weights.
    straight = tmp_path / "straight"
    run_smoke(straight, ["fashion_mnist.gin"], [
        IN_MEMORY, *FIXED_NOISE, "NUM_STEPS = 4",
        f"tfdp.PrivacyConfig.sampling_seed = {seed}"])
    mine, reference = _floats(resumed), _floats(straight)
    assert mine.keys() == reference.keys() and len(mine) > 3
    for name in mine:
        np.testing.assert_array_equal(mine[name], reference[name], err_msg=name)
    # The seed is written nowhere but the checkpoint (as text or as 8 bytes).
    encodings = (str(seed).encode(), seed.to_bytes(8, "little"), seed.to_bytes(8, "big"))
    for path in glob.glob(str(resumed / "**" / "*"), recursive=True):
        if os.path.isfile(path) and "/checkpoints/" not in path:
            content = open(path, "rb").read()
            assert not any(e in content for e in encodings), path


@pytest.mark.slow
def test_the_report_s_sampling_section_is_the_array_record_path_s(tmp_path, run_smoke):
    graph = run_smoke(tmp_path / "graph", ["fashion_mnist.gin"], [IN_MEMORY])
    numpy = run_smoke(tmp_path / "numpy", ["fashion_mnist.gin"], [])
    assert graph["sampling"] == numpy["sampling"]
    assert graph["sampling"]["scheme"] == "poisson"
    assert graph["epsilon"] == numpy["epsilon"] > 0
