"""The serving process around the server: its listening socket, the
open files it may hold, the memory its C library keeps, and a SIGTERM
before the server is up (while the model loads or the cost curves are
measured) ending it as cleanly as one while it serves."""

import contextlib
import ctypes
import ipaddress
import os
import resource
import signal
import socket
import sys

from ..errors import UserError


class Stopped(Exception):
    """A SIGTERM arrived before the server took over its handling."""


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, or one clear error (a port in use, an
    address this machine does not have, a port outside 1-65535)."""
    if not 1 <= port <= 65535:
        raise UserError(f"port must be in 1-65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None
    return sock


def allow_open_files(count: int) -> int:
    """Raise this process's soft limit on open files to ``count``, as far
    as its hard limit allows (the soft limit is often far below it: 256 on
    macOS, 1,024 on many Linux systems); never lowers it. Returns how many
    files the process may now open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= count:
        return count if soft == resource.RLIM_INFINITY else soft
    wanted = count if hard == resource.RLIM_INFINITY else min(count, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ValueError, OSError):  # macOS refuses more than its kern.maxfilesperproc, whatever the hard limit says
        return soft
    return wanted


def _glibc(name: str):
    """The C library's function ``name``, or None where the system is not
    Linux or its C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


MALLOC_TRIM = _glibc("malloc_trim")
MALLOPT = _glibc("mallopt")
# mallopt's parameters (glibc's malloc.h), and the values the server sets.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
HEAP_BLOCK_BYTES = 32 << 20  # the largest block glibc will take from its heap rather than map (64-bit)
KEPT_TOP_BYTES = 2**31 - 1  # mallopt's most: the heap's free top is kept up to 2 GB


def hold_freed_memory() -> bool:
    """Has the C library keep what the server frees for its next requests,
    until ``trim_heap`` gives it back once the server is idle:

    - one arena for every thread, rather than one more for each thread that
      allocates while another does, each keeping free memory of its own;
    - blocks up to 32 MB (glibc's most) taken from the heap, rather than
      each mapped on its own and unmapped as soon as it is freed (its pages
      then faulted in afresh for the next array);
    - the free top of the heap kept, rather than given back at each free.

    So under load resident memory rises to what the server's work holds at
    most and stays there, rather than rising and falling with each long
    prompt. Called before the server's threads start. Returns whether the C
    library took every setting (False where it is not glibc)."""
    if MALLOPT is None or MALLOC_TRIM is None:
        return False
    settings = ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, HEAP_BLOCK_BYTES), (M_TRIM_THRESHOLD, KEPT_TOP_BYTES))
    return all([MALLOPT(parameter, value) == 1 for parameter, value in settings])


def trim_heap() -> None:
    """Give the free pages of the C library's heap back to the system.
    glibc keeps memory freed below the top of its heaps (and, after
    ``hold_freed_memory``, at its top), so without this a process stays
    resident at the most it ever held at once: a rare moment (several long
    prompts at once) would raise it for good. Nothing where the C library
    is not glibc."""
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)


@contextlib.contextmanager
def stopped_by_sigterm(announce=lambda line: print(line, file=sys.stderr)):
    """Within: a SIGTERM raises ``Stopped``, which ends the block with one
    line on ``announce`` and exit status 0, as a SIGTERM to a running server
    does (the server installs its own handler once it serves, and restores
    this one after)."""

    def on_sigterm(signum, frame):
        raise Stopped

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    except Stopped:
        announce("stopped (SIGTERM) before serving")
        # The engine thread may be measuring the cost curve: MLX work in
        # flight cannot be interrupted, and finalising the interpreter under
        # it aborts the process. Nothing is left to save (a prompt log
        # flushes every line), so the process ends here.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    finally:
        signal.signal(signal.SIGTERM, previous)
