"""Matrix products into caller-owned buffers, for the layers and caffepy.parallel alike."""
from .kernels import common as _kernels


def gemm_into(a, b, c, beta=0.0):
    """c = a @ b + beta * c for float32 matrix views, written in place (c C-contiguous; a and b
    C- or Fortran-ordered, so transposed views are free).

    A compiled kernel (caffepy.kernels.common.gemm) calls scipy's BLAS single-threaded on the
    kernels' own OpenMP threads, sized by the thread rule like every other kernel (cext/blas.pxd):
    one pool of threads that spin only briefly, never BLAS's own spinning pool as well.
    """
    _kernels.gemm(a, b, c, beta)
