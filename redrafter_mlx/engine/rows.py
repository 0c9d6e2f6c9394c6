"""Which prompts of a batch are still generating, and what each produced."""

from typing import Optional, Sequence

from ..drafting.tree import Tree
from .types import StepOutput, TokenHistory


class RowTracker:
    """Which prompts of a batch are still generating, what each produced, and
    when each stops (EOS, which is not emitted, or its max_tokens).

    Prompts are named by the index ``add`` gives them (0, 1, ... in the order
    added). rows: the index of each active batch row, in batch order.
    context: per prompt, the prompt followed by its emitted tokens.
    ids: per prompt, its index in the caller's whole input list
    (``TokenHistory.rows``), which per-prompt sampling seeds follow.
    """

    def __init__(
        self, prompts: Sequence[Sequence[int]], max_tokens: int, eos_token_ids: Sequence[int], rows=None, ids=None
    ):
        self.eos = set(eos_token_ids)
        self.context, self.ids, self.produced, self.max_tokens = {}, {}, {}, {}
        self.added = 0
        for prompt, id in zip(prompts, range(len(prompts)) if ids is None else ids):
            self.add(prompt, max_tokens, id)
        self.rows = list(range(len(prompts))) if rows is None else list(rows)

    def add(self, prompt: Sequence[int], max_tokens: int, id: int) -> int:
        """Track one more prompt (not yet a batch row); returns its index."""
        index, self.added = self.added, self.added + 1
        self.context[index], self.ids[index] = list(prompt), id
        self.produced[index], self.max_tokens[index] = 0, max_tokens
        return index

    def forget(self, index: int) -> None:
        for table in (self.context, self.ids, self.produced, self.max_tokens):
            del table[index]

    def history(self, tree: Optional[Tree] = None, rows: Optional[list] = None) -> TokenHistory:
        rows = self.rows if rows is None else rows
        context = [self.context[r] for r in rows]
        ids = [self.ids[r] for r in rows]
        if tree is None:
            return TokenHistory(ids, context)
        return TokenHistory(ids, context, tree.tokens, tree.mask, tree.depths)

    def emit(
        self,
        tokens_per_row: list,
        num_accepted: Optional[list] = None,
        num_nodes: Optional[list] = None,
        rows: Optional[list] = None,
        logprobs: Optional[list] = None,
        distributions: Optional[list] = None,
    ) -> list[StepOutput]:
        """Record each row's new tokens (rows: default the active rows), cut
        at EOS and max_tokens; ``logprobs``, per row, one entry per token
        (``StepOutput.logprobs``), and ``distributions``, per row, an array
        with one row per token (``StepOutput.distributions``), cut alike."""
        outputs = []
        for i, (row, tokens) in enumerate(zip(self.rows if rows is None else rows, tokens_per_row)):
            # An EOS counts only within the row's room: one drafted past
            # max_tokens would never have been generated (a "length" end).
            room = self.max_tokens[row] - self.produced[row]
            eos_at = next((j for j, token in enumerate(tokens[:room]) if token in self.eos), None)
            finish = stop_token = None
            if eos_at is not None:
                tokens, finish, stop_token = tokens[:eos_at], "stop", tokens[eos_at]
            elif len(tokens) >= room:
                tokens, finish = tokens[:room], "length"
            self.context[row].extend(tokens)
            self.produced[row] += len(tokens)
            accepted = None if num_accepted is None else num_accepted[i]
            nodes = None if num_nodes is None else num_nodes[i]
            row_logprobs = None if logprobs is None else logprobs[i][: len(tokens)]
            row_distributions = None if distributions is None else distributions[i][: len(tokens)]
            outputs.append(
                StepOutput(
                    row,
                    tokens,
                    accepted,
                    finish,
                    num_nodes=nodes,
                    logprobs=row_logprobs,
                    stop_token=stop_token,
                    distributions=row_distributions,
                )
            )
        return outputs

    def keep_unfinished(self, outputs: list[StepOutput]) -> Optional[list[int]]:
        """Drop finished rows; returns the batch indices kept, or None when
        every row goes on."""
        done = {out.row for out in outputs if out.finish_reason is not None}
        return self.keep([r for r in self.rows if r not in done])

    def keep(self, rows: list) -> Optional[list[int]]:
        """Keep only these active rows (in batch order); returns the batch
        indices kept, or None when that is every row."""
        if len(rows) == len(self.rows):
            return None
        kept = set(rows)
        keep = [i for i, r in enumerate(self.rows) if r in kept]
        self.rows = [self.rows[i] for i in keep]
        return keep
