"""The server's memory of finished requests' prompt caches, so that the next
turn of a conversation prefills only its new message, and a new
conversation only what it does not share with an earlier one (an agent's
instructions and tool schemas, the same in every session)."""

from typing import Optional, Sequence

from ..engine.prompt_cache import PromptCache

MIN_REUSE = 8  # tokens: a shorter common start (a start-of-sequence token, a template's first turn header) is no match


class PromptCacheStore:
    """Prompt caches of finished requests, for requests whose prompts begin
    like one of them, in at most ``max_bytes`` of keys and values.

    ``find`` gives the cache sharing the longest prefix with a prompt, if
    it shares at least ``min_reuse`` tokens (a prompt that shares only what
    every prompt begins with neither uses nor refreshes a cache, so it
    cannot make a session's latest turn look older than an earlier one). When
    a prompt takes only the start of a cache and goes on differently, that
    start is a prefix conversations share (``shared``). Over the memory
    bound, caches go least recently used first, each down to its shared
    prefix (a finished session's own turns) or whole if it shares none;
    shared prefixes go last. A cache larger than the whole store keeps the
    start that fits.
    """

    def __init__(self, max_bytes: int, min_reuse: int = MIN_REUSE):
        self.max_bytes, self.min_reuse = max_bytes, min_reuse
        self.entries: list[PromptCache] = []  # least recently used first
        self.shared: dict = {}  # id of an entry -> the longest prefix of it another prompt went on from
        self.nbytes = 0

    def reusable(self, prompt: Sequence[int]) -> int:
        """How many of ``prompt``'s tokens the best entry would serve (nothing changes)."""
        return max((c.reusable(prompt) for c in self.entries), default=0)

    def find(self, prompt: Sequence[int]) -> Optional[PromptCache]:
        """The cache sharing the longest prefix with ``prompt``, if any."""
        best = max(self.entries, key=lambda c: c.reusable(prompt), default=None)
        reused = 0 if best is None else best.reusable(prompt)
        if reused < max(self.min_reuse, 1):
            return None
        if reused < min(len(best), len(prompt) - 1):  # the prompt goes on differently: a shared prefix
            self.shared[id(best)] = max(self.shared.get(id(best), 0), reused)
        self.entries.remove(best)
        self.entries.append(best)
        return best

    def add(self, cache: PromptCache) -> None:
        """Keep a copy of ``cache``; caches it extends are dropped, and then
        what the memory bound asks (see the class docstring)."""
        if not cache.tokens or not self.max_bytes:
            return
        if cache.nbytes > self.max_bytes:
            if cache.recurrent:
                return
            cache = cache.cut(len(cache) * self.max_bytes // cache.nbytes)
        cache = cache.compact()
        tokens = cache.tokens
        for old in [c for c in self.entries if c.tokens == tokens[: len(c.tokens)]]:
            self.shared[id(cache)] = max(self.shared.get(id(cache), 0), self.shared.get(id(old), 0))
            self._remove(old)
        self.entries.append(cache)
        self.nbytes += cache.nbytes
        while self.nbytes > self.max_bytes:
            self._shrink()

    def _holders(self, entry: PromptCache, length: int) -> list:
        """The other caches that hold ``entry``'s first ``length`` tokens."""
        prefix = entry.tokens[:length] + [-1]
        return [other for other in self.entries if other is not entry and other.reusable(prefix) >= length]

    def _shrink(self) -> None:
        """Free some memory from the least recently used cache that is more
        than a shared prefix: its tail beyond its shared prefix (the whole
        cache where another holds that prefix: it is now known as shared
        there), or the whole of it when it shares nothing. Shared prefixes
        alone go last, least recently used first."""
        entry = next((e for e in self.entries if self.shared.get(id(e), 0) < len(e)), self.entries[0])
        keep = self.shared.get(id(entry), 0)
        if keep and keep < len(entry) and not entry.recurrent:
            holders = self._holders(entry, keep)
            for other in holders:
                self.shared[id(other)] = max(self.shared.get(id(other), 0), keep)
            if holders:
                self._remove(entry)
            else:
                self._replace(entry, entry.cut(keep).compact(), keep)
            return
        self._remove(entry)

    def _replace(self, entry: PromptCache, cut: PromptCache, shared: int) -> None:
        index = self.entries.index(entry)
        self._remove(entry)
        self.entries.insert(index, cut)
        self.shared[id(cut)] = shared
        self.nbytes += cut.nbytes

    def _remove(self, cache: PromptCache) -> None:
        self.entries.remove(cache)
        self.shared.pop(id(cache), None)
        self.nbytes -= cache.nbytes
