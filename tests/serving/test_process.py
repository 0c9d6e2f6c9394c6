"""The serving process around the server: how many files it may open, and
the memory its C library gives back."""

import ctypes
import os
import resource
import sys

import pytest

from redrafter_mlx.serving.process import MALLOC_TRIM, allow_open_files, trim_heap


def test_the_soft_limit_on_open_files_is_raised_toward_the_hard_limit_and_never_lowered():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
        assert allow_open_files(100) == 512  # enough already: left as it is
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (512, hard)
        wanted = 1024 if hard == resource.RLIM_INFINITY else min(1024, hard)
        assert allow_open_files(1024) == wanted
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (wanted, hard)
        if hard != resource.RLIM_INFINITY:
            assert allow_open_files(hard + 1000) == hard  # no further than the hard limit
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def resident_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux") or MALLOC_TRIM is None, reason="glibc only")
def test_memory_freed_below_the_top_of_the_heap_goes_back_to_the_system():
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 << 10) for _ in range(1_600)]  # 100 MB in blocks glibc takes from its heap
    for block in blocks:
        ctypes.memset(block, 1, 64 << 10)
    # Every other block is freed: each hole lies between blocks in use, so
    # none joins the top of the heap, which glibc may give back by itself.
    for block in blocks[::2]:
        libc.free(block)
    held = resident_mb()
    trim_heap()
    try:
        assert resident_mb() < held - 40  # of the 50 MB freed
    finally:
        for block in blocks[1::2]:
            libc.free(block)
