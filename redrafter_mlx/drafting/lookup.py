"""Context lookup: draft by copying what followed the latest earlier
occurrence of the context's last n tokens (prompt lookup decoding).

The RNN drafter reads only the last hidden state and cannot copy; text that
repeats its prompt or itself (code, lists, quotes, names) is exactly where a
lookup is right. Its draft joins the RNN's beams in the same prefix tree.
"""


class LookupIndex:
    """An incremental n-gram index over one row's context.

    ``tokens`` is the row's context list (prompt, then every committed token),
    which the caller appends to; the index reads it, never writes it. For
    every n-gram (n = 1 .. max_ngram) that ended at an earlier position it
    keeps the position just after its latest occurrence. Each new token
    costs ``max_ngram`` dictionary updates, whatever the context's length.
    """

    def __init__(self, tokens: list, max_ngram: int = 3):
        self.tokens = tokens
        self.max_ngram = max_ngram
        self.table: dict = {}
        self.indexed = 0  # n-grams ending before this position are in the table

    def _catch_up(self) -> None:
        # The n-grams ending at the last token are not indexed yet: nothing
        # follows them, and they are the suffix being looked up.
        tokens = self.tokens
        for end in range(self.indexed, len(tokens) - 1):
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self.table[tuple(tokens[end - n + 1 : end + 1])] = end + 1
        self.indexed = max(self.indexed, len(tokens) - 1)

    def propose(self, length: int) -> list[tuple[list, int]]:
        """The continuation of at most ``length`` tokens that followed the
        latest earlier occurrence of the context's longest matching suffix,
        as ``[(tokens, n)]`` (n the suffix's length), or ``[]`` when no
        suffix occurred before."""
        self._catch_up()
        tokens = self.tokens
        for n in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            start = self.table.get(tuple(tokens[-n:]))
            if start is not None:
                return [(tokens[start : start + length], n)]
        return []
