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

import random
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence

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
    """Engine (or replica) choice by prefix and load (see the module docstring); not thread-safe: its owner locks.

    Engines are named by index (:meth:`choose`) or by any hashable key, such as a Ray replica's id (:meth:`pick`).
    """

    def __init__(self, n: int = 0, block: int = BLOCK, slack: int = 4, memory: int = 65536) -> None:
        self.block, self.slack, self.memory = block, slack, memory
        self._held: dict[Hashable, OrderedDict[int, None]] = {i: OrderedDict() for i in range(n)}

    def matched(self, engine: Hashable, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt ``engine`` was given before."""
        held: Mapping[int, None] = self._held.get(engine, {})
        k = 0
        for h in hashes:
            if h not in held:
                break
            k += 1
        return k

    def choose(self, ids: Sequence[int], loads: Sequence[int], usable: Sequence[bool]) -> int:
        """The engine for a prompt, given each engine's load and whether it can take requests; -1 if none can."""
        candidates: dict[Hashable, int] = {i: loads[i] for i, ok in enumerate(usable) if ok}
        if not candidates:
            return -1
        chosen = self.pick(block_hashes(ids, self.block), candidates)
        assert isinstance(chosen, int)
        return chosen

    def pick(self, hashes: Sequence[int], loads: Mapping[Hashable, int]) -> Hashable:
        """Of ``loads``' engines (each with its load; at least one), the one for a prompt of these block names."""
        least = min(loads.values())
        best: Hashable = None
        best_k = 0
        for key, load in loads.items():
            k = self.matched(key, hashes) if hashes else 0
            if k > best_k and load <= least + self.slack:
                best, best_k = key, k
        if best is None:
            best = random.choice([key for key, load in loads.items() if load == least])  # ties spread
        self.given(best, hashes)
        return best

    def given(self, engine: Hashable, hashes: Sequence[int]) -> None:
        """Remember that ``engine`` holds these blocks now."""
        held = self._held.setdefault(engine, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.memory:
            held.popitem(last=False)

    def forget(self, keep: Sequence[Hashable]) -> None:
        """Drop what is remembered of engines not in ``keep`` (replicas that went away)."""
        for key in [k for k in self._held if k not in keep]:
            del self._held[key]
