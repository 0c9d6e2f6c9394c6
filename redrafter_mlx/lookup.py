"""Context lookup: draft by copying what followed the latest earlier
occurrence of the context's last n tokens (prompt lookup decoding).

The RNN drafter reads only the last hidden state and cannot copy; text that
repeats its prompt or itself (code, lists, quotes, names) is exactly where a
lookup is right. Its drafts join the RNN's beams in the same prefix tree.
"""


class LookupIndex:
    """An incremental n-gram index over one row's context.

    ``tokens`` is the row's context list (prompt, then every committed token),
    which the caller appends to; the index reads it, never writes it. For
    every n-gram (n = 1 .. max_ngram) that ended at an earlier position it
    keeps the positions just after its ``beams`` latest occurrences, most
    recent first. Each new token costs ``max_ngram`` dictionary updates,
    whatever the context's length.
    """

    def __init__(self, tokens: list, max_ngram: int = 3, beams: int = 1):
        self.tokens = tokens
        self.max_ngram = max_ngram
        self.beams = beams
        self.table: dict = {}
        self.indexed = 0  # n-grams ending before this position are in the table

    def _catch_up(self) -> None:
        # The n-grams ending at the last token are not indexed yet: nothing
        # follows them, and they are the suffix being looked up.
        tokens = self.tokens
        for end in range(self.indexed, len(tokens) - 1):
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                follow = self.table.setdefault(tuple(tokens[end - n + 1 : end + 1]), [])
                follow.insert(0, end + 1)
                del follow[self.beams :]
        self.indexed = max(self.indexed, len(tokens) - 1)

    def propose(self, length: int) -> list[tuple[list, int]]:
        """Up to ``beams`` distinct continuations of the context, each of at
        most ``length`` tokens that followed an earlier occurrence of its
        longest matching suffix; returns (tokens, n) pairs, longer matches
        and more recent ones first."""
        self._catch_up()
        tokens, proposals = self.tokens, []
        for n in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            for start in self.table.get(tuple(tokens[-n:]), ()):
                continuation = tokens[start : start + length]
                if continuation and all(continuation != c for c, _ in proposals):
                    proposals.append((continuation, n))
                if len(proposals) == self.beams:
                    return proposals
        return proposals
