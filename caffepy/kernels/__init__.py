"""Compiled kernels, built from ../../cext/<family>.pyx (one module per layer family); their
NumPy references are in reference/ (cext/README.md maps the two). The build of the instruction
set in use is chosen here, at the first import (caffepy/isa.py)."""
from .. import isa as _isa

_isa.install(__path__)
