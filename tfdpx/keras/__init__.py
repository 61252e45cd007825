"""Keras integration: DP optimizers and callbacks."""

from tfdpx.keras.callbacks import EpsilonBudget
from tfdpx.keras.callbacks import PrivacyCallback
from tfdpx.keras.dp_optimizer import DPOptimizerMixin
from tfdpx.keras.stack import optimizers as _optimizers
from tfdpx.keras.models import DPFunctional
from tfdpx.keras.models import DPModel
from tfdpx.keras.models import DPSequential
from tfdpx.keras.models import make_private
from tfdpx.keras.report import describe
from tfdpx.keras.validation import check_private_compatible

DPAdagrad = _optimizers.DPAdagrad
DPAdam = _optimizers.DPAdam
DPSGD = _optimizers.DPSGD
