"""caffepy: Caffe's command line and pycaffe API on a compiled CPU engine.

    import caffepy as caffe
    caffe.set_mode_cpu()
    net = caffe.Net("deploy.prototxt", "weights.caffemodel", caffe.TEST)
    out = net.forward(data=images)
"""
# first: the OpenMP and OpenBLAS defaults (short spins) before numpy, scipy or a kernel
# loads a runtime that reads them (see caffepy.threads)
from . import threads  # noqa: F401
# then: shares the cores among MPI ranks before any kernel loads OpenMP (see caffepy.parallel)
from . import parallel  # noqa: F401

from . import proto  # noqa: F401  (caffe.proto.caffe_pb2, as in pycaffe)
from .net import TEST, TRAIN, Net
from .layer import LAYERS, Layer
from . import io, rng  # noqa: F401
from .solvers import (AdaDeltaSolver, AdaGradSolver, AdamSolver, NesterovSolver,  # noqa: F401
                      RMSPropSolver, SGDSolver, get_solver)
# pycaffe's `from caffe import layers as L, params as P`: `layers` here is the NetSpec
# layer factory (it forwards lower-case names to the caffepy.layers subpackage)
from .net_spec import NetSpec, layers, params, to_proto  # noqa: F401,E402
from .classifier import Classifier  # noqa: E402
from .detector import Detector  # noqa: E402
from . import coord_map, draw  # noqa: F401,E402  (pycaffe's caffe.coord_map, caffe.draw)
from . import tensorboard  # noqa: F401,E402  (caffe.tensorboard.attach(solver, logdir))

__version__ = "0.1.0"


def set_mode_cpu():
    """caffepy always runs on the CPU."""


def set_mode_gpu():
    """Accepted for pycaffe scripts; caffepy runs on the CPU."""
    from . import log
    log.info("caffepy runs on the CPU; set_mode_gpu() has no effect")


def set_device(device_id):
    """Accepted for pycaffe scripts; there is one CPU device."""


def set_precision(name):
    """Run the nets built from now on in float32 ('f32', the default) or bf16 ('bf16':
    Convolution and InnerProduct; needs AVX512_BF16 or AMX-BF16, else CAFFEPY_BF16=emulate, see
    caffepy/precision.py)."""
    from . import precision
    precision.set_precision(name, where=f"set_precision('{name}')")


def get_precision():
    from . import precision
    return precision.current()


def set_random_seed(seed):
    rng.seed(seed)


def has_nccl():
    """False: caffepy is a CPU build (multi-rank training goes through MPI)."""
    return False


def layer_type_list():
    return sorted(LAYERS)
