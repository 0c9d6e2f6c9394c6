"""Use OpenBLAS on Linux when the system has it.

The ``mlx[cpu]`` wheel links a reference BLAS whose float32 matmul is about 30x
slower than OpenBLAS. Loading OpenBLAS with global symbol visibility before the
first ``import mlx.core`` makes MLX resolve its BLAS calls to it.
"""

import ctypes
import os
import sys

OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)


def preload_openblas() -> None:
    """Load OpenBLAS globally if on Linux, found, and not disabled with
    ``REDRAFTER_MLX_OPENBLAS=0``. Does nothing once ``mlx.core`` is imported."""
    if not sys.platform.startswith("linux") or "mlx.core" in sys.modules:
        return
    if os.environ.get("REDRAFTER_MLX_OPENBLAS", "1") == "0":
        return
    for path in OPENBLAS_PATHS:
        if os.path.exists(path):
            ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
            return


def blas_name() -> str:
    """Which BLAS this process runs MLX's CPU matmuls with."""
    if sys.platform == "darwin":
        return "Accelerate"
    try:
        with open("/proc/self/maps") as maps:
            if "libopenblas" in maps.read():
                return "OpenBLAS"
    except OSError:
        pass
    return "reference BLAS (slow; see README: OpenBLAS)"
