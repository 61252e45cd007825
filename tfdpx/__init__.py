"""tfdpx: differentially private Keras training with honest accounting."""

from tfdpx import autograph

autograph.leave_unconverted()

from tfdpx import accounting  # pylint: disable=wrong-import-position
from tfdpx import band_selection  # pylint: disable=wrong-import-position
from tfdpx import correlation  # pylint: disable=wrong-import-position
from tfdpx import keras  # pylint: disable=wrong-import-position
from tfdpx import privatizers  # pylint: disable=wrong-import-position
from tfdpx.core import Privatizer  # pylint: disable=wrong-import-position
from tfdpx.core import deserialize  # pylint: disable=wrong-import-position
from tfdpx.core import serialize  # pylint: disable=wrong-import-position

__version__ = '0.1.0'
