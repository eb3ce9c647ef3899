"""The nets a solver trains and tests: Caffe's Solver::InitTrainNet / InitTestNets.

Which NetParameter each net comes from (net, net_param, train_net,
train_net_param, test_net, test_net_param), the NetState it is built in
(phase, then the net's own state, then train_state / test_state[i] and the
command line's --level / --stage), the Net objects themselves (in the run
context the solver gives each), and test layers sharing the train net's
weights (ShareTrainedLayersWith).
"""
import collections
import os

from .. import log
from ..context import SINGLE
from ..engine import set_net_engine
from ..errors import PrototxtError, ShapeError
from ..net import Net
from ..proto import caffe_pb2
from ..prototxt import copy_message
from ..upgrade import read_net, upgrade_net


class SolverNet(collections.namedtuple("SolverNet", "param state")):
    """A net the solver builds: its NetParameter (with `state` already set to
    the merged NetState, ready for filter_net) and that NetState.  `origin`
    says where it came from, as Caffe logs it ("net file: x.prototxt")."""

    def __new__(cls, param, state, origin=""):
        self = super().__new__(cls, param, state)
        self.origin = origin
        return self


def _read_solver_net(path, field, source):
    if not os.path.exists(path):
        raise PrototxtError(f"{source}: {field}: cannot open '{path}' (paths are relative to the "
                            f"current directory, {os.getcwd()})")
    return read_net(path)


def solver_train_net_param(solver, source="<solver>", level=None, stages=()):
    """The train net of a solver (Solver::InitTrainNet): exactly one of
    train_net_param, train_net, net_param, net; NetState = phase TRAIN, then
    the net's own state, then the solver's train_state.  `level` / `stages`
    are the command line's --level / --stage, applied to train_state as
    caffe train does."""
    given = [f for f in ("net", "net_param", "train_net", "train_net_param") if solver.HasField(f)]
    if not given:
        raise PrototxtError(f"{source}: solver specifies no net (set 'net' or 'train_net')")
    if len(given) > 1:
        raise PrototxtError(f"{source}: solver specifies more than one train net ({', '.join(given)}); "
                            f"keep one")
    field = given[0]
    if field == "train_net_param":
        param, origin = upgrade_net(solver.train_net_param, f"{source}: train_net_param")[0], "train_net_param"
    elif field == "train_net":
        param, origin = _read_solver_net(solver.train_net, field, source), f"train_net file: {solver.train_net}"
    elif field == "net_param":
        param, origin = upgrade_net(solver.net_param, f"{source}: net_param")[0], "net_param"
    else:
        param, origin = _read_solver_net(solver.net, field, source), f"net file: {solver.net}"
    train_state = caffe_pb2.NetState()
    train_state.CopyFrom(solver.train_state)
    if level is not None:
        train_state.level = int(level)
    train_state.stage.extend(stages)
    state = caffe_pb2.NetState(phase=caffe_pb2.TRAIN)
    state.MergeFrom(param.state)
    state.MergeFrom(train_state)
    param.state.CopyFrom(state)
    set_net_engine(param, solver.engine, f"{source}: engine")
    return SolverNet(param, state, origin)


def solver_test_net_params(solver, source="<solver>"):
    """The test nets of a solver (Solver::InitTestNets), in Caffe's order:
    test_net_param, test_net, then as many copies of net_param / net as
    test_iter entries remain.  NetState = phase TEST, then the net's own
    state, then test_state[i]."""
    generic = [f for f in ("net_param", "net") if solver.HasField(f)]
    if len(generic) > 1:
        raise PrototxtError(f"{source}: net, net_param: both given; a solver may name its generic net once")
    specific = len(solver.test_net_param) + len(solver.test_net)
    iters = len(solver.test_iter)
    if (generic and iters < specific) or (not generic and iters != specific):
        raise PrototxtError(f"{source}: test_iter: one is needed per test net ({specific} test nets"
                            f"{' plus the generic net' if generic else ''}), got {iters}")
    count = specific + (iters - specific if generic else 0)
    if len(solver.test_state) and len(solver.test_state) != count:
        raise PrototxtError(f"{source}: test_state: must be unspecified or given once per test net "
                            f"({count}), got {len(solver.test_state)}")
    if count and solver.test_interval <= 0:
        raise PrototxtError(f"{source}: test_interval: must be > 0 when there are test nets, "
                            f"got {solver.test_interval}")
    nets = []
    for i, inline in enumerate(solver.test_net_param):
        nets.append((upgrade_net(inline, f"{source}: test_net_param[{i}]")[0], "test_net_param"))
    for path in solver.test_net:
        nets.append((_read_solver_net(path, "test_net", source), f"test_net file: {path}"))
    remaining = iters - len(nets)
    if generic == ["net_param"]:
        inline = upgrade_net(solver.net_param, f"{source}: net_param")[0]
        nets.extend((copy_message(inline), "net_param") for _ in range(remaining))
    elif generic == ["net"]:
        if remaining > 0:
            param = _read_solver_net(solver.net, "net", source)
            nets.extend((copy_message(param), f"net file: {solver.net}") for _ in range(remaining))
    out = []
    for i, (param, origin) in enumerate(nets):
        state = caffe_pb2.NetState(phase=caffe_pb2.TEST)
        state.MergeFrom(param.state)
        if len(solver.test_state):
            state.MergeFrom(solver.test_state[i])
        param.state.CopyFrom(state)
        set_net_engine(param, solver.engine, f"{source}: engine")
        out.append(SolverNet(param, state, origin))
    return out


# -- the Net objects ------------------------------------------------------------
def init_train_net(param, source, level=None, stages=(), context=SINGLE):
    """InitTrainNet: the train Net, with the solver's `weights` loaded (fine-tuning)."""
    train = solver_train_net_param(param, source, level=level, stages=stages)
    log.info(f"Creating training net from {train.origin}" if "file" in train.origin
             else f"Creating training net specified in {train.origin}.")
    net = build_net(train, source, context)
    for entry in param.weights:
        for path in entry.split(","):
            if path:
                log.info(f"Finetuning from {path}")
                net.copy_from(path)
    return net


def init_test_nets(param, source, train_net, context=SINGLE, keep_blobs=True):
    """InitTestNets: the test Nets, each seeing the train net's weights; keep_blobs False: their
    blobs between inputs and outputs share memory (caffepy/net_memory.py: `caffepy train`
    reads their outputs only, while pycaffe code may read `solver.test_nets[0].blobs[...]`)."""
    nets = []
    for i, test in enumerate(solver_test_net_params(param, source)):
        log.info(f"Creating test net (#{i}) specified by {test.origin}")
        net = build_net(test, source, context, keep_blobs=keep_blobs)
        share_trained_layers(train_net, net)
        nets.append(net)
    return nets


def build_net(solver_net, solver_source, context=SINGLE, keep_blobs=True):
    """The Net of a SolverNet, in run context `context`; its errors name the net file, or the
    solver file for an inline net."""
    s = solver_net.state
    origin = solver_net.origin
    where = origin.split(": ", 1)[1] if "file: " in origin else f"{solver_source}: {origin}"
    return Net(solver_net.param, phase=s.phase, level=s.level, stages=list(s.stage), source=where,
               context=context, keep_blobs=keep_blobs)


def local_batch(net):
    """The batch of a net's data: the first axis of the first top of its first layer without
    bottoms (a data or Input layer), or None."""
    for bottom, top in zip(net.bottom_vecs, net.top_vecs):
        if not bottom and top and top[0].num_axes:
            return top[0].shape[0]
    return None


def share_trained_layers(train_net, test_net):
    """Caffe's ShareTrainedLayersWith: a test layer named like a train layer sees its weights."""
    for name, source in zip(train_net._layer_names, train_net.layers):
        layer = test_net.first_layer(name)
        if layer is None or not layer.blobs:
            continue
        if len(source.blobs) != len(layer.blobs):
            raise ShapeError(f"{test_net.source}: layer '{name}' ({layer.type}): blobs: the test net has "
                             f"{len(layer.blobs)} parameter blobs, the train net {len(source.blobs)}")
        for i, (mine, theirs) in enumerate(zip(layer.blobs, source.blobs)):
            if mine.shape != theirs.shape:
                raise ShapeError(f"{test_net.source}: layer '{name}' ({layer.type}): blobs[{i}]: cannot "
                                 f"share the train net's weights of shape {theirs.shape}, got {mine.shape}")
            mine.share_data(theirs)
