"""Fixtures shared by the end-to-end tests."""

import gin
import pytest
import tensorflow_datasets as tfds

from tfdp import experiment
from tfdp import main

MOCK_EXAMPLES = 64


def _run_smoke(workdir, gin_files, extra_params=()):
    """Parses `gin_files`, then smoke.gin (2 steps), and trains on TFDS mock data.

    N = MOCK_EXAMPLES and B = 16 unless `extra_params` override them. Returns the
    privacy report of `tfdp.experiment.train_and_evaluate`.
    """
    gin.clear_config()
    params = [f"NUM_EXAMPLES = {MOCK_EXAMPLES}", "BATCH_SIZE = 16", *extra_params]
    main.parse_config([*gin_files, "smoke.gin"], params)
    try:
        with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES):
            return experiment.train_and_evaluate(workdir=str(workdir))
    finally:
        gin.clear_config()


@pytest.fixture
def run_smoke():
    """`run_smoke(workdir, gin_files, extra_params=())`: a 2-step run on mock data."""
    return _run_smoke


@pytest.fixture(scope="module")
def run_smoke_module():
    """`run_smoke` for module-scoped fixtures (one run shared by several tests)."""
    return _run_smoke
