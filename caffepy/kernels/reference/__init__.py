"""NumPy references of the compiled kernels, one module per kernel module: reference/<name>.py
holds what tests (and benchmarks) compare caffepy.kernels.<name> (cext/<name>.pyx) against.

The blocked kernels of the Intel family compute what the NCHW ones do on the packed layout: their
tests unpack and compare with reference/vision.py and reference/normalization.py, and
reference/intel.py holds the layout itself (pack, unpack). cext/README.md maps every family to
its kernels and references.

Pure NumPy, importable without the compiled kernels: the layers whose kernels may be missing
(LRN, BatchNorm, MVN, SoftmaxWithLoss) run these instead.
"""
