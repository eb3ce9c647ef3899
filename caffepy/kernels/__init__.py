"""Compiled kernels, built from ../../cext/<family>.pyx (one module per layer family); their
NumPy references are in reference/ (cext/README.md maps the two)."""
