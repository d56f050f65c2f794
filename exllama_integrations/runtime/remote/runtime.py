"""RemoteRuntime: the Runtime contract over HTTP, to a model served by ``exllama-integrations serve`` (or Ray).

Every adapter works over it unchanged (``ExLlamaLLM(base_url=...)``, ``ChatExLlama(base_url=...)``,
LlamaIndex's ``ExLlamaLLM(base_url=...)``). The tokenizer is loaded here from the server's files (no
weights), so token counts and chat prompts are exact and computed locally; a request goes to the server's
native endpoint (``/v1/exllama/generate``) in the contract's wire form, and chunks and typed errors come back
as the server's runtime made them. Everything the server sends is bounded and checked: a broken or hostile
server gives typed errors (:class:`~exllama_integrations.errors.ProtocolError`, ``ServerError``) within the
call's deadline, never a raw ``KeyError`` or a hang.
"""

from __future__ import annotations

import asyncio
import binascii
import hashlib
import json
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ...errors import (
    ExLlamaIntegrationsError,
    InvalidModelError,
    MissingDependencyError,
    ProtocolError,
    RuntimeClosedError,
    ServerError,
)

try:
    import httpx
except ImportError:  # pragma: no cover - exercised by the missing-extra test
    raise MissingDependencyError("httpx", "remote", "RemoteRuntime (base_url=)") from None

from ...contract import wire
from ...contract.api import GenerationRequest, ModelInfo, StreamChunk
from ...contract.settings import GenerationSettings
from ...model.tokenizer import NativeTokenizer
from ...model.tokenizer_files import TokenizerFiles
from ..base import RuntimeBase, check_request
from .retrieval import RemoteRetrieval
from .stream import RemoteStream, alines, chunk_of_line

_shared: dict[tuple[str, str, str], weakref.ref[RemoteRuntime]] = {}
_shared_lock = threading.Lock()
MAX_BODY_BYTES = 1 << 30
"""Largest answer read whole (the tokenizer files)."""


class RemoteRuntime(RemoteRetrieval, RuntimeBase):
    """A model on an exllama-integrations server, as a Runtime.

    Example:
        >>> rt = RemoteRuntime("http://127.0.0.1:8000")  # doctest: +SKIP
        >>> rt.generate("The capital of France is", temperature=0, max_new_tokens=8).text  # doctest: +SKIP
        ' Paris.'
        >>> ChatExLlama(base_url="http://127.0.0.1:8000").invoke("Hi")  # doctest: +SKIP
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        settings: GenerationSettings | None = None,
        cache_dir: str | Path | None = None,
        model: str | None = None,
    ) -> None:
        """Connect, read the served model's facts and load its tokenizer here (no weights).

        ``timeout``: the most seconds one call may take, a whole generation included (keep-alives do not
        extend it); the facts and tokenizer are fetched within ``min(timeout, 60)`` (a server of several models may
        load the model first: its load counts against ``timeout``).
        ``model``: which model of a server of several (its name in ``/v1/models``); None: the server's first.

        Raises:
            ServerError: the server cannot be reached, refuses the key, or does not answer in time.
            ProtocolError: the server answers something that is not an exllama-integrations server's answer.
        """
        url = base_url.rstrip("/")
        self.base_url = url[:-3] if url.endswith("/v1") else url
        key = api_key or os.environ.get("EXLLAMA_API_KEY")
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.timeout = float(timeout)
        self._timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self._client = httpx.Client(
            base_url=self.base_url, headers=self._headers, timeout=self._timeout, follow_redirects=False
        )
        self._aclients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self.settings = settings or GenerationSettings()
        self._closed = False
        self.model = model
        self._params = {"model": model} if model is not None else None
        try:
            setup = self.timeout if model is not None else min(self.timeout, 60.0)
            answer = self._json("/v1/exllama/info", setup)
            if not isinstance(answer, dict) or "info" not in answer:
                raise ProtocolError(f"{self.base_url} is not an exllama-integrations server (no model info).")
            self._info: ModelInfo = wire.loads_info(answer["info"])
            self.served_model_name = str(answer.get("served_model_name") or self._info.name)
            facts = answer.get("embedding")
            self._embedding = wire.loads_embedding_info(facts) if facts is not None else None
            self._bundle = self._json("/v1/exllama/tokenizer", setup)
            folder = Path(cache_dir) if cache_dir else _default_cache() / "remote-tokenizers"
            try:
                self.tokenizer = NativeTokenizer(_tokenizer_files(self._bundle, folder, self.base_url))
            except InvalidModelError as e:
                raise ProtocolError(f"{self.base_url} sent unusable tokenizer files: {e}") from None
        except BaseException:
            self._client.close()
            raise

    @classmethod
    def shared(cls, base_url: str, *, api_key: str | None = None, model: str | None = None) -> RemoteRuntime:
        """One client per server, key and model, shared by every wrapper that names them."""
        key = (base_url.rstrip("/"), hashlib.sha256((api_key or "").encode()).hexdigest(), model or "")
        with _shared_lock:
            ref = _shared.get(key)
            rt = ref() if ref is not None else None
            if rt is None or rt.closed:
                rt = cls(base_url, api_key=api_key, model=model)
                _shared[key] = weakref.ref(rt)
            return rt

    def _json(self, path: str, seconds: float, content: bytes | None = None) -> Any:
        """The JSON a native endpoint answers to a GET (or a POST of ``content``), read within a deadline.

        At most ``MAX_BODY_BYTES`` are read; an error answer is raised as its typed error.
        """
        deadline = time.monotonic() + seconds
        method, headers = ("GET", None) if content is None else ("POST", {"content-type": "application/json"})
        try:
            with self._client.stream(
                method, path, content=content, headers=headers, timeout=httpx.Timeout(seconds), params=self._params
            ) as r:
                body = bytearray()
                for data in r.iter_bytes():
                    body.extend(data)
                    if len(body) > MAX_BODY_BYTES:
                        raise ProtocolError(f"{self.base_url}{path} answered more than {MAX_BODY_BYTES} bytes.")
                    if time.monotonic() > deadline:
                        raise ServerError(f"{self.base_url}{path} did not answer within {seconds:g} s.")
                status = r.status_code
        except httpx.HTTPError as e:
            raise ServerError(f"cannot reach {self.base_url}: {type(e).__name__}: {e}") from None
        if status != 200:
            raise _error(status, bytes(body), self.base_url)
        try:
            return json.loads(body)
        except (ValueError, RecursionError):
            raise ProtocolError(f"{self.base_url}{path} did not answer JSON: {bytes(body[:200])!r}") from None

    # ----------------------------------------------------------------- facts, tokens, templates (local)

    @property
    def closed(self) -> bool:
        return self._closed

    def model_info(self) -> ModelInfo:
        if self._closed:
            raise RuntimeClosedError(f"the RemoteRuntime for {self.base_url} was closed.")
        return self._info

    def tokenizer_files(self) -> dict[str, Any]:
        """The tokenizer files it took from its server (so a server can front this runtime in turn)."""
        return dict(self._bundle)

    def prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        """The token ids the model reads for ``request``: text counted here, images by the server (which reads them)."""
        if not request.media:
            return super().prompt_token_ids(request)
        answer = self._json("/v1/exllama/tokenize", self.timeout, self._body(request))
        ids = answer.get("token_ids") if isinstance(answer, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ProtocolError(f"{self.base_url} answered /v1/exllama/tokenize without a list of token ids.")
        return ids

    # ----------------------------------------------------------------- generation (on the server)

    def _body(self, request: GenerationRequest) -> bytes:
        check_request(request, self.model_info())
        return wire.dumps(request)

    def open(self, request: GenerationRequest) -> RemoteStream:
        """Start the generation on the server; its stream. Closing it closes the connection (the server cancels)."""
        body = self._body(request)
        deadline = time.monotonic() + self.timeout
        try:
            response = self._client.send(
                self._client.build_request(
                    "POST",
                    "/v1/exllama/generate",
                    content=body,
                    headers={"content-type": "application/json"},
                    params=self._params,
                ),
                stream=True,
            )
        except httpx.HTTPError as e:
            raise ServerError(f"cannot reach {self.base_url}: {type(e).__name__}: {e}") from None
        if response.status_code != 200:
            try:
                data = response.read()[:MAX_BODY_BYTES]
            except httpx.HTTPError:
                data = b""
            finally:
                response.close()
            raise _error(response.status_code, data, self.base_url)
        return RemoteStream(response, self._info.backend, self.base_url, deadline)

    def _aclient(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._aclients.get(loop)
        if client is None:
            for old in [lp for lp in self._aclients if lp.is_closed()]:
                del self._aclients[old]  # its loop is gone, and its connections with it
            client = httpx.AsyncClient(
                base_url=self.base_url, headers=self._headers, timeout=self._timeout, follow_redirects=False
            )
            self._aclients[loop] = client
        return client

    async def aopen(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """Async :meth:`open`; the event loop stays free."""
        body = self._body(request)
        deadline = time.monotonic() + self.timeout
        client = self._aclient()
        headers = {"content-type": "application/json"}
        try:
            async with client.stream(
                "POST", "/v1/exllama/generate", content=body, headers=headers, params=self._params
            ) as response:
                if response.status_code != 200:
                    data = (await response.aread())[:MAX_BODY_BYTES]
                    raise _error(response.status_code, data, self.base_url)
                async for line in alines(response.aiter_bytes(), deadline, self.base_url):
                    chunk = chunk_of_line(line)
                    if chunk is not None:
                        yield chunk
                        if chunk.finish_reason is not None:
                            return
        except httpx.HTTPError as e:
            raise ServerError(f"the connection to {self.base_url} failed: {type(e).__name__}: {e}") from None
        raise ProtocolError(f"{self.base_url} ended the stream before its last chunk.")

    def _failed(self, status: int, body: bytes) -> Exception:
        """The typed error of a server's error answer."""
        return _error(status, body, self.base_url)

    def close(self) -> None:
        """Close the connections (the server and its model stay up). Idempotent."""
        self._closed = True
        self._client.close()
        clients, self._aclients = self._aclients, {}
        for loop, client in clients.items():
            if loop.is_closed():
                continue
            try:
                if loop.is_running():
                    asyncio.run_coroutine_threadsafe(client.aclose(), loop)
                else:
                    loop.run_until_complete(client.aclose())
            except RuntimeError:  # that loop belongs to a thread that is busy with another: let it go
                pass

    def __repr__(self) -> str:
        return f"RemoteRuntime({self.base_url!r}, model={self.served_model_name!r})"


def _default_cache() -> Path:
    from ...demo_model import cache_dir

    return cache_dir()


def _error(status: int, body: bytes, url: str) -> ExLlamaIntegrationsError:
    """The typed error a server's error answer stands for (the wire form, or an OpenAI error object)."""
    try:
        data = json.loads(body) if body else None
    except (ValueError, RecursionError):
        data = None
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict) and "fields" in err:
        return wire.loads_error(data, status)
    message = str(err.get("message")) if isinstance(err, dict) else body[:300].decode("utf-8", "replace")
    if status == 401:
        return ServerError(f"{url} refused the API key: {message} (pass api_key= or set EXLLAMA_API_KEY)", status)
    if status == 404:
        return ProtocolError(f"{url} has no native endpoint ({message}); is it an exllama-integrations server?", status)
    return ServerError(f"{url} answered {status}: {message}", status)


def _tokenizer_files(bundle: Any, folder: Path, url: str) -> TokenizerFiles:
    """The server's tokenizer bundle, checked, as files here."""
    if not isinstance(bundle, dict):
        raise ProtocolError(f"{url} sent tokenizer files in a form this client cannot read.")
    try:
        return TokenizerFiles.from_bundle(bundle, folder)
    except (binascii.Error, ValueError, TypeError) as e:
        raise ProtocolError(f"{url} sent tokenizer files this client cannot read: {type(e).__name__}: {e}") from None


__all__ = ["RemoteRuntime", "RemoteStream"]
