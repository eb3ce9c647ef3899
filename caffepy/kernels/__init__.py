"""Compiled kernels, built from ../../cext/<family>.pyx (one module per layer family)."""
