"""Choosing the base model's token at every tree node: greedy or sampled,
with mlx-lm's sampling controls.

Sampling draws one token per node with the Gumbel-max trick, from noise that
is a hash of (seed, position of the token being chosen, vocabulary index).
Along any root-to-leaf walk each position is therefore drawn exactly once,
with noise independent of everything the walk has seen: the acceptance walk
then emits exactly the autoregressive distribution. Since the noise depends
only on the seed and the position, a seeded run gives the same tokens in a
batch or alone, and the same tokens as autoregressive sampling with that seed.
It also means a position's noise, once drawn, serves every later step whose
nodes stand at that position: a run draws about one vector of noise per
token it emits, not one per node it verifies.
"""

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..errors import UserError
from .types import Chooser, TokenHistory


@dataclass
class SamplingSettings:
    """mlx-lm's sampling controls and logits processors. temp 0 is greedy
    (argmax of the processed logits); top_p 1, top_k 0, min_p 0 and the
    penalties at 0 (repetition: None) turn those off.

    Processors, in mlx-lm's order: logit_bias; repetition_penalty
    (multiplicative, sign-aware), presence_penalty (subtracted once per
    token present) and frequency_penalty (subtracted per occurrence), each
    over the last ``*_context_size`` tokens before the token chosen.
    Filters, in mlx-lm's order: top-p, min-p, XTC (with probability
    ``xtc_probability``, drop every token above ``xtc_threshold`` but the
    least likely of them, never ``xtc_special_tokens``), top-k.
    forced: token ids that must open the answer, from sequence position
    ``forced_at`` (the prompt's length) on: a processor that leaves only
    them (a tool call that must begin).
    logprobs: None, or report each chosen token's log-probability (after
    the processors, before temperature and filters, as mlx-lm defines it)
    with this many most likely alternatives (0-20)."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: Optional[float] = None
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_special_tokens: tuple = ()
    logit_bias: dict = field(default_factory=dict)
    forced: tuple = ()
    forced_at: int = 0
    logprobs: Optional[int] = None
    seed: int = 0  # the prompt at index i of the input list samples with row_seed(seed, i)
    row_seeds: Optional[list] = None  # a seed per prompt of the input list, instead of `seed`

    def __post_init__(self):
        checks = [
            (self.temp >= 0, f"temperature must be >= 0, got {self.temp}"),
            (0 < self.top_p <= 1, f"top-p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top-k must be >= 0, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min-p must be in [0, 1], got {self.min_p}"),
            (
                self.repetition_penalty is None or self.repetition_penalty > 0,
                f"repetition penalty must be > 0, got {self.repetition_penalty}",
            ),
            (0 <= self.xtc_probability <= 1, f"XTC probability must be in [0, 1], got {self.xtc_probability}"),
            (0 <= self.xtc_threshold <= 0.5, f"XTC threshold must be in [0, 0.5], got {self.xtc_threshold}"),
            (
                self.logprobs is None or 0 <= self.logprobs <= 20,
                f"top logprobs must be in [0, 20], got {self.logprobs}",
            ),
        ]
        for name in ("repetition", "presence", "frequency"):
            size = getattr(self, f"{name}_context_size")
            checks.append((size >= 1, f"{name} context size must be >= 1, got {size}"))
        for ok, message in checks:
            if not ok:
                raise UserError(message)

    @property
    def reads_tokens(self) -> bool:
        """Whether a choice depends on the tokens before it (a penalty)."""
        return self.repetition_penalty is not None or bool(self.presence_penalty) or bool(self.frequency_penalty)


MASK64 = (1 << 64) - 1


class Greedy(Chooser):
    """The default chooser: the argmax of the raw logits, (B, N, V) -> (B, N)."""

    def __call__(self, logits: mx.array, history: TokenHistory, logprobs: Optional[int] = None):
        choice = mx.argmax(logits, axis=-1)
        return choice if logprobs is None else (choice, *top_logprobs(logits.astype(mx.float32), choice, logprobs))


greedy = Greedy()


def row_seed(seed: int, index: int) -> int:
    """The seed of the prompt at ``index`` of an input list (a batch, a
    prompts file) sampled with ``seed``: a 64-bit mix of both (splitmix64's
    finaliser over seed + index * 2**64 / golden ratio), so that copies of
    one prompt draw independent samples, while each prompt's tokens depend
    only on (seed, index), never on the batch it ran in."""
    x = (seed + (index + 1) * 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _mix(x: mx.array) -> mx.array:
    """A 32-bit integer finaliser (murmur3's): every input bit affects every
    output bit."""
    x = x ^ (x >> 16)
    x = x * mx.array(0x85EBCA6B, mx.uint32)
    x = x ^ (x >> 13)
    x = x * mx.array(0xC2B2AE35, mx.uint32)
    return x ^ (x >> 16)


def gumbel_noise(seeds: list, positions: mx.array, vocab_size: int) -> mx.array:
    """Standard Gumbel noise (B, N, vocab_size), a pure function of each
    row's seed (B seeds), each position in ``positions`` (B, N) and the
    vocabulary index."""
    vocab = mx.arange(vocab_size, dtype=mx.uint32)
    low = mx.array([s & 0xFFFFFFFF for s in seeds], mx.uint32)
    high = mx.array([(s >> 32) & 0xFFFFFFFF for s in seeds], mx.uint32)
    key = _mix(_mix(low + mx.array(0x9E3779B9, mx.uint32)) ^ high)[:, None, None]
    x = _mix(key ^ _mix(positions.astype(mx.uint32)[..., None] * mx.array(0x27D4EB2F, mx.uint32) + 1))
    x = _mix(x ^ (vocab * mx.array(0x165667B1, mx.uint32)))
    return -mx.log(-mx.log(open_uniform(x)))


def open_uniform(bits: mx.array) -> mx.array:
    """uint32 hash values -> float32 uniforms strictly inside (0, 1).

    Only the top 23 bits are used: (k + 0.5) / 2**23 for k < 2**23 is exact
    in float32 (float32 has 24 significant bits), from 2**-24 up to
    1 - 2**-24. With 24 bits the largest value, (2**24 - 0.5) / 2**24, is
    not a float32 and rounds to 1.0: its Gumbel noise is +inf, and that
    token wins whatever its probability, even a filtered one.
    """
    return ((bits >> 9).astype(mx.float32) + 0.5) / float(1 << 23)


def history_windows(history: TokenHistory, size: int) -> mx.array:
    """The last ``size`` tokens before each node's successor, (B, N, size),
    -1 where the history is shorter: the row's context, then the node's
    ancestors below the root (the root is the context's last token)."""
    tails = [c[-size:] for c in history.context]
    context = mx.array([[-1] * (size - len(t)) + t for t in tails], mx.int32)  # (B, size)
    if history.node_tokens is None:
        return context[:, None, :]
    tokens, mask, depths = history.node_tokens, history.node_mask, history.node_depths
    num_nodes = tokens.shape[1]
    # path[b, n, j]: token of n's ancestor at depth j + 1, or -1.
    at_depth = depths[:, None, :, None] == mx.arange(1, num_nodes)  # (B, 1, N(m), N-1)
    owns = mask[..., None] & at_depth  # (B, N(n), N(m), N-1)
    path = (owns * (tokens[:, None, :, None] + 1)).sum(axis=2) - 1  # (B, N, N-1)
    sequence = mx.concatenate([mx.broadcast_to(context[:, None], (*tokens.shape, size)), path], -1)
    index = depths[..., None] + mx.arange(size)  # skip as many context tokens as the path adds
    return mx.take_along_axis(sequence, index, axis=-1)


def apply_repetition_penalty(logits: mx.array, windows: mx.array, penalty: float) -> mx.array:
    """mlx-lm's sign-aware repetition penalty on the tokens of each node's
    window. logits (B, N, V), windows (B, N, K) with -1 for no token."""
    index = mx.maximum(windows, 0)
    selected = mx.take_along_axis(logits, index, axis=-1)
    penalised = mx.where(selected < 0, selected * penalty, selected / penalty)
    penalised = mx.where(windows >= 0, penalised, selected)
    return mx.put_along_axis(logits, index, penalised, axis=-1)


def window_counts(windows: mx.array, vocab: int) -> mx.array:
    """How often each token occurs in each node's window: (B, N, K) with -1
    for no token -> (B, N, vocab)."""
    batch, nodes, size = windows.shape
    flat = windows.reshape(-1, size)
    rows = mx.broadcast_to(mx.arange(flat.shape[0])[:, None], flat.shape)
    counts = (
        mx.zeros((flat.shape[0], vocab), mx.float32).at[rows, mx.maximum(flat, 0)].add((flat >= 0).astype(mx.float32))
    )
    return counts.reshape(batch, nodes, vocab)


def xtc_coins(seeds: list, positions: np.ndarray) -> mx.array:
    """A uniform in (0, 1) per row's seed and position (B, N): XTC's coin,
    drawn like the Gumbel noise (apart from it), so that sampling with XTC
    stays a pure function of seed and position."""
    low = mx.array([s & 0xFFFFFFFF for s in seeds], mx.uint32)
    high = mx.array([(s >> 32) & 0xFFFFFFFF for s in seeds], mx.uint32)
    key = _mix(_mix(low + mx.array(0x7F4A7C15, mx.uint32)) ^ high)[:, None]
    return open_uniform(_mix(key ^ _mix(mx.array(positions, mx.uint32) * mx.array(0x27D4EB2F, mx.uint32) + 7)))


def apply_xtc(logprobs: mx.array, coins: mx.array, settings: SamplingSettings) -> mx.array:
    """mlx-lm's XTC on (R, V) log-probabilities with one coin per row (R,)."""
    probs = mx.softmax(logprobs, axis=-1)
    least = mx.where(probs > settings.xtc_threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    mask = probs > least
    if settings.xtc_special_tokens:
        mask[..., list(settings.xtc_special_tokens)] = False
    return mx.where(coins[:, None] > settings.xtc_probability, logprobs, mx.where(mask, -mx.inf, logprobs))


def top_logprobs(logits: mx.array, choice: mx.array, count: int) -> tuple:
    """(chosen (B, N), top ids (B, N, count), top log-probabilities (B, N, count)):
    the log-softmax of ``logits`` at the chosen tokens and its ``count``
    largest entries, best first."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, choice[..., None], axis=-1)[..., 0]
    if count == 0:
        empty = mx.zeros((*choice.shape, 0))
        return chosen, empty.astype(mx.int32), empty
    top = mx.argpartition(-logprobs, kth=count - 1, axis=-1)[..., :count]
    values = mx.take_along_axis(logprobs, top, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return chosen, mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(values, order, axis=-1)


def positions_of(history: TokenHistory, shape: tuple) -> np.ndarray:
    """(B, N) sequence position of the token chosen after each node."""
    positions = np.array([len(c) for c in history.context], np.int64)[:, None]
    if history.node_depths is not None:
        positions = positions + np.array(history.node_depths)
    return np.broadcast_to(positions, shape)


class Sampler(Chooser):
    """The choice ``SamplingSettings`` describe: mlx-lm's processors and
    filters, then the argmax (temperature 0) or one Gumbel-max sample per
    node (see the module docstring)."""

    def __init__(self, settings: SamplingSettings):
        self.settings = settings
        self.reads_tokens = settings.reads_tokens
        self.logprobs_wanted = settings.logprobs
        self.filters = []
        if settings.top_p < 1:
            self.filters.append(lambda x, coins: apply_top_p(x, settings.top_p))
        if settings.min_p > 0:
            self.filters.append(lambda x, coins: apply_min_p(x, settings.min_p))
        if settings.xtc_probability > 0:
            self.filters.append(lambda x, coins: apply_xtc(x, coins, settings))
        if settings.top_k > 0:
            self.filters.append(lambda x, coins: apply_top_k(x, settings.top_k))
        self.bias = None
        if settings.logit_bias:
            self.bias = (mx.array(list(settings.logit_bias)), mx.array(list(settings.logit_bias.values()), mx.float32))
        self.noise = {}  # (seed, position, vocab) -> Gumbel noise (vocab,), kept while calls still ask for it

    def is_sampled(self, row: int) -> bool:
        return self.settings.temp > 0

    def seed_of(self, row: int) -> int:
        settings = self.settings
        if settings.row_seeds is None:
            return row_seed(settings.seed, row)
        if row >= len(settings.row_seeds):
            raise UserError(f"row_seeds holds {len(settings.row_seeds)} seeds, but prompt {row} is being sampled")
        return settings.row_seeds[row]

    def noise_at(self, seeds: list, positions: np.ndarray, vocab: int) -> mx.array:
        """Noise (B, N, vocab) for each row's seed at each of its positions
        (B, N). Each (seed, position) is drawn once and reused while
        consecutive calls ask for it (the nodes of the next step stand
        where this step's deeper nodes stood)."""
        noise = self.noise
        keys = [(seed, int(p), vocab) for seed, row in zip(seeds, positions) for p in row]
        missing = [k for k in dict.fromkeys(keys) if k not in noise]
        if missing:
            fresh = gumbel_noise([k[0] for k in missing], mx.array([[k[1]] for k in missing], mx.int32), vocab)
            noise.update((k, fresh[i, 0]) for i, k in enumerate(missing))
        for key in noise.keys() - set(keys):
            del noise[key]
        return mx.stack([noise[k] for k in keys]).reshape(*positions.shape, vocab)

    def process(self, logits: mx.array, history: TokenHistory, positions: np.ndarray) -> mx.array:
        """The logits processors, in mlx-lm's order."""
        settings = self.settings
        logits = logits.astype(mx.float32)
        if self.bias is not None:
            logits = logits.at[..., self.bias[0]].add(self.bias[1])
        if settings.repetition_penalty is not None:
            windows = history_windows(history, settings.repetition_context_size)
            logits = apply_repetition_penalty(logits, windows, settings.repetition_penalty)
        vocab = logits.shape[-1]
        if settings.presence_penalty:
            present = window_counts(history_windows(history, settings.presence_context_size), vocab) > 0
            logits = logits - settings.presence_penalty * present
        if settings.frequency_penalty:
            logits = logits - settings.frequency_penalty * window_counts(
                history_windows(history, settings.frequency_context_size), vocab
            )
        if settings.forced:
            index = positions - settings.forced_at
            inside = (index >= 0) & (index < len(settings.forced))
            if inside.any():
                forced = np.where(inside, np.array(settings.forced)[np.clip(index, 0, len(settings.forced) - 1)], -1)
                forced = mx.array(forced, mx.int32)[..., None]
                logits = mx.where((forced >= 0) & (mx.arange(vocab) != forced), -mx.inf, logits)
        return logits

    def __call__(self, logits: mx.array, history: TokenHistory, logprobs: Optional[int] = None):
        settings = self.settings
        batch, nodes, vocab = logits.shape
        positions = positions_of(history, (batch, nodes))
        logits = self.process(logits, history, positions)
        if settings.temp == 0:
            choice = mx.argmax(logits, axis=-1)
        else:
            # Log-probabilities up to a per-node constant, which neither the
            # filters (top-p divides by the total mass) nor the argmax see; the
            # maximum is 0, so exp() cannot overflow. Cheaper than a logsumexp.
            filtered = (logits - logits.max(axis=-1, keepdims=True)).reshape(-1, vocab)
            seeds = [self.seed_of(r) for r in history.rows]
            coins = xtc_coins(seeds, positions).reshape(-1) if settings.xtc_probability > 0 else None
            for apply_filter in self.filters:
                filtered = apply_filter(filtered, coins)
            choice = mx.argmax(
                filtered.reshape(batch, nodes, vocab) / settings.temp + self.noise_at(seeds, positions, vocab), axis=-1
            )
        if logprobs is None:
            return choice
        return (choice, *top_logprobs(logits, choice, logprobs))


def make_chooser(settings: SamplingSettings) -> Chooser:
    """The chooser for these settings: (logits (B, N, V), history) -> (B, N)
    token ids; with ``logprobs=K`` it also returns ``top_logprobs``'s arrays
    for K alternatives."""
    return Sampler(settings)


class PerPrompt(Chooser):
    """A chooser for a batch whose prompts have settings of their own:
    ``choosers`` maps each prompt's id (``TokenHistory.rows``) to its
    chooser, which sees the prompt as prompt 0 of a list of its own (so a
    seeded prompt samples as it would alone). The dict may change between
    calls, as prompts join and leave."""

    def __init__(self, choosers: dict):
        self.choosers = choosers

    def __call__(self, logits: mx.array, history: TokenHistory, logprobs: Optional[int] = None):
        chosen = []
        for i, row in enumerate(history.rows):
            nodes = [
                None if a is None else a[i : i + 1]
                for a in (history.node_tokens, history.node_mask, history.node_depths)
            ]
            row_history = TokenHistory([0], [history.context[i]], *nodes)
            if logprobs is None:
                chosen.append(self.choosers[row](logits[i : i + 1], row_history))
            else:
                chosen.append(self.choosers[row](logits[i : i + 1], row_history, logprobs=logprobs))
        if logprobs is None:
            return mx.concatenate(chosen)
        return tuple(mx.concatenate(parts) for parts in zip(*chosen))

    @property
    def logprobs_wanted(self) -> Optional[int]:
        wanted = [c.logprobs_wanted for c in self.choosers.values() if c.logprobs_wanted is not None]
        return max(wanted) if wanted else None

    @property
    def reads_tokens(self) -> bool:
        return any(c.reads_tokens for c in self.choosers.values())

    def is_sampled(self, row: int) -> bool:
        return self.choosers[row].is_sampled(0)


def chooser_per_prompt(choosers: dict) -> Chooser:
    """``PerPrompt(choosers)``: each prompt of the batch chooses by its own."""
    return PerPrompt(choosers)


def node_paths(history: TokenHistory) -> list:
    """Per row, per node, the tokens a token choice at that node follows:
    the row's context, then the node's path below the root (its ancestors
    of depth >= 1 and itself, in order). At prefill (no nodes), one entry
    per row: the context."""
    if history.node_tokens is None:
        return [[list(context)] for context in history.context]
    tokens, mask, depths = (np.array(a) for a in (history.node_tokens, history.node_mask, history.node_depths))
    paths = []
    for b, context in enumerate(history.context):
        row = []
        for j in range(tokens.shape[1]):
            below_root = [i for i in np.nonzero(mask[b, j])[0] if depths[b, i] >= 1]
            row.append(list(context) + [int(tokens[b, i]) for i in sorted(below_root, key=lambda i: depths[b, i])])
        paths.append(row)
    return paths


class AppSampler(Chooser):
    """An app's own mlx-lm ``sampler`` and ``logits_processors``
    (``mlx_lm.sample_utils.make_sampler`` / ``make_logits_processors`` or
    any functions of their shapes), as a chooser.

    Each node's logits go through the processors with that node's own
    tokens (``node_paths``: the context and the node's path, as mlx-lm's
    loop gives them, the node's token last), are normalised to
    log-probabilities, and the sampler draws the node's token from them
    (None: the argmax, mlx-lm's default). Every node draws on its own, so
    the acceptance walk, which follows the drawn child, emits exactly what
    the sampler would draw token by token: it needs the draws, never the
    sampler's probabilities, which an opaque sampler does not give.

    distributions: keep each call's log-probabilities (B, N, V) in
    ``last_distributions`` (lazy), which mlx-lm reports with each token.
    starts: per prompt (its index in the input list, ``TokenHistory.rows``),
    where the tokens the processors see begin: mlx-lm's processors see the
    prompt given to that call and what it generated, not the conversation
    a prompt cache held before it (default: from the first token)."""

    def __init__(
        self,
        sampler: Optional[Callable] = None,
        logits_processors: Optional[Sequence[Callable]] = None,
        distributions: bool = False,
        starts: Optional[Sequence[int]] = None,
    ):
        self.sampler = sampler
        self.processors = list(logits_processors or ())
        self.starts = starts
        self.keeps_distributions = distributions
        self.last_distributions: Optional[mx.array] = None

    @property
    def reads_tokens(self) -> bool:
        return bool(self.processors)

    def is_sampled(self, row: int) -> bool:
        return self.sampler is not None

    def process(self, logits: mx.array, history: TokenHistory) -> mx.array:
        """The processors applied at every node: (B, N, V) -> (B, N, V)."""
        if not self.processors:
            return logits
        rows = []
        for b, paths in enumerate(node_paths(history)):
            start = 0 if self.starts is None else self.starts[history.rows[b]]
            nodes = []
            for j, path in enumerate(paths):
                node = logits[b, j][None]
                tokens = mx.array(path[start:], mx.int32)
                for processor in self.processors:
                    node = processor(tokens, node)
                nodes.append(node[0])
            rows.append(mx.stack(nodes))
        return mx.stack(rows)

    def __call__(self, logits: mx.array, history: TokenHistory, logprobs: Optional[int] = None):
        logits = self.process(logits, history)
        batch, nodes, vocab = logits.shape
        log_probs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.sampler is None:
            choice = mx.argmax(log_probs, axis=-1)
        else:
            choice = self.sampler(log_probs.reshape(batch * nodes, vocab)).reshape(batch, nodes)
        if self.keeps_distributions:
            self.last_distributions = log_probs
        return choice if logprobs is None else (choice, *top_logprobs(log_probs.astype(mx.float32), choice, logprobs))
