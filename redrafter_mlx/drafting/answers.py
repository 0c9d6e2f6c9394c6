"""What the model wrote before, drafted again: a bounded store of the answers
produced in this process (earlier turns of a chat, other requests to a
server), proposing what followed the context's last tokens in them, as
SuffixDecoding does across requests.

It works like the drafter's datastore (``datastore.py``) but grows while the
process runs: each finished answer is added, the oldest answers go when the
store is over its size, and an n-gram index (n = 1 .. ``MAX_NGRAM``) keeps,
per n-gram, the latest positions that followed it. Its drafts are
deterministic given the store, so they join the tree like any other and the
output stays exactly the model's.
"""

from collections import Counter
from typing import Optional

MAX_NGRAM = 4  # longest context suffix matched
KEPT = 16  # latest occurrences kept per n-gram
BOUNDARY = -1  # between answers: nothing is matched or continued across it
BYTES_PER_TOKEN = 768  # a token with its n-gram index entries, as Python holds them (tracemalloc, random tokens)


class AnswerStore:
    """Answers back to back, at most ``max_tokens`` of them (oldest out first).

    ``propose(context, length, beams)`` returns what ``Datastore.propose``
    returns: (tokens, shares, n) per continuation, most frequent first.
    """

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.tokens: list = []
        self.first = 0  # absolute position of tokens[0]
        self.index: dict = {}  # n-gram -> absolute positions just after its latest occurrences, newest last

    def __len__(self) -> int:
        return sum(t != BOUNDARY for t in self.tokens)

    def add(self, answer: list) -> None:
        """Add one finished answer (token ids); too short to continue, or
        larger than the store, it is not kept."""
        if len(answer) < 2 or len(answer) + 1 > self.max_tokens:
            return
        start = self.first + len(self.tokens)
        self.tokens.extend(answer)
        self.tokens.append(BOUNDARY)
        for end in range(len(answer) - 1):  # n-grams ending at answer[end], followed by answer[end + 1]
            for n in range(1, min(MAX_NGRAM, end + 1) + 1):
                follow = self.index.setdefault(tuple(answer[end - n + 1 : end + 1]), [])
                follow.append(start + end + 1)
                if len(follow) > KEPT:
                    del follow[0]
        if len(self.tokens) > self.max_tokens:
            self._evict()

    def _evict(self) -> None:
        """Drop the oldest answers down to three quarters of the limit, then
        rebuild the index over the rest (so eviction costs little per token)."""
        keep_from = len(self.tokens) - self.max_tokens * 3 // 4
        cut = self.tokens.index(BOUNDARY, keep_from) + 1 if BOUNDARY in self.tokens[keep_from:] else len(self.tokens)
        rest = self.tokens[cut:]
        self.tokens, self.first, self.index = [], self.first + cut, {}
        answer = []
        for token in rest:
            if token == BOUNDARY:
                self.add(answer)
                answer = []
            else:
                answer.append(token)

    def propose(self, context: list, length: int, beams: int = 1) -> list[tuple[list, list, int]]:
        """Up to ``beams`` continuations of at most ``length`` tokens after
        the longest suffix of ``context`` (up to ``MAX_NGRAM`` tokens) seen in
        the store: the most frequent next tokens, each followed by the most
        frequent token after it, and so on; shares count one unseen
        occurrence more, as the datastore's do."""
        for n in range(min(MAX_NGRAM, len(context)), 0, -1):
            found = [p - self.first for p in self.index.get(tuple(context[-n:]), ()) if p >= self.first]
            if found:
                return self._continuations(found, length, beams, n)
        return []

    def _continuations(self, found: list, length: int, beams: int, n: int) -> list:
        spans = []
        for p in found:
            span = []
            for token in self.tokens[p : p + length]:
                if token == BOUNDARY:
                    break
                span.append(token)
            if span:
                spans.append(span)
        proposals = []
        for first, count in Counter(s[0] for s in spans).most_common(beams):
            rows = [s for s in spans if s[0] == first]
            tokens, shares = [first], [count / (len(spans) + 1)]
            for depth in range(1, length):
                column = Counter(s[depth] for s in rows if len(s) > depth)
                if not column:
                    break
                token, seen = column.most_common(1)[0]
                shares.append(seen / (len(rows) + 1))
                tokens.append(token)
                rows = [s for s in rows if len(s) > depth and s[depth] == token]
            proposals.append((tokens, shares, n))
        return proposals


def answer_store(megabytes: Optional[float]) -> Optional[AnswerStore]:
    """A store of about ``megabytes`` of token ids (None or 0: none)."""
    if not megabytes:
        return None
    return AnswerStore(int(megabytes * 2**20 / BYTES_PER_TOKEN))
