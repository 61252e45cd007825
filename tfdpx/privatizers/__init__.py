"""The noise steps ("privatizers") of tfdpx."""

from tfdpx.privatizers.gaussian import Gaussian
from tfdpx.privatizers.gaussian import gaussian
