"""Forward cases for the data layers (no gradients: differentiable = False)."""
import atexit
import os
import shutil
import tempfile

import numpy as np

from data_helpers import make_db
from layer_cases import TEST, Case, case_tests

_DIR = tempfile.mkdtemp(prefix="caffepy_data_cases_")
atexit.register(shutil.rmtree, _DIR, True)
_VALUES = [np.arange(12, dtype=np.uint8).reshape(1, 3, 4) + 20 * i for i in range(3)]
_DB = make_db(os.path.join(_DIR, "db"), 3, values=_VALUES)


def _batch(indices):
    return np.stack([_VALUES[i] for i in indices]).astype(np.float64)


CASES = [
    Case("Input", "input_param { shape { dim: 2 dim: 3 } }", [], n_top=1, grad=False,
         expected=lambda: [np.zeros((2, 3))]),
    Case("DummyData", 'dummy_data_param { shape { dim: 2 dim: 3 } data_filler { type: "constant" value: 7 } }',
         [], grad=False, expected=lambda: [np.full((2, 3), 7.0)]),
    Case("DummyData", "dummy_data_param { num: 1 channels: 2 height: 1 width: 1 }", [], n_top=2, grad=False,
         expected=lambda: [np.zeros((1, 2, 1, 1)), np.zeros((1, 2, 1, 1))], id="DummyData:legacy two tops"),
    Case("Data", f'data_param {{ source: "{_DB}" batch_size: 2 backend: LMDB }}', [], n_top=2, grad=False,
         phase=TEST, expected=lambda: [_batch([0, 1]), np.array([0.0, 1.0])], id="Data:raw"),
    Case("Data", f'data_param {{ source: "{_DB}" batch_size: 4 }} '
                 'transform_param { crop_size: 2 mean_value: 4 scale: 0.5 }',
         [], n_top=2, grad=False, phase=TEST, id="Data:center crop, mean, scale, wrap",
         expected=lambda: [(_batch([0, 1, 2, 0])[:, :, 0:2, 1:3] - 4) * 0.5, np.array([0.0, 1, 2, 0])]),
]

test_forward, test_gradient = case_tests(CASES)
