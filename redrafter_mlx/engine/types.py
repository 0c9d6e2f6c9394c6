"""The engine's shared types: the model pair it runs, what a token choice
may read, and what a step gives each row."""

from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import numpy as np

from ..drafting.answers import AnswerStore
from ..drafting.budget import AcceptanceStats
from ..drafting.datastore import Datastore
from ..drafting.drafter import Drafter
from .base_model import BaseModel
from .prompt_cache import PromptCache


@dataclass
class ReDrafter:
    """A base model and its drafter (None: context lookup only).

    identity, drafter_identity: digests naming the exact model and drafter
    (``loading.loader.model_identity``), which key the cached cost curves.
    acceptance: what this pair's runs so far had accepted, per draft source
    and depth; each run starts from it (``drafting.speculator.Speculator``).
    datastore: the drafter's datastore, if it has one.
    answers: a store of the answers this process produced, which steps also
    draft from (``drafting.answers``; None: none). Every finished row's
    answer joins it.
    generation_config: the sampling settings the model's folder recommends
    (its ``generation_config.json``; empty when it has none).
    """

    base: BaseModel
    drafter: Optional[Drafter]
    identity: str = ""
    drafter_identity: str = ""
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats, repr=False, compare=False)
    datastore: Optional[Datastore] = field(default=None, repr=False, compare=False)
    answers: Optional[AnswerStore] = field(default=None, repr=False, compare=False)
    generation_config: dict = field(default_factory=dict, repr=False, compare=False)

    def make_cache(self) -> PromptCache:
        """An empty prompt cache: what mlx-lm's ``make_prompt_cache(model)``
        returns for this pair, so that an app written for mlx-lm passes it
        unchanged."""
        return PromptCache()


@dataclass
class TokenHistory:
    """What a node's token choice may depend on besides its logits.

    rows: per batch row, the index of its prompt in the input list.
    context: per row, the prompt and all tokens committed so far (host lists).
    node_tokens: (B, N) tokens of the nodes being scored (None at prefill).
    node_mask: (B, N, N) ancestor-or-self mask of those nodes (None at prefill).
    node_depths: (B, N) their depths; the root is the context's last token.
    """

    rows: list
    context: list
    node_tokens: Optional[mx.array] = None
    node_mask: Optional[mx.array] = None
    node_depths: Optional[mx.array] = None


class Chooser:
    """How the base model's token after every node is chosen.

    ``choose(logits (B, N, vocab), history)`` -> (B, N) token ids; with
    ``logprobs=K`` it returns (ids, chosen log-probabilities (B, N), top
    ids (B, N, K), top log-probabilities (B, N, K)) instead. The history
    gives each row's context and each node's ancestors, for processors that
    read them.

    What the engine asks besides: ``is_sampled(row)``, whether a prompt is
    sampled (its drafts are judged apart from greedy ones);
    ``reads_tokens``, whether a choice reads the history's tokens (then a
    plain pass cannot be issued before the last token is known);
    ``logprobs_wanted``, how many alternatives' log-probabilities to report
    (None: none); ``keeps_distributions``, whether each call leaves the
    whole log-probability vector of every node it chose at in
    ``last_distributions`` (B, N, vocab), lazy, which the engine takes
    right after the call (``StepOutput.distributions``). The defaults are a
    greedy choice's.
    """

    reads_tokens: bool = False
    logprobs_wanted: Optional[int] = None
    keeps_distributions: bool = False
    last_distributions: Optional[mx.array] = None

    def is_sampled(self, row: int) -> bool:
        return False

    def __call__(self, logits: mx.array, history: TokenHistory, logprobs: Optional[int] = None):
        raise NotImplementedError


@dataclass
class StepOutput:
    """What one step (or the prefill) produced for one row.

    row: index of the prompt in the input list.
    tokens: new token ids, already cut at EOS (which is not included) and
        at max_tokens.
    num_accepted: drafted tokens the base model accepted in this step (None
        for the first token, which comes from the prefill).
    finish_reason: None while the row goes on, else "stop" or "length".
    hidden: (len(tokens), hidden_size) float16, the base model's hidden state
        from which each token was chosen; only when asked for.
    num_nodes: tree nodes this step verified for the row, the root included
        (None for the first token).
    logprobs: per token, (its log-probability, [(token id, log-probability)
        of the most likely alternatives]), when the token choice reports
        them (``SamplingSettings.logprobs``).
    stop_token: the end-of-sequence token that ended the row ("stop"),
        which ``tokens`` leaves out.
    distributions: (len(tokens), vocab) the log-probabilities each token
        was chosen from (lazy), when the chooser keeps them
        (``Chooser.keeps_distributions``).
    """

    row: int
    tokens: list
    num_accepted: Optional[int]
    finish_reason: Optional[str] = None
    hidden: Optional[np.ndarray] = None
    num_nodes: Optional[int] = None
    logprobs: Optional[list] = None
    stop_token: Optional[int] = None
    distributions: Optional[mx.array] = None
