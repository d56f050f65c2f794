"""Prefix-aware routing for Ray Serve: a request goes to the model replica that already holds its prompt's prefix.

Ray's own request router API (``ray.serve.request_router.RequestRouter``, public since Ray 2.45) with the
router the engine processes use (:class:`~exllama_integrations.runtime.engine.routing.PrefixRouter`): the
ingress tokenizes each prompt and passes the names of its 256-token blocks as the model call's second
argument; the router remembers which replica was given which blocks and ranks first the one holding the
longest prefix (a follow-up turn goes home), unless it is busier than the least loaded replica by more than
``slack`` requests (Ray's queue-length cache), then every other replica in order of load, so a full
replica is passed over by Ray as usual. Requests without block names (short prompts) go to the least loaded.
"""

from __future__ import annotations

import threading
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from ...runtime.engine.routing import PrefixRouter


class PrefixAwareRouter(RequestRouter):  # type: ignore[misc]
    """Ray request router: longest held prefix first, then by load (see the module docstring)."""

    def initialize_state(self, slack: int = 4, **kwargs: Any) -> None:
        """Called by Ray with ``request_router_kwargs``."""
        self._prefixes = PrefixRouter(slack=slack)
        self._prefix_lock = threading.Lock()

    def _load(self, replica: RunningReplica) -> int:
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        return int(queue_len) if queue_len is not None else 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Ranks of replicas to try in order: the prefix's holder (if not too busy) first, then by load."""
        if not candidate_replicas:
            return []
        hashes = block_names_of(pending_request)
        by_id: dict[Any, RunningReplica] = {r.replica_id: r for r in candidate_replicas}
        loads: dict[Any, int] = {r.replica_id: self._load(r) for r in candidate_replicas}
        with self._prefix_lock:
            if not hasattr(self, "_prefixes"):
                self.initialize_state()
            self._prefixes.forget(list(self.curr_replicas) if self.curr_replicas else list(by_id))
            first = self._prefixes.pick(hashes, loads)
        rest = sorted((r for r in candidate_replicas if r.replica_id != first), key=self._load)
        return [[by_id[first]], *([r] for r in rest)]


def block_names_of(pending_request: PendingRequest | None) -> list[int]:
    """The block names the ingress passed with a request (its second argument), or none."""
    if pending_request is None:
        return []
    args: Any = getattr(pending_request, "args", None) or ()
    if len(args) < 2 or not isinstance(args[1], (list, tuple)):
        return []
    return [int(h) for h in args[1][:4096]]
