"""``exllama-integrations serve`` run: the limits from its flags, uvicorn started, and a server of several models built.

Several model directories (``serve DIR DIR ...``) or a config file (``--config``) make a server of several models
(:mod:`.front` over a :class:`~.models.ModelRegistry`), on uvicorn or, with ``--ray``, as one Ray Serve deployment
per model behind one ingress; the budget and ``keep_alive`` flags override the file's.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from .model_config import ServerModels, parse_duration, parse_size, read_config, server_models

logger = logging.getLogger("exllama_integrations.serve")


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
        timeout_keep_alive=args.timeout_keep_alive,
        limit_concurrency=args.max_connections,
        h11_max_incomplete_event_size=64 * 1024,
        http=header_deadline_protocol(args.header_timeout),
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
        dirs = [*args.model, *([args.model_dir] if args.model_dir else [])]
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


__all__ = ["limits_of", "models_of", "run_http", "serve_models"]
