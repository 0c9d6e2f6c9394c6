"""The server's memory of finished requests' prompt caches, so that the next
turn of a conversation prefills only its new message, and a new
conversation only what it does not share with an earlier one (an agent's
instructions and tool schemas, the same in every session)."""

from typing import Optional, Sequence

from ..engine.prompt_cache import PromptCache


class PromptCacheStore:
    """Prompt caches of finished requests, for requests whose prompts begin
    like one of them, in at most ``max_bytes`` of keys and values.

    ``find`` gives the cache sharing the longest prefix with a prompt. When
    a prompt takes only the start of a cache and goes on differently, that
    start is a prefix conversations share (``shared``). Over the memory
    bound, the tails beyond those shared prefixes go first, least recently
    used first (a finished session's own turns), then whole caches, least
    recently used first and shared prefixes last; a cache larger than the
    whole store keeps the start that fits.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
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
        if not reused:
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
        """Free some memory: a tail beyond a shared prefix (that prefix kept
        once: where another cache holds it, it is now known as shared there),
        else a whole cache."""
        for entry in self.entries:
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
        prefixes = [e for e in self.entries if self.shared.get(id(e), 0) >= len(e)]
        self._remove(next((e for e in self.entries if e not in prefixes), self.entries[0]))

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
