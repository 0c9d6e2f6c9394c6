"""The serving process around the server: how many files it may open, and
the memory its C library gives back."""

import ctypes
import json
import os
import resource
import subprocess
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


FREE_AND_TRIM = """
import ctypes, json, os, sys
from redrafter_mlx.serving.process import hold_freed_memory, trim_heap

def resident_mb():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

held = hold_freed_memory() if sys.argv[1] == "hold" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
before = resident_mb()
blocks = [libc.malloc(1 << 20) for _ in range(100)]  # 100 MB in blocks of 1 MB, an array's size
for block in blocks:
    ctypes.memset(block, 1, 1 << 20)
used = resident_mb()
for block in blocks:
    libc.free(block)
freed = resident_mb()
trim_heap()
print(json.dumps({"held": held, "used": used - before, "freed": freed - before, "trimmed": resident_mb() - before}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or MALLOC_TRIM is None, reason="glibc only")
def test_freed_memory_is_held_for_the_next_requests_until_the_heap_is_trimmed():
    """By default glibc maps a block of 1 MB on its own and unmaps it as
    soon as it is freed, so resident memory follows each array; held, the
    freed blocks stay resident until ``trim_heap``."""

    def run(mode):
        done = subprocess.run([sys.executable, "-c", FREE_AND_TRIM, mode], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    default, held = run("default"), run("hold")
    assert default["used"] > 90 and default["freed"] < 10
    assert held["held"] is True and held["used"] > 90
    assert held["freed"] > 90 and held["trimmed"] < 10
