"""Privacy accounting for DP-SGD: the run's mechanism, epsilon, calibration, TAN, ledger.

`DPMechanism` holds every privacy fact of a run and builds its one DP event;
the trainer, the checkpoint's privacy record (`checkpoint_record`), the study
ledger (`ledger`) and the report all read it.

Pure Python over `dp_accounting`; nothing in this package imports TensorFlow,
so epsilon can be computed (e.g. by `tools/privacy.py`) without it.
"""

from tfdp.accounting import calibration
from tfdp.accounting import checkpoint_record
from tfdp.accounting import ledger
from tfdp.accounting import mechanism
from tfdp.accounting import tan
from tfdp.accounting.accountant import ACCOUNTANTS
from tfdp.accounting.accountant import compute_epsilon
from tfdp.accounting.accountant import data_normalization_dp_event
from tfdp.accounting.accountant import dp_sgd_event
from tfdp.accounting.accountant import epsilon_of_event
from tfdp.accounting.accountant import gaussian_composition_event
from tfdp.accounting.accountant import PLD_VALUE_DISCRETIZATION_INTERVAL
from tfdp.accounting.accountant import sampling_prob_from
from tfdp.accounting.accountant import validate_privacy_params
from tfdp.accounting.calibration import calibrate_batch_size
from tfdp.accounting.calibration import calibrate_noise_multiplier
from tfdp.accounting.calibration import calibrate_num_steps
from tfdp.accounting.calibration import solve_noise_multiplier
from tfdp.accounting.calibration import solve_num_steps
from tfdp.accounting.ledger import append_run
from tfdp.accounting.ledger import read_runs
from tfdp.accounting.ledger import run_event
from tfdp.accounting.ledger import study_epsilon
from tfdp.accounting.ledger import study_event
from tfdp.accounting.mechanism import ADD_OR_REMOVE
from tfdp.accounting.mechanism import DataNormalization
from tfdp.accounting.mechanism import DPMechanism
from tfdp.accounting.mechanism import epsilon_upper_bound
from tfdp.accounting.mechanism import plan_mechanism
from tfdp.accounting.mechanism import REPLACE_ONE
from tfdp.accounting.mechanism import SAMPLING_SCHEMES
from tfdp.accounting.mechanism import Truncation
from tfdp.accounting.tan import simulate
from tfdp.accounting.tan import tan_epsilon
from tfdp.accounting.tan import tan_eta
from tfdp.accounting.tan import total_amount_of_noise

__all__ = [
    "ACCOUNTANTS",
    "ADD_OR_REMOVE",
    "DataNormalization",
    "DPMechanism",
    "REPLACE_ONE",
    "SAMPLING_SCHEMES",
    "Truncation",
    "PLD_VALUE_DISCRETIZATION_INTERVAL",
    "append_run",
    "calibrate_batch_size",
    "calibrate_noise_multiplier",
    "calibrate_num_steps",
    "calibration",
    "checkpoint_record",
    "compute_epsilon",
    "dp_sgd_event",
    "epsilon_of_event",
    "epsilon_upper_bound",
    "gaussian_composition_event",
    "ledger",
    "mechanism",
    "plan_mechanism",
    "read_runs",
    "run_event",
    "sampling_prob_from",
    "simulate",
    "solve_noise_multiplier",
    "solve_num_steps",
    "study_epsilon",
    "study_event",
    "tan",
    "tan_epsilon",
    "tan_eta",
    "total_amount_of_noise",
    "validate_privacy_params",
]
