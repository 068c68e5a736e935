"""Trains every shipped gin config 2 steps on mock data and checks TensorFlow's log.

`tf.vectorized_map` logs "Conv2DBackpropFilter uses a while_loop. Fix that!" when a
conv kernel's per-example gradients fall back to a sequential loop of batch-1 ops;
with ghost clipping no shipped config should. The shrinking overrides are those of
`tests/configs_test.py` (small batch, images, views and WRN/NF-ResNet widths; the
code path is the config's own). Too long for CI (every config, including every WRN
row); `tests/training/ghost_clipping_test.py` checks two of them.

    python benchmarks/conv_loop_check.py
"""

import logging
import sys
import tempfile

import gin

from tfdp import data
from tfdp import experiment
from tfdp import main

MOCK_EXAMPLES = 32
OPTIONAL_MACROS = {"AUGMULT": 2, "ACCUMULATION_STEPS": 2, "IMAGE_SIZE": 32}


class _Log(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _macro(name):
    try:
        return gin.query_parameter(f"%{name}")
    except ValueError:
        return None


def smoke_params(config):
    gin.clear_config()
    main.parse_config([config], [])
    present = {k: v for k, v in OPTIONAL_MACROS.items() if _macro(k) is not None}
    gin.clear_config()
    params = [f"NUM_EXAMPLES = {MOCK_EXAMPLES}", "BATCH_SIZE = 4"]
    params += [f"{k} = {v}" for k, v in present.items()]
    if config.startswith("cifar10_wrn"):
        params += ["DEPTH = 10", "tfdp.models.build_wide_resnet.width = 1"]
    if config.startswith("imagenet"):
        params.append("tfdp.models.build_nf_resnet.width = 1")
    return params


def main_():
    configs = sorted(c for c in main.shipped_gin_configs()
                     if not c.startswith("_") and c != "smoke.gin")
    failures = []
    for config in configs:
        log = _Log()
        logging.getLogger("tensorflow").addHandler(log)
        try:
            main.parse_config([config, "smoke.gin"], smoke_params(config))
            with tempfile.TemporaryDirectory() as workdir, data.mock_data(
                    num_examples=MOCK_EXAMPLES):
                experiment.train_and_evaluate(workdir=workdir)
        finally:
            gin.clear_config()
            logging.getLogger("tensorflow").removeHandler(log)
        loops = sum("uses a while_loop" in m for m in log.messages)
        print(f"{config}: {loops} sequential-loop warnings", flush=True)
        if loops:
            failures.append(config)
    print("FAILED: " + ", ".join(failures) if failures else f"all {len(configs)} configs clean")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main_())
