"""tfdp: differentially private image classification for TensorFlow 2 / Keras 3.

`tfdp.make_private(model, data, config)` trains your Keras classifier with
DP-SGD, `config` a `tfdp.PrivateTrainingConfig` of the trainer's own
`tfdp.PrivacyConfig` and `tfdp.OptimizationConfig`;
`python -m tfdp.main --gin_file=NAME.gin` runs the shipped configs.
The privacy facts of a run live in `tfdp.accounting.DPMechanism`.

`make_private`, `PrivateTraining` and the config classes are imported on first use, so that
`import tfdp.accounting` (and `tools/privacy.py`) never imports TensorFlow.

Importing tfdp sets `TF_ENABLE_ONEDNN_OPTS=1` (unless the user set it): TensorFlow reads it only
at its own import, and leaves oneDNN off on AVX2-only CPUs, where the DP step runs at half speed.
"""

from tfdp import process_settings as _process_settings  # first: the settings as imported
from tfdp import host as _host

_host.enable_onednn()

_FROM_PRIVATE_TRAINING = ("PrivateTraining", "make_private", "num_steps_for_epochs")
_FROM_CONFIGS = ("PrivateTrainingConfig", "PrivacyConfig", "OptimizationConfig")
__all__ = [*_FROM_PRIVATE_TRAINING, *_FROM_CONFIGS]


def __getattr__(name):
    if name in _FROM_PRIVATE_TRAINING:
        from tfdp import private_training  # pylint: disable=g-import-not-at-top

        return getattr(private_training, name)
    if name in _FROM_CONFIGS:
        from tfdp import configs  # pylint: disable=g-import-not-at-top

        return getattr(configs, name)
    raise AttributeError(f"module 'tfdp' has no attribute {name!r}")
