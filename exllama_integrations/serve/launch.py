"""``exllama-integrations serve`` run: the load options and limits from its flags, the model(s) served, uvicorn started.

One model directory (or none: the demo model) is served by :func:`~.app.create_app` over an ``ExLlamaRuntime`` (or an
``EmbeddingRuntime``, for a model that embeds or reranks) on uvicorn, or with ``--ray`` as Ray Serve replicas. Several
model directories (``serve DIR DIR ...``) or a config file (``--config``) make a server of several models
(:mod:`.front` over a :class:`~.models.ModelRegistry`), on uvicorn or, with ``--ray``, as one Ray Serve deployment
per model behind one ingress; the budget and ``keep_alive`` flags override the file's.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from .model_config import ServerModels, parse_duration, parse_size, read_config, server_models

logger = logging.getLogger("exllama_integrations.serve")


CONNECTIONS = {"timeout_keep_alive": 5.0, "max_connections": 1024, "header_timeout": 10.0}
"""The connection limits of the server ``serve`` runs (uvicorn), by flag, with their defaults (the flags' help says
them); Ray Serve's proxy takes the connections with ``--ray`` and reads none of them."""


def _connection(args: argparse.Namespace, name: str) -> Any:
    value = getattr(args, name)
    return CONNECTIONS[name] if value is None else value


def _refuse_connection_flags(args: argparse.Namespace) -> None:
    """With ``--ray``, a connection flag of :data:`CONNECTIONS` is refused rather than silently dropped."""
    given = [name for name in CONNECTIONS if getattr(args, name) is not None]
    if given:
        from ..errors import InvalidSettingsError

        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise InvalidSettingsError(
            f"{flags} set the connection limits of the server `serve` runs without --ray; with --ray, Ray Serve's "
            "HTTP proxy takes the connections and does not read them (set Ray's http_options instead)."
        )


def limits_of(args: argparse.Namespace) -> Any:
    """The server's limits from its flags."""
    from ..model.media import MediaLimits
    from .state import ServeLimits

    return ServeLimits(
        max_body_bytes=args.max_body_bytes,
        max_tokens=args.max_tokens,
        max_pending=args.max_pending,
        body_timeout=args.body_timeout,
        media=MediaLimits(fetch_urls=args.allow_image_urls, fetch_allow=tuple(args.image_url_allow)),
    )


def run_http(app: Any, args: argparse.Namespace) -> int:
    """Serve ``app`` on uvicorn with the flags' connection limits, until interrupted."""
    import uvicorn

    from .guard import header_deadline_protocol

    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        timeout_graceful_shutdown=30,
        timeout_keep_alive=_connection(args, "timeout_keep_alive"),
        limit_concurrency=_connection(args, "max_connections"),
        h11_max_incomplete_event_size=64 * 1024,
        http=header_deadline_protocol(_connection(args, "header_timeout")),
        log_level="info" if args.verbose else "warning",
    )
    return 0


def models_of(args: argparse.Namespace, options: dict[str, Any]) -> ServerModels:
    """What ``serve`` was given: the config file, else the directories (each with the flags' backend and options).

    The budget and ``keep_alive`` flags win over the file's.
    """
    if args.config:
        if args.model or args.model_dir:
            from ..errors import InvalidSettingsError

            raise InvalidSettingsError("give model directories or --config, not both (the file names every model).")
        config = read_config(args.config)
    else:
        dirs = [*args.model, *args.model_dir]
        entries = [{"model_dir": d, "backend": args.backend, "options": options} for d in dirs]
        config = server_models({"models": entries}, "the command line")
    return ServerModels(
        config.models,
        gpu_memory=config.gpu_memory if args.gpu_memory is None else parse_size(args.gpu_memory, "--gpu-memory"),
        ram=config.ram if args.ram is None else parse_size(args.ram, "--ram"),
        keep_alive=config.keep_alive if args.keep_alive is None else parse_duration(args.keep_alive, "--keep-alive"),
    )


def serve_models(args: argparse.Namespace, options: dict[str, Any], api_key: str | None) -> int:
    """Serve several models behind one endpoint (see the module docstring)."""
    config = models_of(args, options)
    if args.ray:
        from .ray.deployment import run_ray_models

        return run_ray_models(config, args, api_key)
    from .front import create_front
    from .models import ModelRegistry, budget_text

    logger.setLevel(logging.INFO)  # loads and unloads, and one line per request
    registry = ModelRegistry(config)
    app = create_front(registry, api_key=api_key, limits=limits_of(args), freeze_gc=True)
    logger.info(
        "serving %s on http://%s:%d/v1 (budget: %s; a model loads on its first request, pinned ones now)",
        ", ".join(config.names),
        args.host,
        args.port,
        budget_text(registry.budget),
    )
    return run_http(app, args)


def _options(pairs: Sequence[str]) -> dict[str, Any]:
    import json

    from ..errors import InvalidSettingsError

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise InvalidSettingsError(f"--option takes KEY=VALUE, got {pair!r}.")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def load_options(args: argparse.Namespace) -> dict[str, Any]:
    """The served model's load options: ``--max-seq-len``, ``--dtype``, each ``--option`` and ``--draft``."""
    options = {"max_seq_len": args.max_seq_len, "dtype": args.dtype, **_options(args.option)}
    if args.draft is not None:
        options["draft"] = args.draft
    return options


def serve_command(args: argparse.Namespace) -> int:
    """Run ``exllama-integrations serve`` with its parsed flags (see the module docstring); the exit status."""
    import os

    if args.ray:
        _refuse_connection_flags(args)
    key = args.api_key or os.environ.get("EXLLAMA_API_KEY")
    options = load_options(args)
    given = [*args.model, *args.model_dir]
    if args.config or len(given) > 1:
        return serve_models(args, options, key)
    model_dir = given[0] if given else None
    if model_dir is None:
        from ..demo_model import demo_model_dir

        model_dir = str(demo_model_dir())
    if args.tool_format is not None:
        from ..chat.formats import find_format

        find_format(None, args.tool_format)  # a name that is no format is refused before the model loads
    template = None
    if args.chat_template is not None:
        from ..model.template_override import read_template_override

        template = read_template_override(args.chat_template)
    if args.ray:
        from .ray.deployment import limits_of_flags, run_ray

        return run_ray(
            model_dir,
            backend=args.backend,
            host=args.host,
            port=args.port,
            replicas=args.replicas,
            num_gpus=args.num_gpus,
            api_key=key,
            served_model_name=args.served_model_name,
            tool_format=args.tool_format,
            chat_template=template,
            runtime_options={k: v for k, v in options.items() if v is not None},
            limits=limits_of_flags(args),
        )
    from ..runtime.local import ExLlamaRuntime

    logger.setLevel(logging.INFO)  # one line per request, always
    from ..runtime.local.registry import serving_options
    from .app import create_app

    rt: Any
    task = args.task or task_of(model_dir)
    if task in ("embed", "rerank"):  # its batches run on a worker thread of the server (no engine process)
        from ..runtime.local import EmbeddingRuntime

        rt = EmbeddingRuntime(model_dir, args.backend, task=task, **{k: v for k, v in options.items() if v is not None})
    else:
        rt = ExLlamaRuntime(
            model_dir,
            args.backend,
            engine=args.engine,
            engines=args.engines,
            **serving_options(model_dir, args.backend, options),
        )
    app = create_app(
        rt,
        served_model_name=args.served_model_name,
        api_key=key,
        limits=limits_of(args),
        on_shutdown=rt.close,
        freeze_gc=True,
        chat_template=template,
        tool_format=args.tool_format,
    )
    print(f"serving {rt.model.name} ({rt.backend_name}) on http://{args.host}:{args.port}/v1", file=sys.stderr)
    return run_http(app, args)


def task_of(model_dir: str) -> str:
    """What a served directory is for, from its files (``embed``, ``rerank`` or ``generate``)."""
    from ..model.directory import ModelDirectory
    from ..model.hub import resolve_model_dir
    from ..model.pooling import detect_task

    return detect_task(ModelDirectory.inspect(resolve_model_dir(model_dir)))


__all__ = ["limits_of", "load_options", "models_of", "run_http", "serve_command", "serve_models", "task_of"]
