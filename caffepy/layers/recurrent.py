"""Recurrent layers: LSTM and RNN (unrolled over the T timesteps of their input, as Caffe
unrolls them) and LSTMUnit (one LSTM step).

Bottoms of LSTM / RNN, in Caffe's order:
    x         T x N x ...   T timesteps of N independent streams (flattened from axis 2)
    cont      T x N         sequence continuation markers: 0 starts a sequence (the state
                            before it is forgotten), 1 continues it
    x_static  N x ...       optional, the same input at every timestep
    h0 (, c0) 1 x N x H     with recurrent_param.expose_hidden only: the initial state
Tops: h (LSTM) or o (RNN), T x N x H; with expose_hidden also hT (, cT), 1 x N x H.
Without expose_hidden the state carries over from one forward to the next (hT of one
batch is h0 of the next), so long sequences can be fed T steps at a time.

recurrent_param { num_output (H) weight_filler bias_filler debug_info expose_hidden }.
Parameter blobs, in Caffe's order and shapes (caffemodels interchange):
    LSTM  W_xc [4H, I], b_c [4H], (W_xc_static [4H, S]), W_hc [4H, H]
    RNN   W_xh [H, I], b_h [H], (W_xh_static [H, S]), W_hh [H, H], W_ho [H, H], b_o [H]
with the LSTM's 4H gate rows in the order i, f, o, g.

Unlike Caffe 1.0, backward also reaches h0 / c0 and takes the diffs of hT / cT (Caffe leaves
both unconnected); with expose_hidden off the two agree.
"""
import numpy as np

from .. import log
from ..errors import ShapeError
from ..layer import Layer, count_from, register
from .common import param_wanted


def _sigmoid(x):
    return 0.5 * np.tanh(0.5 * x) + 0.5      # tanh form: no overflow for large |x|


def lstm_unit_forward(c_prev, gates, cont):
    """One LSTM step on N x 4H gate inputs (i, f, o, g): returns c, h and the activations
    backward needs. c = cont * f * c_prev + i * g, h = o * tanh(c)."""
    hidden = c_prev.shape[-1]
    acts = np.empty_like(gates)
    acts[:, :3 * hidden] = _sigmoid(gates[:, :3 * hidden])
    acts[:, 3 * hidden:] = np.tanh(gates[:, 3 * hidden:])
    i, f, o, g = (acts[:, k * hidden:(k + 1) * hidden] for k in range(4))
    c = (cont[:, None] * f) * c_prev + i * g
    h = o * np.tanh(c)
    return c, h, acts


def lstm_unit_backward(c_prev, c, acts, cont, dc, dh):
    """Gradients of one LSTM step: (d c_prev, d gates) from the diffs of c and h."""
    hidden = c_prev.shape[-1]
    i, f, o, g = (acts[:, k * hidden:(k + 1) * hidden] for k in range(4))
    tanh_c = np.tanh(c)
    keep = cont[:, None]
    dc_total = dc + dh * o * (1 - tanh_c * tanh_c)
    dgates = np.empty_like(acts)
    dgates[:, :hidden] = dc_total * g * i * (1 - i)
    # the exact derivative of cont * sigmoid; Caffe's equals it for the usual cont of 0 or 1
    dgates[:, hidden:2 * hidden] = dc_total * c_prev * keep * f * (1 - f)
    dgates[:, 2 * hidden:3 * hidden] = dh * tanh_c * o * (1 - o)
    dgates[:, 3 * hidden:] = dc_total * i * (1 - g * g)
    return dc_total * keep * f, dgates


@register
class LSTMUnit(Layer):
    """One LSTM step: bottoms c_prev (1 x N x H), gate inputs (1 x N x 4H, in the order i, f,
    o, g) and cont (1 x N); tops c and h (1 x N x H).

        i, f, o = sigmoid(.), g = tanh(.);  c = cont * f * c_prev + i * g;  h = o * tanh(c)

    No gradient to cont.
    """
    exact_bottoms = 3
    exact_tops = 2

    def allow_force_backward(self, bottom_index):
        return bottom_index != 2

    def reshape(self, bottom, top):
        c_prev, gates, cont = bottom
        n = c_prev.shape[1] if c_prev.num_axes == 3 else None
        for i, (b, axes) in enumerate(zip(bottom, (3, 3, 2))):
            if b.num_axes != axes or b.shape[0] != 1 or b.shape[1] != n:
                raise self.error(f"bottom[{i}]", f"needs shape 1 x N{' x ...' if axes == 3 else ''} "
                                 f"({axes} axes) with the N of bottom[0]", b.shape, cls=ShapeError)
        if gates.shape[2] != 4 * c_prev.shape[2]:
            raise self.error("bottom[1]", f"needs 4 x {c_prev.shape[2]} gate inputs (4 x bottom[0]'s)",
                             gates.shape, cls=ShapeError)
        top[0].reshape(c_prev.shape)
        top[1].reshape(c_prev.shape)

    def forward(self, bottom, top):
        c, h, self.acts = lstm_unit_forward(bottom[0].data[0], bottom[1].data[0], bottom[2].data[0])
        top[0].data[0] = c
        top[1].data[0] = h

    def backward(self, top, propagate_down, bottom):
        dc_prev, dgates = lstm_unit_backward(bottom[0].data[0], top[0].data[0], self.acts,
                                             bottom[2].data[0], top[0].diff[0], top[1].diff[0])
        if propagate_down[0]:
            bottom[0].diff[0] = dc_prev
        if propagate_down[1]:
            bottom[1].diff[0] = dgates
        if propagate_down[2]:
            bottom[2].diff[...] = 0


class _Recurrent(Layer):
    """What LSTM and RNN share: the bottoms and tops, the input transforms (every timestep's
    x and the static input in one product each), the carried state and debug_info.
    A subclass gives `gate_rows` (rows of the input weights per hidden unit), `state_names`,
    `param_names`, and runs the recursion in `unroll` / `unroll_backward`."""
    min_bottoms = 2
    min_tops = 1

    def allow_force_backward(self, bottom_index):
        return bottom_index != 1

    def setup(self, bottom, top):
        p = self.param.recurrent_param
        if p.num_output <= 0:
            raise self.error("recurrent_param.num_output", "must be positive", p.num_output)
        self.hidden = int(p.num_output)
        self.expose = bool(p.expose_hidden)
        exposed = len(self.state_names) if self.expose else 0
        if len(bottom) not in (2 + exposed, 3 + exposed):
            names = "x, cont, [x_static]" + "".join(f", {s}0" for s in self.state_names) * self.expose
            raise self.error("bottom", f"takes {2 + exposed} or {3 + exposed} blobs ({names})", len(bottom))
        if len(top) != 1 + exposed:
            raise self.error("top", f"takes {1 + exposed} blob(s)" + (" (the output, then "
                             + ", ".join(f"{s}T" for s in self.state_names) + ")" if exposed else ""),
                             len(top))
        self.static = len(bottom) == 3 + exposed
        x = bottom[0]
        if x.num_axes < 2:
            raise self.error("bottom[0]", "needs at least 2 axes (timesteps, streams, ...)", x.shape,
                             cls=ShapeError)
        self.inputs = count_from(x.shape, 2)
        gate = self.gate_rows * self.hidden
        specs = [((gate, self.inputs), p.weight_filler), ((gate,), p.bias_filler)]
        if self.static:
            xs = bottom[2]
            if xs.num_axes < 1:
                raise self.error("bottom[2]", "the static input needs at least 1 axis (streams, ...)",
                                 xs.shape, cls=ShapeError)
            specs.append(((gate, count_from(xs.shape, 1)), p.weight_filler))
        specs += self.more_params(p)
        self.init_param_blobs(specs)
        self.names = self.param_names[:2] + (self.static_name,) * self.static + self.param_names[2:]
        self.state = None       # the carried (h, c) when the state is not exposed

    def reshape(self, bottom, top):
        x, cont = bottom[0], bottom[1]
        if x.num_axes < 2 or count_from(x.shape, 2) != self.inputs:
            raise self.error("bottom[0]", f"needs shape T x N x ... with {self.inputs} values per item",
                             x.shape, cls=ShapeError)
        self.T, self.N = x.shape[:2]
        if cont.shape != (self.T, self.N):
            raise self.error("bottom[1]", f"cont must be T x N ({self.T} x {self.N})", cont.shape,
                             cls=ShapeError)
        if self.static and (bottom[2].shape[0] != self.N
                            or count_from(bottom[2].shape, 1) != self.blobs[2].shape[1]):
            raise self.error("bottom[2]", f"x_static must be N x ... ({self.N} streams, "
                             f"{self.blobs[2].shape[1]} values each)", bottom[2].shape, cls=ShapeError)
        state_shape = (1, self.N, self.hidden)
        if self.expose:
            for k, name in enumerate(self.state_names):
                b = bottom[2 + self.static + k]
                if b.shape != state_shape:
                    raise self.error(f"bottom[{2 + self.static + k}]", f"{name}0 must be 1 x N x "
                                     f"num_output {state_shape}", b.shape, cls=ShapeError)
            for t in top[1:]:
                t.reshape(state_shape)
        elif self.state is None or self.state[0].shape != state_shape[1:]:
            self.state = [np.zeros(state_shape[1:], np.float32) for _ in self.state_names]
        top[0].reshape(self.T, self.N, self.hidden)

    def _inputs(self, bottom):
        """Every timestep's input transform, T x N x gates, with the static part added."""
        w, b = self.blobs[0].data, self.blobs[1].data
        pre = (bottom[0].data.reshape(self.T * self.N, self.inputs) @ w.T + b).reshape(self.T, self.N, -1)
        if self.static:
            pre += bottom[2].data.reshape(self.N, -1) @ self.blobs[2].data.T
        return pre

    def _recurrent_blobs(self):
        """The parameter blobs after the input ones (W_hc; or W_hh, W_ho, b_o)."""
        return self.blobs[2 + self.static:]

    def forward(self, bottom, top):
        if self.expose:
            start = [bottom[2 + self.static + k].data[0] for k in range(len(self.state_names))]
        else:
            start = self.state
        self.start = [s.copy() for s in start]
        cont = bottom[1].data
        final = self.unroll(self._inputs(bottom), cont, self.start, top[0].data)
        if self.expose:
            for t, s in zip(top[1:], final):
                t.data[0] = s
        else:
            self.state = [s.copy() for s in final]
        if self.param.recurrent_param.debug_info:
            self._debug("Forward", top[0].name or "top[0]", top[0].data)

    def backward(self, top, propagate_down, bottom):
        final_diffs = [t.diff[0] for t in top[1:]] if self.expose else \
            [np.zeros((self.N, self.hidden), np.float32) for _ in self.state_names]
        cont = bottom[1].data
        dpre, dstart = self.unroll_backward(top[0].diff, cont, final_diffs)
        dpre2 = dpre.reshape(self.T * self.N, -1)
        x2 = bottom[0].data.reshape(self.T * self.N, self.inputs)
        if param_wanted(self, 0):
            self.blobs[0].diff[...] += dpre2.T @ x2
        if param_wanted(self, 1):
            self.blobs[1].diff[...] += dpre2.sum(axis=0)
        if propagate_down[0]:
            bottom[0].diff.reshape(self.T * self.N, self.inputs)[...] = dpre2 @ self.blobs[0].data
        if propagate_down[1]:
            bottom[1].diff[...] = 0             # no gradient to the sequence markers
        if self.static:
            dstatic = dpre.sum(axis=0)
            xs = bottom[2].data.reshape(self.N, -1)
            if param_wanted(self, 2):
                self.blobs[2].diff[...] += dstatic.T @ xs
            if propagate_down[2]:
                bottom[2].diff.reshape(self.N, -1)[...] = dstatic @ self.blobs[2].data
        if self.expose:
            for k, d in enumerate(dstart):
                if propagate_down[2 + self.static + k]:
                    bottom[2 + self.static + k].diff[0] = d
        if self.param.recurrent_param.debug_info:
            self._debug("Backward", bottom[0].name or "bottom[0]", dpre)

    def _debug(self, direction, blob, values):
        """recurrent_param.debug_info: Caffe's per-blob mean |value| lines for the unrolled net."""
        kind = "data" if direction == "Forward" else "diff"
        log.info(f"    [{direction}] Layer {self.name}, {blob} {kind}: {float(np.abs(values).mean()):.6g}")
        for name, blob_ in zip(self.names, self.blobs):
            arr = blob_.data if direction == "Forward" else blob_.diff
            log.info(f"    [{direction}] Layer {self.name}, param {name} {kind}: "
                     f"{float(np.abs(arr).mean()):.6g}")

    def wanted_param(self, k):
        """Whether recurrent parameter blob k (counted after the input ones) wants a gradient."""
        return param_wanted(self, 2 + self.static + k)


@register
class LSTM(_Recurrent):
    """Long short-term memory over T timesteps (see the module docstring for bottoms, tops and
    blobs). Per timestep t, for each stream:

        gates_t = W_xc x_t + b_c (+ W_xc_static x_static) + W_hc (cont_t * h_{t-1})
        c_t, h_t = LSTMUnit(c_{t-1}, gates_t, cont_t)
    """
    gate_rows = 4
    state_names = ("h", "c")
    param_names = ("W_xc", "b_c", "W_hc")
    static_name = "W_xc_static"

    def more_params(self, p):
        return [((4 * self.hidden, self.hidden), p.weight_filler)]

    def unroll(self, pre, cont, start, out):
        h, c = start
        w_hc = self._recurrent_blobs()[0].data
        self.kept = np.empty((self.T, self.N, self.hidden), np.float32)    # cont_t * h_{t-1}
        self.cells = np.empty((self.T + 1, self.N, self.hidden), np.float32)
        self.acts = np.empty_like(pre)
        self.cells[0] = c
        for t in range(self.T):
            self.kept[t] = cont[t][:, None] * h
            c, h, self.acts[t] = lstm_unit_forward(c, pre[t] + self.kept[t] @ w_hc.T, cont[t])
            self.cells[t + 1] = c
            out[t] = h
        return h, c

    def unroll_backward(self, dout, cont, final_diffs):
        w_hc_blob = self._recurrent_blobs()[0]
        dh_next, dc_next = final_diffs
        dpre = np.empty_like(self.acts)
        for t in reversed(range(self.T)):
            dc_next, dpre[t] = lstm_unit_backward(self.cells[t], self.cells[t + 1], self.acts[t], cont[t],
                                                  dc_next, dout[t] + dh_next)
            dh_next = (dpre[t] @ w_hc_blob.data) * cont[t][:, None]
        if self.wanted_param(0):
            w_hc_blob.diff[...] += dpre.reshape(self.T * self.N, -1).T @ self.kept.reshape(self.T * self.N, -1)
        return dpre, (dh_next, dc_next)


@register
class RNN(_Recurrent):
    """A simple (Elman) recurrent net over T timesteps (see the module docstring for bottoms,
    tops and blobs). Per timestep t, for each stream:

        h_t = tanh(W_xh x_t + b_h (+ W_xh_static x_static) + W_hh (cont_t * h_{t-1}))
        o_t = tanh(W_ho h_t + b_o)
    """
    gate_rows = 1
    state_names = ("h",)
    param_names = ("W_xh", "b_h", "W_hh", "W_ho", "b_o")
    static_name = "W_xh_static"

    def more_params(self, p):
        h = self.hidden
        return [((h, h), p.weight_filler), ((h, h), p.weight_filler), ((h,), p.bias_filler)]

    def unroll(self, pre, cont, start, out):
        (h,) = start
        w_hh, w_ho, b_o = (b.data for b in self._recurrent_blobs())
        self.kept = np.empty((self.T, self.N, self.hidden), np.float32)
        self.hs = np.empty((self.T, self.N, self.hidden), np.float32)
        for t in range(self.T):
            self.kept[t] = cont[t][:, None] * h
            h = np.tanh(pre[t] + self.kept[t] @ w_hh.T)
            self.hs[t] = h
        np.tanh(self.hs.reshape(self.T * self.N, -1) @ w_ho.T + b_o, out=out.reshape(self.T * self.N, -1))
        self.out = out
        return (h,)

    def unroll_backward(self, dout, cont, final_diffs):
        w_hh, w_ho, b_o = self._recurrent_blobs()
        flat = self.T * self.N
        do = (dout * (1 - self.out * self.out)).reshape(flat, -1)
        if self.wanted_param(1):
            w_ho.diff[...] += do.T @ self.hs.reshape(flat, -1)
        if self.wanted_param(2):
            b_o.diff[...] += do.sum(axis=0)
        dhs = (do @ w_ho.data).reshape(self.T, self.N, -1)
        (dh_next,) = final_diffs
        dpre = np.empty_like(self.hs)
        for t in reversed(range(self.T)):
            dpre[t] = (dhs[t] + dh_next) * (1 - self.hs[t] * self.hs[t])
            dh_next = (dpre[t] @ w_hh.data) * cont[t][:, None]
        if self.wanted_param(0):
            w_hh.diff[...] += dpre.reshape(flat, -1).T @ self.kept.reshape(flat, -1)
        return dpre, (dh_next,)
