"""The Ray ingress: the OpenAI app over model replicas called through a deployment handle with plain request values.

:class:`HandleRuntime` is a Runtime whose generations run on the model deployment: a request travels in the
contract's wire form, chunks come back as the replica's runtime made them, and a typed error arrives as its
own class. Before a call it tokenizes the prompt (with the model's tokenizer, loaded here from the replica's
files, no weights) and hands the names of its blocks to Ray's request router (:mod:`.router`), so a
follow-up turn goes to the replica that holds its prefix. Closing a stream cancels the call on its replica.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from ...contract import wire
from ...contract.api import GenerationRequest, GenerationResult, ModelInfo, StreamChunk, result_of
from ...errors import ExLlamaIntegrationsError, RuntimeClosedError, error_from_wire
from ...model.tokenizer import NativeTokenizer
from ...model.tokenizer_files import TokenizerFiles
from ...runtime.base import RuntimeBase, check_request
from ...runtime.engine.routing import BLOCK, block_hashes
from .network import bind_replica_grpc_to_node_address


class HandleRuntime(RuntimeBase):
    """A model deployment, reached through its Ray handle, as a Runtime (see the module docstring)."""

    def __init__(self, handle: Any, info: dict[str, Any], bundle: dict[str, Any]) -> None:
        from ...contract.settings import GenerationSettings

        self._handle = handle
        self._info: ModelInfo = wire.loads_info(info)
        self._bundle = bundle
        self._folder = Path(tempfile.mkdtemp(prefix="exllama-ingress-"))
        self.tokenizer = NativeTokenizer(TokenizerFiles.from_bundle(bundle, self._folder))
        atexit.register(shutil.rmtree, self._folder, True)
        self.settings = GenerationSettings()
        self._closed = False
        self._lock = threading.Lock()
        self.served: Counter[str] = Counter()
        """Requests each model replica answered (shown by ``/health``: where requests went)."""

    @property
    def closed(self) -> bool:
        return self._closed

    def model_info(self) -> ModelInfo:
        if self._closed:
            raise RuntimeClosedError("the Ray ingress was shut down.")
        return self._info

    def tokenizer_files(self) -> dict[str, Any]:
        return dict(self._bundle)

    def placement(self) -> dict[str, int]:
        """Requests answered by each model replica so far."""
        with self._lock:
            return dict(self.served)

    def _blocks(self, request: GenerationRequest) -> list[int]:
        if request.media:
            return []  # images are placed by the replica; their prompt is routed by load alone
        ids = self.prompt_token_ids(request)
        return block_hashes(ids, BLOCK) if len(ids) >= BLOCK else []

    def _call(self, request: GenerationRequest) -> Any:
        check_request(request, self.model_info())
        return self._handle.options(stream=True).generate.remote(wire.to_data(request), self._blocks(request))

    def _chunk(self, item: Any) -> StreamChunk | None:
        if not isinstance(item, dict):
            raise ExLlamaIntegrationsError(f"a model replica sent {type(item).__name__}, not a chunk.")
        if "error" in item:
            raise error_from_wire(item["error"])
        if "replica" in item:
            with self._lock:
                self.served[str(item["replica"])] += 1
            return None
        return wire.loads_chunk(item)

    async def aopen(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """Chunks of a generation on a model replica; closing the iterator cancels it there."""
        response = self._call(request)
        try:
            async for item in response:
                chunk = self._chunk(item)
                if chunk is not None:
                    yield chunk
        finally:
            response.cancel()

    def open(self, request: GenerationRequest) -> _HandleStream:
        """A generation read from a thread (outside an event loop)."""
        return _HandleStream(self, self._call(request))

    def close(self) -> None:
        self._closed = True
        shutil.rmtree(self._folder, ignore_errors=True)


class _HandleStream:
    """A replica's generation read synchronously; ``close()`` cancels it on the replica."""

    def __init__(self, runtime: HandleRuntime, response: Any) -> None:
        self._runtime, self._response = runtime, response
        self._items: Iterator[Any] = iter(response)
        self._chunks: list[StreamChunk] = []
        self.result: GenerationResult | None = None

    def __iter__(self) -> _HandleStream:
        return self

    def __next__(self) -> StreamChunk:
        while self.result is None:
            chunk = self._runtime._chunk(next(self._items))
            if chunk is None:
                continue
            self._chunks.append(chunk)
            if chunk.finish_reason is not None:
                self.result = result_of(self._chunks, self._runtime.model_info().backend)
            return chunk
        raise StopIteration

    def close(self) -> None:
        self._response.cancel()

    def __enter__(self) -> _HandleStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ExLlamaIngress:
    """The ingress deployment: the front of ``exllama-integrations serve`` (:mod:`..app`) over the model deployments.

    One model or several, each a deployment reached through its handle, served from the same registry as ``serve DIR
    ...``, pinned: its replicas are Ray's to place and scale, so the ingress never unloads one.
    """

    async def __init__(self, models: dict[str, Any], config: dict[str, Any]) -> None:  # type: ignore[misc]
        """Read each model's facts and tokenizer from a replica (Ray runs an async constructor on the replica's loop).

        ``models``: each model's deployment handle by its served name ("": the model's own name).
        """
        bind_replica_grpc_to_node_address()
        self.config = config
        self.runtimes = {
            name: HandleRuntime(handle, await handle.info.remote(), await handle.tokenizer_files.remote())
            for name, handle in models.items()
        }

    def __serve_build_asgi_app__(self) -> Any:
        """The front over the model deployments."""
        return front_over(self.runtimes, self.config, freeze_gc=True)


def front_over(runtimes: dict[str, Any], c: dict[str, Any], freeze_gc: bool) -> Any:
    """The front of ``serve`` over loaded runtimes by served name ("": the model's own), with the configured options.

    ``c``: ``models`` (each model's ``model_dir``, ``tool_format`` and ``chat_template`` by the same name),
    ``api_key`` and ``limits``. What each Ray ingress replica builds, over :class:`HandleRuntime` s.

    Raises:
        InvalidSettingsError: a ``tool_format`` that names no format (before anything is served).
    """
    from ...chat.formats import find_format
    from ..app import create_front
    from ..registry.models import ModelRegistry

    models = []
    for name, runtime in runtimes.items():
        m = c["models"][name]
        if m.get("tool_format") is not None:
            find_format(None, m["tool_format"])  # refused before any runtime is taken
        entry = {k: m.get(k) for k in ("chat_template", "tool_format")}
        models.append((runtime, name or None, {**entry, "model_dir": str(m.get("model_dir") or name)}))
    registry = ModelRegistry.of_loaded(*models, keep_open=False)
    app = create_front(registry, api_key=c.get("api_key"), limits=limits_from(c), freeze_gc=freeze_gc)
    registry.load_pinned_now()  # the runtimes are there: each model's app made now, a bad tool_format refused
    return app


def limits_from(c: dict[str, Any]) -> Any:
    """The server limits of an app's configuration (``limits``)."""
    from ..state import ServeLimits

    given = {k: v for k, v in (c.get("limits") or {}).items() if v is not None}
    allow = tuple(given.pop("image_url_allow", None) or ())  # hosts and networks a fetch may reach though not global
    if given.pop("allow_image_urls", False):
        from ...model.media import MediaLimits

        given["media"] = MediaLimits(fetch_urls=True, fetch_allow=allow)
    return ServeLimits(**given)
