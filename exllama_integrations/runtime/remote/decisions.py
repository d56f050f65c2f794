"""Decision questions answered by a server: :class:`RemoteDecider` posts them to its ``/v1/decisions``.

The request and the answer travel in OpenAI's Decisions shape (:mod:`...contract.decision_wire`), the same the
server gives OpenAI's own clients; typed errors come back as the server raised them.
"""

from __future__ import annotations

import json
import weakref
from typing import TYPE_CHECKING, Any

from ...contract.decision_wire import request_to_wire, result_of_wire
from ...contract.decisions import DecisionRequest, DecisionResult
from ...errors import ProtocolError

if TYPE_CHECKING:
    from .runtime import RemoteRuntime

PATH = "/v1/decisions"


class RemoteDecider:
    """The :class:`~...contract.decisions.Decides` capability of a :class:`~.runtime.RemoteRuntime`."""

    def __init__(self, runtime: RemoteRuntime) -> None:
        self.runtime = runtime

    def _body(self, request: DecisionRequest) -> bytes:
        return json.dumps(request_to_wire(request, self.runtime.served_model_name)).encode()

    def _read(self, answer: Any, request: DecisionRequest) -> DecisionResult:
        try:
            return result_of_wire(answer, request)
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"{self.runtime.base_url}{PATH} answered an unreadable body ({e!r}).") from None

    def decide(self, request: DecisionRequest) -> DecisionResult:
        """Answer on the server."""
        rt = self.runtime
        return self._read(rt._json(PATH, rt.timeout, self._body(request)), request)

    async def adecide(self, request: DecisionRequest) -> DecisionResult:
        """Async :meth:`decide`; the event loop stays free."""
        data = await self.runtime._apost(PATH, self._body(request))
        try:
            answer = json.loads(data)
        except ValueError:
            raise ProtocolError(f"{self.runtime.base_url}{PATH} did not answer JSON.") from None
        return self._read(answer, request)


_deciders: weakref.WeakKeyDictionary[Any, RemoteDecider] = weakref.WeakKeyDictionary()


def remote_decider(runtime: RemoteRuntime) -> RemoteDecider:
    """The decider of a remote runtime (one per runtime)."""
    found = _deciders.get(runtime)
    if found is None:
        found = _deciders[runtime] = RemoteDecider(runtime)
    return found


__all__ = ["RemoteDecider", "remote_decider"]
