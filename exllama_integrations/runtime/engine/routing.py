"""Which engine takes a prompt: the one that already holds its longest prefix, unless it is much busier.

Prompts are cut into blocks of ``block`` tokens and each block is named by a hash of everything up to its
end (a chain), the way paged KV caches name their pages (exllamav3's pages are 256 tokens). An engine
remembers the block names of the prompts it was given (the newest ``memory`` of them), so a follow-up turn,
whose prompt begins with the whole earlier conversation, is sent where that conversation's cache is,
while fresh prompts go to the least loaded engine. Affinity yields to load: an engine busier than the least
loaded by more than ``slack`` requests is passed over. The same router serves ``engines=N`` in one runtime
and Ray's replicas (:mod:`~exllama_integrations.serve.ray.router`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BLOCK = 256


def block_hashes(ids: Sequence[int], block: int = BLOCK) -> list[int]:
    """The chained names of a prompt's whole blocks (a prompt shorter than one block has none)."""
    out: list[int] = []
    h = 0
    for end in range(block, len(ids) + 1, block):
        h = hash((h, tuple(ids[end - block : end])))
        out.append(h)
    return out


class PrefixRouter:
    """Engine choice by prefix and load (see the module docstring); not thread-safe: its owner locks."""

    def __init__(self, n: int, block: int = BLOCK, slack: int = 4, memory: int = 65536) -> None:
        self.block, self.slack, self.memory = block, slack, memory
        self._held: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n)]

    def matched(self, engine: int, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt ``engine`` was given before."""
        held = self._held[engine]
        k = 0
        for h in hashes:
            if h not in held:
                break
            k += 1
        return k

    def choose(self, ids: Sequence[int], loads: Sequence[int], usable: Sequence[bool]) -> int:
        """The engine for a prompt, given each engine's load and whether it can take requests; -1 if none can."""
        candidates = [i for i, ok in enumerate(usable) if ok]
        if not candidates:
            return -1
        least = min(loads[i] for i in candidates)
        hashes = block_hashes(ids, self.block)
        best, best_k = -1, 0
        if hashes:
            for i in candidates:
                k = self.matched(i, hashes)
                if k > best_k and loads[i] <= least + self.slack:
                    best, best_k = i, k
        if best < 0:
            best = min(candidates, key=lambda i: (loads[i], i))
        self.given(best, hashes)
        return best

    def given(self, engine: int, hashes: Sequence[int]) -> None:
        """Remember that ``engine`` holds these blocks now."""
        held = self._held[engine]
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.memory:
            held.popitem(last=False)
