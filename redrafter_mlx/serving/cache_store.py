"""The server's memory of finished requests' prompt caches, so that the next
turn of a conversation prefills only its new message."""

from typing import Optional, Sequence

from ..engine.prompt_cache import PromptCache


class PromptCacheStore:
    """Prompt caches of finished requests, for requests whose prompts begin
    with one of them (the next turn of a conversation), in at most
    ``max_bytes`` of keys and values; the least recently used go first."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: list[PromptCache] = []  # least recently used first
        self.nbytes = 0

    def find(self, prompt: Sequence[int]) -> Optional[PromptCache]:
        """The cache sharing the longest prefix with ``prompt``, if any."""
        best = max(self.entries, key=lambda c: c.reusable(prompt), default=None)
        if best is None or best.reusable(prompt) == 0:
            return None
        self.entries.remove(best)
        self.entries.append(best)
        return best

    def add(self, cache: PromptCache) -> None:
        """Keep a copy of ``cache``; caches it extends are dropped, and the
        oldest ones while over the limit. One larger than the limit is not
        kept."""
        if not cache.tokens or cache.nbytes > self.max_bytes:
            return
        cache = cache.compact()
        tokens = cache.tokens
        for old in [c for c in self.entries if c.tokens == tokens[: len(c.tokens)]]:
            self._remove(old)
        self.entries.append(cache)
        self.nbytes += cache.nbytes
        while self.nbytes > self.max_bytes:
            self._remove(self.entries[0])

    def _remove(self, cache: PromptCache) -> None:
        self.entries.remove(cache)
        self.nbytes -= cache.nbytes
