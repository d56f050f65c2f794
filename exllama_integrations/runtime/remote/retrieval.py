"""Embedding and rerank over HTTP: what RemoteRuntime adds for a server whose model embeds or reranks.

The server's ``/v1/exllama/info`` says what its model does (``embedding``: its
:class:`~exllama_integrations.contract.retrieval.EmbeddingInfo`); a server of a chat model says nothing, and asking
its RemoteRuntime to embed raises :class:`~exllama_integrations.errors.UnsupportedTaskError` here, before any request.
Requests go to ``/v1/exllama/embed`` and ``/v1/exllama/rerank`` in the contract's wire form; results and typed
errors come back as the server's runtime made them, read within the runtime's deadline.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ...contract import wire
from ...contract.retrieval import EmbeddingInfo, EmbeddingRequest, EmbeddingResult, RerankRequest, RerankResult
from ...errors import ProtocolError, ServerError, UnsupportedTaskError

MAX_RESULT_BYTES = 1 << 30
"""Largest embedding or rerank answer read."""


class RemoteRetrieval:
    """The embed and rerank methods of :class:`~.runtime.RemoteRuntime` (a mixin over its HTTP clients)."""

    base_url: str
    served_model_name: str
    timeout: float
    _embedding: EmbeddingInfo | None
    _params: dict[str, str] | None
    """The query naming the server's model (``?model=``), for a server of several models."""

    if TYPE_CHECKING:  # RemoteRuntime's own

        def _json(self, path: str, seconds: float, content: bytes | None = None) -> Any: ...

        def _aclient(self) -> Any: ...

        def _failed(self, status: int, body: bytes) -> Exception: ...

    def embedding_info(self) -> EmbeddingInfo:
        """What the served model does (dimensions, token limit, prompts).

        Raises:
            UnsupportedTaskError: the server's model neither embeds nor reranks.
        """
        if self._embedding is None:
            raise UnsupportedTaskError(
                f"the model {self.served_model_name!r} served at {self.base_url} is a text-generation model; it does "
                "not embed or rerank. Point base_url at a server of an embedding or rerank model."
            )
        return self._embedding

    def _task(self, task: str) -> None:
        info = self.embedding_info()
        if info.task != task:
            verb = "embed" if task == "embed" else "rerank"
            raise UnsupportedTaskError(
                f"the model {self.served_model_name!r} served at {self.base_url} does not {verb}: its task is "
                f"{info.task!r}."
            )

    def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        """Embed on the server."""
        self._task("embed")
        self.embedding_info().check_dimensions(request.dimensions)
        data = self._json("/v1/exllama/embed", self.timeout, wire.dumps(request))
        return wire.loads_embedding_result(data)

    def rerank(self, request: RerankRequest) -> RerankResult:
        """Rerank on the server."""
        self._task("rerank")
        data = self._json("/v1/exllama/rerank", self.timeout, wire.dumps(request))
        return wire.loads_rerank_result(data)

    async def _apost(self, path: str, body: bytes) -> bytes:
        import httpx

        deadline = time.monotonic() + self.timeout
        headers = {"content-type": "application/json"}
        try:
            async with self._aclient().stream(
                "POST", path, content=body, headers=headers, params=self._params
            ) as response:
                data = bytearray()
                async for part in response.aiter_bytes():
                    data.extend(part)
                    if len(data) > MAX_RESULT_BYTES:
                        raise ProtocolError(f"{self.base_url}{path} answered more than {MAX_RESULT_BYTES} bytes.")
                    if time.monotonic() > deadline:
                        raise ServerError(f"{self.base_url}{path} did not answer within {self.timeout:g} s.")
                if response.status_code != 200:
                    raise self._failed(response.status_code, bytes(data))
                return bytes(data)
        except httpx.HTTPError as e:
            raise ServerError(f"the connection to {self.base_url} failed: {type(e).__name__}: {e}") from None

    async def aembed(self, request: EmbeddingRequest) -> EmbeddingResult:
        """Async :meth:`embed`; the event loop stays free."""
        self._task("embed")
        self.embedding_info().check_dimensions(request.dimensions)
        return wire.loads_embedding_result(await self._apost("/v1/exllama/embed", wire.dumps(request)))

    async def arerank(self, request: RerankRequest) -> RerankResult:
        """Async :meth:`rerank`; the event loop stays free."""
        self._task("rerank")
        return wire.loads_rerank_result(await self._apost("/v1/exllama/rerank", wire.dumps(request)))


__all__ = ["RemoteRetrieval"]
