"""RemoteRuntime: the Runtime contract over HTTP, to a model served by ``exllama-integrations serve`` (or Ray).

Every adapter works over it unchanged (``ExLlamaLLM(base_url=...)``, ``ChatExLlama(base_url=...)``,
LlamaIndex's ``ExLlamaLLM(base_url=...)``). The tokenizer is loaded here from the server's files (no
weights), so token counts and chat prompts are exact and computed locally; generation goes to
``/v1/completions`` with our extensions (a grammar, every setting, ``return_details``), so chunks
come back exactly as the in-process runtime makes them. Closing a stream closes its connection, and
the server cancels the generation at its next step.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import weakref
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import (
    InvalidSettingsError,
    MissingDependencyError,
    RuntimeClosedError,
    ServerError,
)

try:
    import httpx
except ImportError:  # pragma: no cover - exercised by the missing-extra test
    raise MissingDependencyError("httpx", "remote", "RemoteRuntime (base_url=)") from None

from ..runtime._common import RuntimeCommon
from ..runtime.api import (
    GenerationResult,
    Grammar,
    ModelInfo,
    Prompt,
    StreamChunk,
)
from ..runtime.settings import GenerationSettings
from ..runtime.tokenizer import NativeTokenizer
from ..runtime.tokenizer_files import TokenizerFiles
from .convert import WIRE_SETTINGS
from .remote_stream import RemoteStream, chunk_of_line, error_of

_shared: dict[tuple[str, str], weakref.ref[RemoteRuntime]] = {}
_shared_lock = threading.Lock()


def wire_settings(s: GenerationSettings) -> dict[str, Any]:
    """Every setting as the server's fields (sent explicitly, so the server's defaults change nothing)."""
    return {
        **{field: getattr(s, setting) for field, setting in WIRE_SETTINGS.items()},
        "max_tokens": s.max_new_tokens,  # null: up to the context (our extension)
        "stop": list(s.stop),
        "stop_token_ids": list(s.stop_token_ids),
        "logprobs": s.logprobs,
    }


class RemoteRuntime(RuntimeCommon):
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
        settings: GenerationSettings | None = None,
        cache_dir: str | Path | None = None,
    ) -> None:
        """Connect, read the served model's facts and load its tokenizer here (no weights).

        Raises:
            ServerError: the server cannot be reached or refuses the key.
        """
        import os

        url = base_url.rstrip("/")
        self.base_url = url[:-3] if url.endswith("/v1") else url
        key = api_key or os.environ.get("EXLLAMA_API_KEY")
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._timeout = httpx.Timeout(timeout, connect=10.0)
        self._client = httpx.Client(base_url=self.base_url, headers=self._headers, timeout=self._timeout)
        self._aclients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            weakref.WeakKeyDictionary()
        )
        self.settings = settings or GenerationSettings()
        self._closed = False
        info = self._get("/v1/exllama/info")
        self.served_model_name = str(info.pop("served_model_name"))
        info["eos_token_ids"] = tuple(info["eos_token_ids"])
        self._info = ModelInfo(**info)
        self._bundle = self._get("/v1/exllama/tokenizer")
        from ..demo_model import cache_dir as default_cache

        folder = Path(cache_dir) if cache_dir else default_cache() / "remote-tokenizers"
        self.tokenizer = NativeTokenizer(TokenizerFiles.from_bundle(self._bundle, folder))

    @classmethod
    def shared(cls, base_url: str, *, api_key: str | None = None) -> RemoteRuntime:
        """One client per server and key, shared by every wrapper that names it."""
        key = (base_url.rstrip("/"), hashlib.sha256((api_key or "").encode()).hexdigest())
        with _shared_lock:
            ref = _shared.get(key)
            rt = ref() if ref is not None else None
            if rt is None or rt.closed:
                rt = cls(base_url, api_key=api_key)
                _shared[key] = weakref.ref(rt)
            return rt

    def _get(self, path: str) -> Any:
        try:
            r = self._client.get(path)
        except httpx.HTTPError as e:
            raise ServerError(f"cannot reach {self.base_url}: {e}") from None
        if r.status_code != 200:
            raise error_of(r.status_code, _json(r), self.base_url)
        return r.json()

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

    # ----------------------------------------------------------------- generation (on the server)

    def _body(
        self,
        prompt: Prompt,
        settings: GenerationSettings,
        grammar: Grammar | None,
        add_special_tokens: bool,
        incremental: bool = True,
    ) -> dict[str, Any]:
        if isinstance(prompt, (bytes, bytearray)):
            raise InvalidSettingsError("the prompt is bytes; decode it to str first (e.g. data.decode('utf-8')).")
        body: dict[str, Any] = {
            "model": self.served_model_name,
            "prompt": prompt if isinstance(prompt, str) else list(prompt),
            "stream": True,
            "return_details": True,
            "add_special_tokens": add_special_tokens,
            "incremental": incremental,
            **wire_settings(settings),
        }
        if grammar is not None:
            body["grammar"] = grammar.to_dict()
        return body

    def stream(
        self,
        prompt: Prompt,
        settings: GenerationSettings | None = None,
        *,
        grammar: Grammar | None = None,
        add_special_tokens: bool = True,
        incremental: bool = True,
        **overrides: Any,
    ) -> RemoteStream:
        s = self.resolve_settings(settings, **overrides)
        body = self._body(prompt, s, grammar, add_special_tokens, incremental)
        try:
            response = self._client.send(self._client.build_request("POST", "/v1/completions", json=body), stream=True)
        except httpx.HTTPError as e:
            raise ServerError(f"cannot reach {self.base_url}: {e}") from None
        if response.status_code != 200:
            response.read()
            response.close()
            raise error_of(response.status_code, _json(response), self.base_url)
        return RemoteStream(response, self._info.backend, self.base_url)

    def _aclient(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._aclients.get(loop)
        if client is None:
            client = httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=self._timeout)
            self._aclients[loop] = client
        return client

    async def astream(
        self,
        prompt: Prompt,
        settings: GenerationSettings | None = None,
        *,
        grammar: Grammar | None = None,
        add_special_tokens: bool = True,
        incremental: bool = True,
        **overrides: Any,
    ) -> AsyncIterator[StreamChunk]:
        s = self.resolve_settings(settings, **overrides)
        body = self._body(prompt, s, grammar, add_special_tokens, incremental)
        client = self._aclient()
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise error_of(response.status_code, _json(response), self.base_url)
                async for line in response.aiter_lines():
                    chunk = chunk_of_line(line, self.base_url)
                    if chunk is not None:
                        yield chunk
                        if chunk.finish_reason is not None:
                            return
        except httpx.HTTPError as e:
            raise ServerError(f"the connection to {self.base_url} failed: {e}") from None
        raise ServerError(f"{self.base_url} ended the stream before its last chunk.")

    def batch(
        self,
        prompts: Sequence[Prompt],
        settings: GenerationSettings | None = None,
        *,
        grammar: Grammar | None = None,
        add_special_tokens: bool = True,
        **overrides: Any,
    ) -> list[GenerationResult]:
        """All prompts at once, as concurrent requests (the server batches them)."""
        s = self.resolve_settings(settings, **overrides)
        if not prompts:
            return []
        with ThreadPoolExecutor(min(len(prompts), 32), thread_name_prefix="exllama-remote") as pool:
            futures = [
                pool.submit(self.generate, p, s, grammar=grammar, add_special_tokens=add_special_tokens)
                for p in prompts
            ]
            return [f.result() for f in futures]

    def close(self) -> None:
        """Close the connections (the server and its model stay up)."""
        self._closed = True
        self._client.close()

    def __repr__(self) -> str:
        return f"RemoteRuntime({self.base_url!r}, model={self.served_model_name!r})"


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return {"error": {"message": response.text[:500]}}


__all__ = ["RemoteRuntime", "RemoteStream", "wire_settings"]
