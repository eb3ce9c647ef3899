import numpy as np

from layer_cases import Case, case_tests, randn

CASES = [
    Case("Split", "", [randn(2, 3, 4)], n_top=3, expected=lambda x: [x, x, x]),
]

test_forward, test_gradient = case_tests(CASES)
