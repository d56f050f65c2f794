"""``exllama-integrations serve`` run: what its flags name to serve, checked, then served on uvicorn or Ray Serve.

Every way of serving starts the same: the flags (or the ``--config`` file) become the models served, a
:class:`~.registry.config.ServerModels` of one model or several, each a :class:`~.registry.config.ModelSpec` (its kind
``chat``, ``embedding`` or ``rerank``: ``--kind``, or its deprecated old name ``--task``, read here once); a flag the
mode does not read is refused first (:data:`UNREAD`). Each model is then planned once (:func:`~.registry.kinds.planned`:
its directory inspected, its kind found, its backend and options resolved) and loaded from that plan as it is. Every
server is a :class:`~.registry.models.ModelRegistry` behind the one app (:func:`~.app.create_front`): ``serve DIR`` (or
none: the demo model) is a registry of that one model, pinned, loaded before it listens, with no budget (its cache takes
the free memory); several directories or a config file, each model loaded on its first request (pinned ones before it
listens) within the memory budget. With ``--ray`` the same models become Ray Serve deployments behind the same front
(:func:`~.ray.deployment.run_ray`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from collections.abc import Sequence
from functools import partial
from typing import Any

from .registry.config import ServerModels, parse_duration, parse_size, read_config, server_models
from .registry.footprint import Footprint

logger = logging.getLogger("exllama_integrations.serve")


UNBOUNDED = Footprint(sys.maxsize, sys.maxsize)
"""The budget of a model served alone: none (it has the machine; its cache is sized from the free memory)."""

CONNECTIONS = {"timeout_keep_alive": 5.0, "max_connections": 1024, "header_timeout": 10.0}
"""The connection limits of the server ``serve`` runs (uvicorn), by flag, with their defaults (the flags' help says
them); Ray Serve's proxy takes the connections with ``--ray`` and reads none of them."""


def _connection(args: argparse.Namespace, name: str) -> Any:
    value = getattr(args, name)
    return CONNECTIONS[name] if value is None else value


BUDGET_FLAGS = ("gpu_memory", "ram", "keep_alive")
"""The budget of a server of several models."""
ONE_MODEL_FLAGS = ("served_model_name", "chat_template", "tool_format", "engines", "kind", "task")
"""What a model served alone takes from flags (a config file's entry says it for each of several)."""
EACH_MODEL_FLAGS = ("backend", "max_seq_len", "dtype", "option", "draft")
"""Load options the flags give every directory named on the command line."""
FLAG_DEFAULTS: dict[str, Any] = {"backend": "auto", "engine": "process", "engines": 1, "replicas": 1}
"""The defaults of the flags below that have one other than None (a flag at its default was not given)."""

UNREAD: dict[str, list[tuple[tuple[str, ...], str]]] = {
    "one model": [
        (
            BUDGET_FLAGS,
            "they set the memory budget and the idle unloading of a server of several models, while one model alone "
            "is loaded at startup and stays loaded",
        ),
    ],
    "several model directories": [
        (
            (*ONE_MODEL_FLAGS, "engine"),
            "they are one model's (several run in engine processes); give each model its own name, kind, engines, "
            "chat_template or tool_format in a config file (--config, docs/multi-model.md)",
        ),
    ],
    "--config": [
        (
            (*EACH_MODEL_FLAGS, *ONE_MODEL_FLAGS, "engine"),
            "each model's entry in the file sets its own backend, options (max_seq_len, dtype, draft ...), name, "
            "kind, engines, chat_template and tool_format",
        ),
    ],
    "--ray": [
        (
            tuple(CONNECTIONS),
            "they set the connection limits of the server `serve` runs without --ray; with --ray, Ray Serve's HTTP "
            "proxy takes the connections and does not read them (set Ray's http_options instead)",
        ),
        (
            ("engine", "engines"),
            "each Ray replica runs its model's driver in its own process; scale with --replicas",
        ),
        (("kind", "task"), "Ray's deployments serve chat models; serve an embedding or rerank model without --ray"),
        (
            BUDGET_FLAGS,
            "Ray places every model's replicas and keeps them loaded: a budget and keep_alive do not apply",
        ),
    ],
    "without --ray": [(("replicas", "num_gpus"), "they place Ray Serve replicas; add --ray")],
}
"""For each serving mode, the flags it does not read and why: given, they are refused (exit 2) rather than ignored."""


def _given(args: argparse.Namespace, name: str) -> bool:
    value = getattr(args, name, None)
    return not (value is None or value is False or value == []) and value != FLAG_DEFAULTS.get(name)


def refuse_unread(args: argparse.Namespace) -> None:
    """Refuse a flag the serving mode the flags choose does not read (see :data:`UNREAD`).

    Raises:
        InvalidSettingsError: naming the flags, the mode, and why it does not read them.
    """
    if args.config:
        modes = ["--config"]
    else:
        modes = ["several model directories" if len([*args.model, *args.model_dir]) > 1 else "one model"]
    modes.append("--ray" if args.ray else "without --ray")
    for mode in modes:
        for names, why in UNREAD[mode]:
            given = ["--" + name.replace("_", "-") for name in names if _given(args, name)]
            if given:
                from ..errors import InvalidSettingsError

                verb = "is" if len(given) == 1 else "are"
                raise InvalidSettingsError(f"{', '.join(given)} {verb} not read with {mode}: {why}.")


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


def models_of(args: argparse.Namespace) -> ServerModels:
    """What ``serve`` was given: the config file, else the directories (the demo model where none is given).

    Each directory gets the flags' backend and load options; one directory alone also its name, kind (``--kind``),
    engines, chat template and tool format. The budget and ``keep_alive`` flags win over the file's.

    Raises:
        InvalidSettingsError: both directories and --config; a tool format that is no format, a template path that is
            no file (before anything loads).
    """
    from ..errors import InvalidSettingsError

    if args.config:
        if args.model or args.model_dir:
            raise InvalidSettingsError("give model directories or --config, not both (the file names every model).")
        config = read_config(args.config)
    else:
        dirs = [*args.model, *args.model_dir]
        entry: dict[str, Any] = {"backend": args.backend, "options": load_options(args)}
        if len(dirs) <= 1:
            entry.update(one_model(args))
            dirs = dirs or [_demo_dir()]
        config = server_models({"models": [{"model_dir": d, **entry} for d in dirs]}, "the command line")
    return ServerModels(
        config.models,
        gpu_memory=config.gpu_memory if args.gpu_memory is None else parse_size(args.gpu_memory, "--gpu-memory"),
        ram=config.ram if args.ram is None else parse_size(args.ram, "--ram"),
        keep_alive=config.keep_alive if args.keep_alive is None else parse_duration(args.keep_alive, "--keep-alive"),
    )


def one_model(args: argparse.Namespace) -> dict[str, Any]:
    """The entry keys only a model served alone takes from flags (its name, kind, engines, template, tool format).

    Raises:
        InvalidSettingsError: both --kind and its old name --task.
    """
    from ..errors import InvalidSettingsError
    from .registry.kinds import KIND_OF_TASK

    if args.tool_format is not None:
        from ..chat.formats import find_format

        find_format(None, args.tool_format)  # a name that is no format is refused before the model loads
    template = None
    if args.chat_template is not None:
        from ..model.template_override import read_template_override

        template = read_template_override(args.chat_template)
    kind = args.kind
    if args.task is not None:
        if kind is not None:
            raise InvalidSettingsError("give --kind alone (--task is its old name).")
        kind = KIND_OF_TASK[args.task]
        warnings.warn(f"serve --task {args.task} is deprecated: write --kind {kind}.", FutureWarning, stacklevel=2)
    keys = {
        "kind": kind,
        "engines": args.engines,
        "chat_template": template,
        "tool_format": args.tool_format,
        "pinned": True,  # loaded at startup and kept: a server of one model
    }
    if args.served_model_name is not None:
        keys["name"] = args.served_model_name
    return keys


def _demo_dir() -> str:
    from ..demo_model import demo_model_dir

    return str(demo_model_dir())


def serve_models(config: ServerModels, args: argparse.Namespace, api_key: str | None) -> int:
    """Serve the models (see the module docstring): a registry of them behind the front, on uvicorn.

    A model served alone (``serve DIR``) is a registry of one: pinned and loaded now, its cache sized from the free
    memory, with no budget (it has the machine); several are loaded on demand within the budget, pinned ones now.
    """
    from .app import create_front
    from .registry.kinds import LOADERS
    from .registry.models import ModelRegistry, budget_text

    logger.setLevel(logging.INFO)  # loads and unloads, and one line per request
    one = alone(args)
    loaders = {
        kind: (partial(plan, alone=one), partial(load, engine=args.engine)) for kind, (plan, load) in LOADERS.items()
    }
    registry = ModelRegistry(config, loaders=loaders, budget=UNBOUNDED if one else None)
    if one:
        refuse_engine_flags(registry.entries[config.names[0]].kind, args)
    app = create_front(registry, api_key=api_key, limits=limits_of(args), freeze_gc=True)
    registry.load_pinned_now()
    where = f"http://{args.host}:{args.port}/v1"
    if one:
        e = registry.entries[config.names[0]]
        print(f"serving {e.name} ({e.runtime.backend_name}) on {where}", file=sys.stderr)
    else:
        logger.info(
            "serving %s on %s (budget: %s; a model loads on its first request, pinned ones are loaded)",
            ", ".join(config.names),
            where,
            budget_text(registry.budget),
        )
    return run_http(app, args)


def refuse_engine_flags(kind: str, args: argparse.Namespace) -> None:
    """Refuse ``--engine``/``--engines`` for one model that is not a chat model (known once its files are read).

    Raises:
        InvalidSettingsError: naming the flags and why.
    """
    given = ["--" + name for name in ("engine", "engines") if _given(args, name)]
    if kind != "chat" and given:
        from ..errors import InvalidSettingsError

        raise InvalidSettingsError(
            f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} not read with one {kind} model: its "
            "batches run on a worker thread of the server, in no engine process; leave it out."
        )


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


def alone(args: argparse.Namespace) -> bool:
    """Whether ``serve`` serves one model alone (one directory or none, no config file)."""
    return not args.config and len([*args.model, *args.model_dir]) <= 1


def serve_command(args: argparse.Namespace) -> int:
    """Run ``exllama-integrations serve`` with its parsed flags (see the module docstring); the exit status."""
    import os

    refuse_unread(args)
    if args.ray:
        from .ray.deployment import ray_serve

        ray_serve()  # the extra, if it is missing, named before anything else runs
    key = args.api_key or os.environ.get("EXLLAMA_API_KEY")
    config = models_of(args)
    if args.ray:
        from .ray.deployment import run_ray

        return run_ray(config, args, key)
    return serve_models(config, args, key)


__all__ = [
    "UNREAD",
    "limits_of",
    "load_options",
    "models_of",
    "refuse_unread",
    "run_http",
    "serve_command",
    "serve_models",
]
