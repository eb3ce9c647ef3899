"""The one numerical gradient checker, used by every layer test.

Objective L = sum_t <r_t, top_t> with fixed random r_t, summed in float64.
Analytic gradients come from the layer's backward with top diffs = r_t;
numerical ones from central differences (L(x+h) - L(x-h)) / 2h. A point
within `kink_range` of `kink` (ReLU's 0, say) is skipped: the derivative is
not defined there.
"""
import numpy as np

from caffepy import rng


def _objective(layer, bottom, top, weights, seed):
    rng.seed(seed)    # stochastic layers (Dropout) draw the same mask every time
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    return sum(float(np.dot(t.data.ravel().astype(np.float64), w.ravel())) for t, w in zip(top, weights))


def check_gradient(layer, bottom, top, check_bottom=None, check_params=True, eps=1e-2,
                   threshold=1e-3, kink=None, kink_range=-1.0, seed=1701, max_checks=150,
                   top_weights=None):
    """Assert that `layer`'s backward matches central differences.

    check_bottom: indices of bottoms to check (default all). The layer must be set up.
    Raises AssertionError naming layer, blob, index and both values.
    """
    check_bottom = range(len(bottom)) if check_bottom is None else check_bottom
    gen = np.random.default_rng(seed)
    layer.reshape(bottom, top)     # tops sized by their bottoms' data (Filter) take their size
    _objective(layer, bottom, top, [np.zeros(t.shape) for t in top], seed)
    weights = top_weights or [gen.standard_normal(t.shape) for t in top]
    # analytic
    for t, w in zip(top, weights):
        t.diff[...] = w
    for b in bottom:
        b.diff[...] = 0
    for p in layer.blobs:
        p.diff[...] = 0
    propagate = [i in check_bottom for i in range(len(bottom))]
    rng.seed(seed)
    layer.backward(top, propagate, bottom)
    # perturbed and compared in memory order (raw_data): a channels-last blob's data is a view
    targets = [(f"bottom[{i}]", bottom[i], bottom[i].raw_diff.astype(np.float64).copy()) for i in check_bottom]
    if check_params:
        targets += [(f"blobs[{i}]", p, p.raw_diff.astype(np.float64).copy()) for i, p in enumerate(layer.blobs)
                    if i >= len(layer.param_propagate_down) or layer.param_propagate_down[i]]
    failures = []
    for label, blob, analytic in targets:
        flat = blob.raw_data.reshape(-1)
        n = flat.size
        indices = range(n) if n <= max_checks else gen.choice(n, max_checks, replace=False)
        for idx in indices:
            x = float(flat[idx])
            if kink is not None and abs(x - kink) <= kink_range:
                continue
            flat[idx] = x + eps
            plus = _objective(layer, bottom, top, weights, seed)
            flat[idx] = x - eps
            minus = _objective(layer, bottom, top, weights, seed)
            flat[idx] = x
            numeric = (plus - minus) / (2 * eps)
            computed = float(analytic.reshape(-1)[idx])
            scale = max(abs(computed), abs(numeric), 1.0)
            if abs(computed - numeric) > threshold * scale:
                failures.append(f"{layer.type} '{layer.name}' {label} index {int(idx)}: "
                                f"analytic {computed:.6g} vs numeric {numeric:.6g}")
    _objective(layer, bottom, top, weights, seed)
    assert not failures, f"{len(failures)} gradient mismatches:\n" + "\n".join(failures[:10])
