"""tfdpx: differentially private Keras training with honest accounting."""

from tfdpx import accounting
from tfdpx import keras
from tfdpx import privatizers
from tfdpx.core import Privatizer
from tfdpx.core import deserialize
from tfdpx.core import serialize

__version__ = '0.1.0'
