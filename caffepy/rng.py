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
