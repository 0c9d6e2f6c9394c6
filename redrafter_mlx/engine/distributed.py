"""One model split across processes (ranks) with ``mlx.distributed``: for a
model that does not fit one machine, started by ``mlx.launch``.

Two splits:

- **pipeline**: each rank holds a range of layers. As in mlx-lm, the last
  rank runs the first layers and rank 0 the last ones; each stage receives
  the hidden states from the rank after it and sends its own to the rank
  before it, and an all-gather at the end gives every rank rank 0's output,
  so every rank has the logits. Models with mlx-lm's own ``pipeline()``
  (qwen2, qwen3_next, ...) use it; for the others the layers outside a
  rank's range become ``Skip`` layers, which keeps every layer's index
  (models such as gemma3 read their masks from caches by index), and the
  edge layers and the backbone get subclasses that receive, send and
  gather (``make_stage``, ``gather_output``), so no parameter is renamed.
- **tensor**: mlx-lm's ``shard()``, each matmul split over all ranks, where
  the model has it and its heads divide.

Speculation on top: every rank runs the same step on the same logits, so
every rank drafts the same tree and accepts the same path, with nothing
sent but the model's own traffic. Ranks that may round differently (other
chips or builds, found at start) also compare each step's results and
take rank 0's where they differ (``Ranks.settle``). Time could also set
ranks apart, so no choice a step makes reads a clock (the budget and the
floor read the cost curve); the curve is measured in the split setting
(hops included) at every start with rank 0's timings (``Ranks.first``),
and when rank 0's steps drift from it, rank 0 says so at the next join,
where every rank measures it again.

Every collective must be evaluated by every rank: an output that one rank
drops (a prefill's last hidden states) while another rank's next pass
needs the hop it carries blocks both. So every pass's output is evaluated,
not only the caches it fills.

A rank that dies must not leave the others blocked in a receive forever,
and ``mlx.launch`` exits 0 when a rank fails: ``Heartbeat`` is a side
channel (TCP, to rank 0) on which a closed connection or a silence ends
the surviving processes with one error line and exit status 1.
"""

import hashlib
import json
import os
import pickle
import platform
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..blas import blas_name
from ..errors import UserError
from .cache import CacheLayout, StepCache
from .recurrent import takes_cache

SPLITS = ("pipeline", "tensor")
BROADCAST_BYTES = 4096  # what the first sum of a broadcast carries
BEAT_SECONDS = 0.5  # each side writes a byte this often
SILENCE_SECONDS = 15.0  # a peer silent this long is taken as gone
BYE = b"x"  # a peer that ends normally says so first


def launched() -> bool:
    """Whether this process was started as one rank of several (``mlx.launch``)."""
    return "MLX_RANK" in os.environ


class Ranks:
    """The processes one model runs in. This class is one process alone,
    where every exchange is the identity: the engine calls the same methods
    whether or not the model is split (``SplitRanks``: several ranks)."""

    rank: int = 0
    size: int = 1
    split: Optional[str] = None
    alike: bool = True  # every rank rounds as rank 0 does (see settle)

    @property
    def several(self) -> bool:
        """Whether the model is split over more than this process."""
        return self.size > 1

    def first(self, values) -> np.ndarray:
        """Rank 0's ``values`` (floats) on every rank."""
        return np.asarray(values, np.float32)

    def broadcast(self, obj=None):
        """Rank 0's ``obj`` on every rank."""
        return obj

    def settle(self, results):
        """Rank 0's step ``results`` on every rank."""
        return results

    def differing(self, text: str) -> list[int]:
        """The ranks whose ``text`` is not rank 0's."""
        return []

    def check_same(self, what: str, text: str) -> None:
        """Refuse to start unless every rank has the same ``text``."""

    def end(self) -> None:
        """This process is done with the others."""


ONE_PROCESS = Ranks()


@dataclass
class SplitRanks(Ranks):
    """The group of processes one model is split over."""

    group: "mx.distributed.Group" = None
    split: str = "pipeline"
    heartbeat: Optional["Heartbeat"] = None
    alike: bool = True  # every rank rounds as rank 0 does (see settle)
    resent: bool = False  # rank 0 has had to send a step (see settle)

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def first(self, values) -> np.ndarray:
        """Rank 0's ``values`` (floats) on every rank: a sum in which the
        others add zeros. Synchronises."""
        values = np.asarray(values, np.float32)
        mine = values if self.rank == 0 else np.zeros_like(values)
        return np.array(mx.distributed.all_sum(mx.array(mine), group=self.group, stream=mx.cpu))

    def _sum(self, words: np.ndarray) -> np.ndarray:
        """An all-sum of int32 words (exact: every rank but one adds zeros)."""
        return np.array(mx.distributed.all_sum(mx.array(words), group=self.group, stream=mx.cpu))

    def broadcast(self, obj=None):
        """Rank 0's ``obj`` (anything picklable) on every rank; the others
        pass nothing. Synchronises: one sum of BROADCAST_BYTES when the
        pickled object fits in it (with its length), a second for the rest."""
        data = pickle.dumps(obj) if self.rank == 0 else b""
        head = np.zeros(BROADCAST_BYTES // 4, np.int32)
        if self.rank == 0:
            head[0] = len(data)
            part = data[: BROADCAST_BYTES - 4]
            head.view(np.uint8)[4 : 4 + len(part)] = np.frombuffer(part, np.uint8)
        head = self._sum(head)
        size = int(head[0])
        received = head.view(np.uint8)[4 : 4 + size].tobytes()
        rest = size - len(received)
        if rest > 0:
            tail = np.zeros(-(-rest // 4), np.int32)
            if self.rank == 0:
                tail.view(np.uint8)[:rest] = np.frombuffer(data[len(received) :], np.uint8)
            received += self._sum(tail).view(np.uint8)[:rest].tobytes()
        return pickle.loads(received)

    def settle(self, results):
        """Rank 0's step ``results`` (numpy arrays, in lists or tuples, None
        allowed) on every rank, for ranks that are not ``alike``.

        Every rank computes its own step from the same gathered hidden
        states, so alike ranks agree bit for bit and send nothing. Ranks
        that round differently (other chips, other builds) may choose or
        draft other tokens near a tie, or other draft probabilities in the
        last bits: each step they compare digests of their results in one
        small all-sum, and where they differ rank 0 sends its own and the
        others take them, so every rank commits the same path and drafts
        the next tree alike. Synchronises."""
        slots = np.zeros((self.size, 2), np.float32)
        slots[self.rank] = digest(results)
        digests = np.array(mx.distributed.all_sum(mx.array(slots), group=self.group, stream=mx.cpu))
        if (digests == digests[0]).all():
            return results
        if not (digests[self.rank] == digests[0]).all() and not self.resent:
            print(
                f"note: rank {self.rank} computed a step differently from rank 0 (ranks on different chips or MLX builds round "
                "differently); it takes rank 0's step whenever that happens",
                file=sys.stderr,
                flush=True,
            )
        self.resent = True
        return self.broadcast(results if self.rank == 0 else None)

    def differing(self, text: str) -> list[int]:
        """The ranks whose ``text`` is not rank 0's. Synchronises."""
        digest = int(hashlib.sha256(text.encode()).hexdigest()[:6], 16)  # exact in float32
        every = np.array(mx.distributed.all_gather(mx.array([digest], mx.float32), group=self.group, stream=mx.cpu))
        return [r for r, d in enumerate(every.tolist()) if int(d) != int(every[0])]

    def check_same(self, what: str, text: str) -> None:
        """Refuse to start unless every rank has the same ``text``."""
        differing = self.differing(text)
        if differing:
            raise UserError(f"rank {differing[0]} has another {what} than rank 0; every rank must load the same one")

    def end(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()


def digest(results) -> tuple[int, int]:
    """48 bits of a hash of numpy arrays (nested in lists or tuples, None
    allowed), as two integers a float32 sum carries exactly."""
    h = hashlib.sha256()

    def add(value):
        if isinstance(value, (list, tuple)):
            h.update(b"[%d" % len(value))
            for v in value:
                add(v)
        elif value is None:
            h.update(b"-")
        else:
            a = np.ascontiguousarray(value)
            h.update(f"{a.dtype}{a.shape}".encode())
            h.update(a.tobytes())

    add(results)
    d = h.digest()
    return int.from_bytes(d[:3], "big"), int.from_bytes(d[3:6], "big")


def join(split: str = "pipeline", silence: float = SILENCE_SECONDS) -> "SplitRanks":
    """Join the other ranks this process was launched with (``mlx.launch``
    sets the rank and the hostfile), and start the heartbeat."""
    if split not in SPLITS:
        raise UserError(f"--split takes one of {', '.join(SPLITS)}, got {split!r}")
    rank = os.environ.get("MLX_RANK", "?")
    # Connecting waits for every rank: one that never comes ends this one.
    watchdog = Watchdog(
        2 * silence, f"error: the other ranks did not connect within {2 * silence:.0f} s; ending rank {rank}"
    )
    try:
        try:
            group = mx.distributed.init(strict=True)
        except (RuntimeError, ValueError) as e:
            raise UserError(f"cannot join the other ranks: {e}") from None
        ranks = SplitRanks(group, split)
        if ranks.size > 1:
            ranks.heartbeat = Heartbeat(ranks, silence)
            ranks.alike = not ranks.differing(numerics())
    finally:
        watchdog.cancel()
    return ranks


def numerics() -> str:
    """What decides how this process rounds: the machine and its
    accelerator, the MLX build and BLAS, the threads BLAS splits work over."""
    try:
        device = mx.device_info()
    except (AttributeError, RuntimeError):
        device = {}
    return json.dumps(
        [
            platform.system(),
            platform.machine(),
            mx.__version__,
            str(mx.default_device()),
            device.get("architecture"),
            device.get("device_name"),
            blas_name(),
            os.environ.get("OPENBLAS_NUM_THREADS"),
            os.environ.get("OMP_NUM_THREADS"),
        ]
    )


class Watchdog:
    """Ends this process with ``line`` on standard error unless cancelled
    within ``seconds``. It is another process, because a thread cannot:
    ``mx.distributed.init`` holds the interpreter while it waits for the
    other ranks, forever if one never comes. The watchdog reads its end of
    a pipe: cancelling closes ours, and so does this process ending; if
    neither happens in time, it writes the line and kills this process
    (which then ends with SIGKILL's status, not 1)."""

    def __init__(self, seconds: float, line: str):
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", WATCHDOG, str(os.getpid()), str(seconds), line],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
        )

    def cancel(self) -> None:
        self.process.stdin.close()
        self.process.wait()


WATCHDOG = """
import os, select, signal, sys
pid, seconds, line = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if not select.select([sys.stdin], [], [], seconds)[0]:
    print(line, file=sys.stderr, flush=True)
    os.kill(pid, signal.SIGKILL)
"""


def fail(rank, message: str) -> None:
    """End this process now, from any thread, with one error line."""
    print(f"error: {message}; ending rank {rank}", file=sys.stderr, flush=True)
    os._exit(1)


# -- liveness -----------------------------------------------------------------


class Heartbeat:
    """Rank 0 listens on a free port (told to the others through the group),
    every other rank connects to it; both sides write a byte every
    BEAT_SECONDS and watch the other. A connection that closes without BYE,
    or stays silent for ``silence`` seconds, prints one line and ends this
    process with status 1, whatever its main thread is blocked in (MLX
    releases the interpreter while it waits on the network)."""

    def __init__(self, ranks: Ranks, silence: float):
        self.rank, self.done = ranks.rank, threading.Event()
        self.peers: dict[int, socket.socket] = {}
        if self.rank == 0:
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.bind(("", 0))
            server.listen(ranks.size)
            port = server.getsockname()[1]
        else:
            port = 0
        port = int(ranks.first([port])[0])
        if self.rank == 0:
            server.settimeout(silence)
            try:
                for _ in range(ranks.size - 1):
                    conn, _ = server.accept()
                    peer = int(conn.recv(4).decode().strip() or -1)
                    self.peers[peer] = conn
            except (OSError, ValueError):
                self._fail("a rank did not connect to rank 0's heartbeat")
            finally:
                server.close()
        else:
            try:
                conn = socket.create_connection((rank0_host(), port), timeout=silence)
                conn.sendall(f"{self.rank:4d}"[-4:].encode())
            except OSError as e:
                self._fail(f"cannot reach rank 0 ({e})")
            self.peers[0] = conn
        for peer, conn in self.peers.items():
            conn.settimeout(silence)
            threading.Thread(target=self._watch, args=(peer, conn), daemon=True).start()
        threading.Thread(target=self._beat, daemon=True).start()

    def _beat(self) -> None:
        while not self.done.wait(BEAT_SECONDS):
            for conn in list(self.peers.values()):
                try:
                    conn.sendall(b".")
                except OSError:
                    pass  # the watcher reports it

    def _watch(self, peer: int, conn: socket.socket) -> None:
        while True:
            try:
                data = conn.recv(64)
            except OSError:
                data = None
            if self.done.is_set():
                return
            if data and BYE in data:
                return
            if not data:
                why = "stopped answering" if data is None else "ended"
                self._fail(f"rank {peer} {why}")

    def _fail(self, message: str) -> None:
        fail(self.rank, message)

    def stop(self) -> None:
        """This rank ends normally: tell the others, stop watching."""
        self.done.set()
        for conn in self.peers.values():
            try:
                conn.sendall(BYE)
                conn.close()
            except OSError:
                pass


def rank0_host() -> str:
    """Rank 0's address, from the hostfile ``mlx.launch`` wrote (ring), or
    the coordinator it names (jaccl); 127.0.0.1 when neither says."""
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR")
    if coordinator:
        return coordinator.rsplit(":", 1)[0]
    try:
        with open(os.environ["MLX_HOSTFILE"]) as f:
            hosts = json.load(f)
        first = hosts[0][0] if isinstance(hosts[0], list) else hosts[0]
        return str(first).rsplit(":", 1)[0]
    except (KeyError, OSError, ValueError, IndexError, TypeError):
        return "127.0.0.1"


# -- splitting a model ----------------------------------------------------------


def holds_cache(layer: nn.Module) -> bool:
    """Whether ``layer`` keeps a cache: one of its parts takes ``cache=``
    (in nemotron_h, say, the MLP-only layers keep none)."""
    if isinstance(layer, Skip):
        return layer.holds_cache
    return any(isinstance(child, nn.Module) and takes_cache(child) for child in layer.children().values())


class Skip(nn.Module):
    """A layer another rank runs: its input passes through unchanged. It
    keeps the layer's plain attributes (such as which mask it takes), none
    of its weights."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        for name, value in vars(layer).items():
            if not name.startswith("_"):
                object.__setattr__(self, name, value)
        object.__setattr__(self, "holds_cache", holds_cache(layer))

    def __call__(self, x, *args, **kwargs):
        return x


class SkippedCache(StepCache):
    """The cache of a ``Skip`` layer, one another rank runs: it keeps
    nothing, is never written and has nothing to commit, but still answers
    for the layout, as the model may read positions and masks from any
    layer's cache (gemma3 reads them by index)."""

    # No keys and values, as an attention layer's cache not yet fed (what
    # code that copies a batch's caches reads, as ``calibrate`` does).
    keys = values = None

    def __init__(self, layout: CacheLayout):
        self.layout = layout

    @property
    def offset(self):
        return self.layout.offset

    def make_mask(
        self, num_tokens: int, return_array: bool = False, window_size: Optional[int] = None
    ) -> Optional[mx.array]:
        return self.layout.mask(num_tokens, window_size, return_array)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        raise RuntimeError("a layer another rank runs was run on this rank")

    def commit_path(self, path: np.ndarray, accepted: np.ndarray) -> None:
        """Nothing kept, nothing to move."""

    def filter(self, rows: mx.array, trim: int) -> None:
        """Nothing kept, no rows to drop."""

    def extend(self, other: StepCache, length: int, other_length: int, pad: int, other_pad: int) -> None:
        """Nothing kept, no rows to add."""

    def rows_kv(self, row: int, begin: int, end: int) -> tuple:
        raise RuntimeError(
            "a layer another rank runs keeps nothing for a prompt cache (a split model keeps no prompt caches)"
        )

    def state_arrays(self) -> list:
        return []


def make_stage(layer: nn.Module, group, receive_from: Optional[int], send_to: Optional[int]) -> None:
    """Make ``layer`` (in place) the edge of this rank's range: it receives
    its input from the rank before it in the pipeline, or sends its output
    to the one after it (or both). Its class becomes a subclass whose call
    does that, so its parameters keep their names (a GGUF file's tensors
    are matched to them after the split)."""
    own = type(layer)

    def call(self, x, *args, **kwargs):
        if receive_from is not None:
            x = mx.distributed.recv_like(x, receive_from, group=group)
        y = own.__call__(self, x, *args, **kwargs)
        if send_to is not None:
            y = mx.distributed.send(y, send_to, group=group)
            # A prefill chunk's output is dropped and its caches evaluated
            # (mlx-lm's loop does so): the layer's cache carries the send,
            # as in mlx-lm's own pipeline.
            for value in (*args, *kwargs.values()):
                if isinstance(getattr(value, "keys", None), mx.array):
                    value.keys = mx.depends(value.keys, y)
                elif (
                    isinstance(getattr(value, "cache", None), list)
                    and value.cache
                    and isinstance(value.cache[-1], mx.array)
                ):
                    value.cache[-1] = mx.depends(value.cache[-1], y)  # a recurrent layer's state
        return y

    layer.__class__ = type(f"Stage{own.__name__}", (own,), {"__call__": call})


def gather_output(backbone: nn.Module, group) -> None:
    """Give ``backbone`` (in place) an all-gather after it: every rank gets
    rank 0's (the last stage's) hidden states. As for a stage, its class
    becomes a subclass, so nothing is renamed."""
    own = type(backbone)

    def call(self, *args, **kwargs):
        h = own.__call__(self, *args, **kwargs)
        return mx.distributed.all_gather(h, group=group)[: h.shape[0]]

    backbone.__class__ = type(f"Gathered{own.__name__}", (own,), {"__call__": call})


def stage_range(num_layers: int, rank: int, size: int) -> tuple[int, int]:
    """This rank's layers [start, end): mlx-lm's order, the last rank first,
    and the low ranks take the extra layers."""
    base, extra = divmod(num_layers, size)
    split = [base + (1 if r < extra else 0) for r in range(size)]
    start = sum(split[rank + 1 :])
    return start, start + split[rank]


def split_model(model: nn.Module, ranks: Ranks) -> None:
    """Keep only this rank's part of ``model`` (in place, before its weights
    are evaluated, so the other parts are never read from disk)."""
    language_model = getattr(model, "language_model", model)
    kind = getattr(language_model, "model_type", None) or type(model).__module__
    backbone = getattr(language_model, "model", None) or getattr(language_model, "backbone", None)
    if ranks.split == "tensor":
        if not hasattr(model, "shard"):
            raise UserError(f"model type {kind} has no tensor-parallel split in mlx-lm; use --split pipeline")
        try:
            model.shard(ranks.group)
        except (AssertionError, ValueError) as e:
            raise UserError(
                f"cannot split model type {kind} over {ranks.size} ranks by tensors ({e or 'its heads do not divide'}); use --split pipeline"
            ) from None
        return
    if backbone is None or not isinstance(getattr(backbone, "layers", None), list):
        raise UserError(f"cannot split model type {kind} into pipeline stages: no list of layers")
    layers = backbone.layers
    if len(layers) < ranks.size:
        raise UserError(f"cannot split {len(layers)} layers over {ranks.size} ranks")
    if hasattr(backbone, "pipeline"):
        backbone.pipeline(ranks.group)
        return
    start, end = stage_range(len(layers), ranks.rank, ranks.size)
    receive_from = ranks.rank + 1 if ranks.rank < ranks.size - 1 else None
    send_to = ranks.rank - 1 if ranks.rank > 0 else None
    if start == end - 1:
        make_stage(layers[start], ranks.group, receive_from, send_to)
    else:
        make_stage(layers[start], ranks.group, receive_from, None)
        make_stage(layers[end - 1], ranks.group, None, send_to)
    backbone.layers = [layer if start <= i < end else Skip(layer) for i, layer in enumerate(layers)]
    gather_output(backbone, ranks.group)
