"""LSTM, RNN and LSTMUnit: NumPy loops written for these tests, torch's LSTM / RNN where the
arithmetic is the same, Caffe's sequence behaviour (state carried across forwards, cont
markers, exposed state), Caffe's parameter layout, and a small LRCN-style net that learns."""
import numpy as np
import pytest
from google.protobuf import text_format

from caffepy.errors import LayerError, ShapeError
from caffepy.proto import caffe_pb2
from caffepy.solvers import Solver
from layer_cases import Case, case_tests, randn, setup_layer

H = 3
FILL = 'weight_filler { type: "gaussian" std: 0.4 } bias_filler { type: "gaussian" std: 0.3 }'
REC = f"recurrent_param {{ num_output: {H} {FILL} }}"
EXPOSED = f"recurrent_param {{ num_output: {H} expose_hidden: true {FILL} }}"
CONT = np.array([[0, 0], [1, 1], [1, 0], [1, 1]], np.float32)      # stream 1 restarts at t = 2
ONES = np.ones((3, 2), np.float32)


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def lstm_ref(x, cont, *rest, layer):
    """Per-timestep LSTM in float64: rest is (x_static,) and / or (h0, c0)."""
    static = len(layer.blobs) == 4
    w = [b.data.astype(np.float64) for b in layer.blobs]
    w_xc, b_c, w_hc = w[0], w[1], w[-1]
    t_len, n = cont.shape
    h = rest[-2][0] if len(rest) >= 2 else np.zeros((n, H))
    c = rest[-1][0] if len(rest) >= 2 else np.zeros((n, H))
    outs = []
    for t in range(t_len):
        keep = cont[t][:, None]
        gates = x[t].reshape(n, -1) @ w_xc.T + b_c + (keep * h) @ w_hc.T
        if static:
            gates += rest[0].reshape(n, -1) @ w[2].T
        i, f, o, g = sigmoid(gates[:, :H]), sigmoid(gates[:, H:2 * H]), sigmoid(gates[:, 2 * H:3 * H]), \
            np.tanh(gates[:, 3 * H:])
        c = keep * f * c + i * g
        h = o * np.tanh(c)
        outs.append(h)
    return [np.stack(outs)] + ([h[None], c[None]] if len(rest) >= 2 else [])


def rnn_ref(x, cont, *rest, layer):
    """Per-timestep RNN in float64: rest is (x_static,) and / or (h0,)."""
    static = len(layer.blobs) == 6
    w = [b.data.astype(np.float64) for b in layer.blobs]
    w_xh, b_h = w[0], w[1]
    w_hh, w_ho, b_o = w[-3:]
    t_len, n = cont.shape
    exposed = len(rest) == 1 + static
    h = rest[-1][0] if exposed else np.zeros((n, H))
    outs = []
    for t in range(t_len):
        a = x[t].reshape(n, -1) @ w_xh.T + b_h + (cont[t][:, None] * h) @ w_hh.T
        if static:
            a += rest[0].reshape(n, -1) @ w[2].T
        h = np.tanh(a)
        outs.append(np.tanh(h @ w_ho.T + b_o))
    return [np.stack(outs)] + ([h[None]] if exposed else [])


def unit_ref(c_prev, gates, cont):
    g = gates[0]
    i, f, o, gg = sigmoid(g[:, :H]), sigmoid(g[:, H:2 * H]), sigmoid(g[:, 2 * H:3 * H]), np.tanh(g[:, 3 * H:])
    c = cont[0][:, None] * f * c_prev[0] + i * gg
    return [c[None], (o * np.tanh(c))[None]]


X = randn(4, 2, 2, 2)                       # T=4, N=2, 2x2 values per item
STATIC = randn(2, 5, seed=3, scale=0.5)
H0, C0 = randn(1, 2, H, seed=4), randn(1, 2, H, seed=5)

CASES = [
    # cont is 0 at t = 0: the state carried in from an earlier forward does not matter
    Case("LSTM", REC, [X, CONT], expected=lstm_ref, check_bottom=[0], id="LSTM"),
    Case("LSTM", REC, [X, CONT, STATIC], expected=lstm_ref, check_bottom=[0, 2], id="LSTM:static"),
    Case("LSTM", EXPOSED, [X[:3], ONES, H0, C0], n_top=3, expected=lstm_ref, check_bottom=[0, 2, 3],
         id="LSTM:exposed"),
    Case("LSTM", EXPOSED, [X[:3], ONES, STATIC, H0, C0], n_top=3, expected=lstm_ref,
         check_bottom=[0, 2, 3, 4], id="LSTM:static+exposed"),
    Case("RNN", REC, [X, CONT], expected=rnn_ref, check_bottom=[0], id="RNN"),
    Case("RNN", REC, [X, CONT, STATIC], expected=rnn_ref, check_bottom=[0, 2], id="RNN:static"),
    Case("RNN", EXPOSED, [X[:3], ONES, STATIC, H0], n_top=2, expected=rnn_ref, check_bottom=[0, 2, 3],
         id="RNN:static+exposed"),
    Case("LSTMUnit", "", [randn(1, 3, H), randn(1, 3, 4 * H, seed=2), np.array([[1, 0, 1]], np.float32)],
         n_top=2, expected=unit_ref, check_bottom=[0, 1], id="LSTMUnit"),
    Case("LSTMUnit", "", [randn(1, 2, H), randn(1, 2, 4 * H, seed=2), np.zeros((1, 2), np.float32)],
         n_top=2, expected=unit_ref, check_bottom=[0, 1], id="LSTMUnit:cont 0"),
]

test_forward, test_gradient = case_tests(CASES)


# -- Caffe's parameter layout ------------------------------------------------------------------
@pytest.mark.parametrize("type_,shapes", [
    ("LSTM", [(4 * H, 4), (4 * H,), (4 * H, 5), (4 * H, H)]),                 # W_xc b_c W_xc_static W_hc
    ("RNN", [(H, 4), (H,), (H, 5), (H, H), (H, H), (H,)]),                    # W_xh b_h W_xh_static W_hh W_ho b_o
])
def test_parameter_blobs_in_caffes_order_and_shapes(type_, shapes):
    layer, _, _ = setup_layer(type_, REC, [X, CONT, STATIC])
    assert [b.shape for b in layer.blobs] == shapes
    layer, _, _ = setup_layer(type_, REC, [X, CONT])
    assert [b.shape for b in layer.blobs] == shapes[:2] + shapes[3:]


def test_lstm_blobs_load_from_a_caffemodel_layer(tmp_path):
    """Blobs given with the layer (as a .caffemodel's) are used in Caffe's order."""
    layer, bottom, top = setup_layer("LSTM", REC, [X, CONT])
    layer.forward(bottom, top)
    lp = caffe_pb2.LayerParameter()
    text_format.Parse(REC, lp)
    lp.name, lp.type = "lstm", "LSTM"
    lp.bottom.extend(["x", "cont"])
    lp.top.append("h")
    from caffepy.blobproto import array_to_blobproto
    lp.blobs.extend(array_to_blobproto(b.data) for b in layer.blobs)
    net = caffe_pb2.NetParameter()
    text_format.Parse('layer { name: "in" type: "Input" top: "x" top: "cont" '
                      'input_param { shape { dim: 4 dim: 2 dim: 2 dim: 2 } shape { dim: 4 dim: 2 } } }', net)
    net.layer.append(lp)
    import caffepy
    n = caffepy.Net(net, phase=caffe_pb2.TEST)
    out = n.forward(x=X, cont=CONT)["h"]
    np.testing.assert_allclose(out, top[0].data, rtol=1e-6)


# -- against torch (the same cell arithmetic; its gate rows are i, f, g, o) ----------------------
def test_lstm_matches_torch():
    torch = pytest.importorskip("torch")
    x = randn(5, 3, 4, seed=7)
    cont = np.ones((5, 3), np.float32)
    cont[0] = 0
    layer, bottom, top = setup_layer("LSTM", f"recurrent_param {{ num_output: 6 {FILL} }}", [x, cont])
    layer.forward(bottom, top)
    h = 6
    order = np.r_[0:2 * h, 3 * h:4 * h, 2 * h:3 * h]
    ref = torch.nn.LSTM(4, h)
    with torch.no_grad():
        ref.weight_ih_l0.copy_(torch.from_numpy(layer.blobs[0].data[order]))
        ref.bias_ih_l0.copy_(torch.from_numpy(layer.blobs[1].data[order]))
        ref.weight_hh_l0.copy_(torch.from_numpy(layer.blobs[2].data[order]))
        ref.bias_hh_l0.zero_()
        want, (h_n, c_n) = ref(torch.from_numpy(x))
    np.testing.assert_allclose(top[0].data, want.numpy(), rtol=1e-5, atol=1e-6)


def test_rnn_matches_torch():
    torch = pytest.importorskip("torch")
    x = randn(5, 3, 4, seed=7)
    cont = np.ones((5, 3), np.float32)
    cont[0] = 0
    layer, bottom, top = setup_layer("RNN", f"recurrent_param {{ num_output: 6 {FILL} }}", [x, cont])
    layer.forward(bottom, top)
    w_xh, b_h, w_hh, w_ho, b_o = (torch.from_numpy(b.data) for b in layer.blobs)
    ref = torch.nn.RNN(4, 6)
    with torch.no_grad():
        ref.weight_ih_l0.copy_(w_xh)
        ref.bias_ih_l0.copy_(b_h)
        ref.weight_hh_l0.copy_(w_hh)
        ref.bias_hh_l0.zero_()
        hs, _ = ref(torch.from_numpy(x))
        want = torch.tanh(hs @ w_ho.T + b_o)
    np.testing.assert_allclose(top[0].data, want.numpy(), rtol=1e-5, atol=1e-6)


# -- sequences ---------------------------------------------------------------------------------
@pytest.mark.parametrize("type_", ["LSTM", "RNN"])
def test_state_carries_from_one_forward_to_the_next(type_):
    """Caffe's TestForward: a sequence in one forward equals it one timestep per forward, and
    cont 0 at every step forgets the state (only the first step then agrees)."""
    x = randn(3, 2, 3, seed=11)
    cont = np.array([[0, 0], [1, 1], [1, 1]], np.float32)
    whole, b, t = setup_layer(type_, REC, [x, cont])
    whole.forward(b, t)
    full = t[0].data.copy()
    for reset, agrees in ((1.0, [True, True, True]), (0.0, [True, False, False])):
        step, b, t = setup_layer(type_, REC, [x[:1], cont[:1]])
        for i in range(3):
            b[0].data[...] = x[i:i + 1]
            b[1].data[...] = 0 if i == 0 else reset
            step.reshape(b, t)
            step.forward(b, t)
            assert np.allclose(t[0].data[0], full[i], atol=1e-6) == agrees[i], (reset, i)


def test_exposed_state_chains_two_halves_into_one_sequence():
    x = randn(6, 2, 3, seed=12)
    cont = np.ones((6, 2), np.float32)
    zeros = np.zeros((1, 2, H), np.float32)
    whole, b, t = setup_layer("LSTM", EXPOSED, [x, cont, zeros, zeros], n_top=3)
    whole.forward(b, t)
    first, b1, t1 = setup_layer("LSTM", EXPOSED, [x[:3], cont[:3], zeros, zeros], n_top=3)
    first.forward(b1, t1)
    second, b2, t2 = setup_layer("LSTM", EXPOSED, [x[3:], cont[3:], t1[1].data, t1[2].data], n_top=3)
    second.forward(b2, t2)
    np.testing.assert_allclose(np.concatenate([t1[0].data, t2[0].data]), t[0].data, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(t2[1].data, t[1].data, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(t2[2].data, t[2].data, rtol=1e-5, atol=1e-6)


def test_debug_info_logs_the_unrolled_blobs(capsys):
    from caffepy import log
    layer, b, t = setup_layer("LSTM", f"recurrent_param {{ num_output: {H} debug_info: true {FILL} }}",
                              [X, CONT])
    log.set_quiet(False)
    try:
        layer.forward(b, t)
        t[0].diff[...] = 1
        layer.backward(t, [True, False], b)
    finally:
        log.set_quiet(True)
    err = capsys.readouterr().err
    assert "[Forward] Layer layer, param W_hc data:" in err
    assert "[Backward] Layer layer, param W_xc diff:" in err


@pytest.mark.parametrize("params,bottoms,n_top,match", [
    ("recurrent_param { num_output: 0 }", [X, CONT], 1, r"recurrent_param\.num_output: must be positive"),
    (REC, [X, CONT[:3]], 1, r"bottom\[1\]: cont must be T x N \(4 x 2\)"),
    (REC, [X, CONT], 2, r"top: takes 1 blob"),
    (EXPOSED, [X, CONT], 3, r"bottom: takes 4 or 5 blobs \(x, cont, \[x_static\], h0, c0\)"),
    (EXPOSED, [X, CONT, H0, C0[:, :1]], 3, r"bottom\[3\]: c0 must be 1 x N x num_output"),
])
def test_recurrent_errors_name_the_field(params, bottoms, n_top, match):
    with pytest.raises((LayerError, ShapeError), match=match):
        setup_layer("LSTM", params, bottoms, n_top=n_top)


# -- an LRCN-style net learns ------------------------------------------------------------------
LRCN = """
name: "lrcn"
layer { name: "in" type: "Input" top: "x" top: "cont" top: "label"
  input_param { shape { dim: 6 dim: 8 dim: 3 } shape { dim: 6 dim: 8 } shape { dim: 6 dim: 8 } } }
layer { name: "lstm" type: "LSTM" bottom: "x" bottom: "cont" top: "h"
  recurrent_param { num_output: 12 weight_filler { type: "uniform" min: -0.3 max: 0.3 }
                    bias_filler { type: "constant" value: 0 } } }
layer { name: "predict" type: "InnerProduct" bottom: "h" top: "predict"
  inner_product_param { num_output: 3 axis: 2 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "predict" bottom: "label" top: "loss"
  softmax_param { axis: 2 } }
"""


def test_lrcn_style_net_learns_what_starts_each_sequence():
    """Each stream holds two 3-step sequences (cont 0 at t = 0 and 3); the label at every
    step is the class shown at the sequence's first step, so the net must remember it."""
    gen = np.random.default_rng(5)
    cls = gen.integers(0, 3, (2, 8))
    x = gen.normal(0, 0.3, (6, 8, 3)).astype(np.float32)
    label = np.repeat(cls, 3, axis=0).astype(np.float32)
    for s in range(2):
        x[3 * s, np.arange(8), cls[s]] += 3.0          # the class, shown once
    cont = np.ones((6, 8), np.float32)
    cont[[0, 3]] = 0
    p = caffe_pb2.SolverParameter()
    text_format.Parse('base_lr: 0.05 lr_policy: "fixed" momentum: 0.9 max_iter: 1000 display: 0 '
                      'random_seed: 3 type: "Adam" momentum2: 0.999', p)
    text_format.Parse(LRCN, p.net_param)
    p.snapshot_after_train = False
    solver = Solver(p)
    net = solver.net
    for name, value in (("x", x), ("cont", cont), ("label", label)):
        net.blobs[name].data[...] = value
    first = net.forward_from_to()
    solver.step(60)
    last = net.forward_from_to()
    assert last < 0.3 * first, (first, last)
    guess = net.blobs["predict"].data.argmax(axis=2)
    assert (guess[[1, 2, 4, 5]] == label[[1, 2, 4, 5]]).mean() > 0.9
