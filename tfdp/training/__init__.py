"""Training: DPModel (the DP-SGD train_step), EMA, callbacks, tf.distribute strategies.

The one place where the data, the model, the DP gradient and the accounting
meet (see `tfdp.training.DPModel`).
"""

from tfdp.training.distribute import ChunkedInput
from tfdp.training.distribute import distribute_chunks
from tfdp.training.distribute import make_strategy
from tfdp.training.dp_model import DPModel
from tfdp.training.ema import ema_decay
from tfdp.training.non_private_model import NonPrivateModel
from tfdp.training.optimizers import build_optimizer

__all__ = ["ChunkedInput", "DPModel", "NonPrivateModel", "build_optimizer", "distribute_chunks",
           "ema_decay", "make_strategy"]
