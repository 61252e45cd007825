"""The noise steps ("privatizers") of tfdpx."""

from tfdpx.privatizers.adaptive import AdaptiveClipping
from tfdpx.privatizers.adaptive import adaptive_clipping
from tfdpx.privatizers.correlated import Correlated
from tfdpx.privatizers.correlated import correlated
from tfdpx.privatizers.d2p2 import D2P2
from tfdpx.privatizers.d2p2 import d2p2
from tfdpx.privatizers.dpdr import DPDR
from tfdpx.privatizers.dpdr import dpdr
from tfdpx.privatizers.gaussian import Gaussian
from tfdpx.privatizers.gaussian import gaussian
from tfdpx.privatizers.geodp import GeoDP
from tfdpx.privatizers.geodp import geodp
from tfdpx.privatizers.gep import GEP
from tfdpx.privatizers.gep import gep
from tfdpx.privatizers.per_layer import PerLayerClipping
from tfdpx.privatizers.per_layer import layer_groups
from tfdpx.privatizers.per_layer import per_layer_clipping
from tfdpx.privatizers.sparse_embeddings import SparseEmbeddings
from tfdpx.privatizers.sparse_embeddings import sparse_embeddings
from tfdpx.privatizers.sparsification import Sparsified
from tfdpx.privatizers.sparsification import sparsified
