"""The one random stream behind fillers, dropout and shuffling.

`seed(s)` makes a run repeatable bit for bit (solver `random_seed`); a negative
seed (Caffe's default -1) draws a fresh one.
"""
import numpy as np

_generator = np.random.default_rng()


def seed(value):
    global _generator
    _generator = np.random.default_rng(None if value is None or value < 0 else value)


def generator():
    return _generator


def get_state():
    return _generator.bit_generator.state


def set_state(state):
    _generator.bit_generator.state = state


def state_problem(value, template):
    """Why `value` is not a state of the bit generator whose state is `template` (as
    `get_state()` gives it), or None: the same keys, the bit generator's name, and
    non-negative integers below 2^128 where the template has integers."""
    if isinstance(template, dict):
        if not isinstance(value, dict):
            return f"expected an object, got {type(value).__name__}"
        for key, name in template.items():      # a wrong name (bit_generator) says the most
            if isinstance(name, str) and key in value and value[key] != name:
                return f"{key}: expected '{name}', got {str(value[key])[:40]!r}"
        if set(value) != set(template):
            return f"expected the keys {sorted(template)}, got {sorted(value)}"
        for key in template:
            problem = state_problem(value[key], template[key])
            if problem:
                return f"{key}: {problem}"
        return None
    if isinstance(template, str):
        return None if value == template else f"expected '{template}', got {str(value)[:40]!r}"
    if isinstance(value, bool) or not isinstance(value, int):
        return f"expected an integer, got {type(value).__name__}"
    if not 0 <= value < 1 << 128:
        return f"expected an integer in [0, 2^128), got {value}"
    return None
