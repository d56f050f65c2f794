"""Ray Serve as two tiers: an ingress (the OpenAI app) in front of model replicas, routed by prompt prefix.

``build_app(args)`` is what ``serve run exllama_integrations.serve.ray:build_app model_dir=...`` and a
Serve config file call; ``exllama-integrations serve --ray --replicas N`` runs it on a local Ray
instance. Replicas and autoscaling are configuration (``num_replicas``, ``autoscaling_config``); routing
is Ray's request router with our policy (:mod:`.router`: the replica holding the prompt's prefix, else the
least loaded). Streaming responses stream through
the proxy; a client that disconnects cancels its request on the replica. Every process Ray starts
gets NVLink multicast switched off (shared multi-GPU hosts). Several models (``models=[...]``, ``serve --ray`` with
several directories or ``--config``) are a deployment each behind one ingress, which routes by the request's ``model``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from ...errors import MissingDependencyError
from .network import NO_MULTICAST, before_ray_starts, bind_replica_grpc_to_node_address

logger = logging.getLogger(__name__)


def ray_serve() -> Any:
    """Ray Serve, or the extra to install named (``serve --ray`` asks before anything else runs).

    Raises:
        MissingDependencyError: Ray or Ray Serve's own dependencies are not installed.
    """
    try:
        import ray  # noqa: F401 - Ray itself first: ``ray.serve`` alone can import without it half-installed
        from ray import serve
    except ImportError as e:
        missing = MissingDependencyError("ray[serve]", "ray", "Ray Serve replicas")
        # the package is installed from a clone (it is not on PyPI): say that command (ImportError's str is its msg)
        missing.msg = (
            f"Ray Serve is not installed (needed for serve --ray; {e}). Install the extra 'ray' in the clone of "
            'exllama-integrations you installed from: `pip install -e ".[ray]"`.'
        )
        missing.args = (missing.msg,)
        raise missing from None
    return serve


class ExLlamaModel:
    """A model replica: one runtime on the replica's GPU (or CPU), called by the ingress with plain request values."""

    def __init__(self, config: dict[str, Any]) -> None:
        """Load the model in this replica."""
        os.environ.update(NO_MULTICAST)
        bind_replica_grpc_to_node_address()
        from ray import serve

        from ...runtime.local import ExLlamaRuntime
        from ...runtime.local.registry import plan_serving

        backend = config.get("backend", "auto")
        plan = plan_serving(config["model_dir"], backend, config.get("runtime", {}), config.get("gpu_share", 1.0))
        self.runtime = ExLlamaRuntime(plan.model.path, plan.backend.name, plan=plan)  # the directory inspected once
        self.replica = str(serve.get_replica_context().replica_id.unique_id)

    def info(self) -> dict[str, Any]:
        """The model's facts in the wire form."""
        from ...contract import wire

        return wire.to_data(self.runtime.model_info())  # type: ignore[no-any-return]

    def tokenizer_files(self) -> dict[str, Any]:
        """The tokenizer's files (the ingress tokenizes with them)."""
        return self.runtime.tokenizer_files()

    def active(self) -> dict[str, Any]:
        """This replica and the generations it is running now."""
        return {"replica": self.replica, "active": self.runtime.active_requests}

    async def generate(self, data: dict[str, Any], blocks: list[int]) -> AsyncIterator[dict[str, Any]]:
        """A generation: this replica's name, then its chunks in the wire form (a typed error as ``{"error"}``).

        ``blocks`` are the prompt's block names, read by the request router only.
        """
        from ...contract import wire
        from ...errors import ExLlamaIntegrationsError, error_to_wire

        yield {"replica": self.replica}
        try:
            async for chunk in self.runtime.aopen(wire.loads_request(data)):
                yield wire.to_data(chunk)
        except ExLlamaIntegrationsError as e:
            yield {"error": error_to_wire(e)}

    def check_health(self) -> None:
        """Ray's health check: a closed runtime is an unhealthy replica."""
        if self.runtime.closed:
            raise RuntimeError("the runtime was closed")


def build_app(args: dict[str, Any]) -> Any:
    """A Serve application from plain arguments (what ``serve run`` and config files pass): two tiers.

    An ingress deployment (the OpenAI app; renders and tokenizes) in front of the model deployment, called
    through its handle with plain request values and routed by prompt prefix (:class:`.router.PrefixAwareRouter`).

    ``model_dir`` (required), ``backend``, ``runtime`` (load options, e.g. ``{"cache_size": 65536}``),
    ``num_replicas`` (an int or ``"auto"``), ``autoscaling_config`` (Ray's), ``num_gpus`` per model replica
    (default 1 where CUDA is visible, else 0; a fraction puts several on one GPU), ``num_cpus``,
    ``max_ongoing_requests`` (default 64), ``ingress_replicas`` (default 1), ``served_model_name``, ``api_key``,
    ``tool_format`` (the tool-call format chat requests are read and written in, instead of the model's),
    ``chat_template`` (jinja text that replaces the model's own template on the chat endpoints),
    ``limits`` (``max_tokens``, ``max_pending``, ``max_body_bytes``, ``allow_image_urls`` and ``image_url_allow``: the
    hosts and networks an image fetch may reach although they are not global).

    Several models: ``models``, a list of entries (each ``name``, ``model_dir`` and any of the per-model keys above:
    ``backend``, ``runtime``, ``num_replicas``, ``autoscaling_config``, ``num_gpus``, ``num_cpus``,
    ``max_ongoing_requests``, ``tool_format``, ``chat_template``, ``kind``), instead of ``model_dir``: one model
    deployment each behind one ingress, which sends a request to the deployment of the model it names.
    """
    serve = ray_serve()
    if args.get("models"):
        return _build_models(serve, args, list(args["models"]))
    if not args.get("model_dir"):
        from ...errors import InvalidSettingsError

        raise InvalidSettingsError("build_app needs model_dir (a model directory or Hub id), or models (a list).")
    keys = ("served_model_name", "api_key", "limits", "models", "ingress_replicas")
    one = {k: v for k, v in args.items() if k not in keys}
    return _build_models(serve, args, [{**one, "name": args.get("served_model_name") or ""}])  # "": its own name


def _model(serve: Any, args: dict[str, Any], name: str) -> tuple[Any, dict[str, Any]]:
    """One model's deployment, bound, and its configuration (what its replicas load)."""
    from ray.serve.config import RequestRouterConfig

    if args.get("tool_format") is not None:
        from ...chat.formats import find_format

        find_format(None, args["tool_format"])  # refused here, before any replica loads
    num_gpus = args.get("num_gpus")
    if num_gpus is None:
        from ...backends.base import cuda_available

        num_gpus = 1 if cuda_available() else 0
    env = {"runtime_env": {"env_vars": dict(NO_MULTICAST)}}
    options: dict[str, Any] = {
        "name": name,
        "ray_actor_options": {"num_gpus": float(num_gpus), "num_cpus": float(args.get("num_cpus", 1)), **env},
        "max_ongoing_requests": int(args.get("max_ongoing_requests", 64)),
        "health_check_period_s": 10,
        "request_router_config": RequestRouterConfig(
            request_router_class="exllama_integrations.serve.ray.router:PrefixAwareRouter"  # type: ignore[arg-type]
        ),
    }
    if args.get("autoscaling_config"):
        options["autoscaling_config"] = dict(args["autoscaling_config"])
    else:
        options["num_replicas"] = args.get("num_replicas", 1)
    config = {
        "model_dir": str(args["model_dir"]),
        "backend": args.get("backend", "auto"),
        "runtime": dict(args.get("runtime") or {}),
        "tool_format": args.get("tool_format"),
        "chat_template": args.get("chat_template"),
        "kind": args.get("kind") or "chat",
        "gpu_share": float(num_gpus) if 0 < float(num_gpus) < 1 else 1.0,
    }
    return serve.deployment(ExLlamaModel, **options).bind(config), config


def _server_keys(args: dict[str, Any]) -> dict[str, Any]:
    return {
        "served_model_name": args.get("served_model_name"),
        "api_key": args.get("api_key"),
        "limits": dict(args.get("limits") or {}),
    }


def _ingress_options(args: dict[str, Any]) -> dict[str, Any]:
    env = {"runtime_env": {"env_vars": dict(NO_MULTICAST)}}
    return {
        "name": "ExLlamaIngress",
        "num_replicas": int(args.get("ingress_replicas", 1)),
        "ray_actor_options": {"num_cpus": float(args.get("num_cpus", 1)), "num_gpus": 0, **env},
        "max_ongoing_requests": 4096,
    }


def _build_models(serve: Any, args: dict[str, Any], entries: list[dict[str, Any]]) -> Any:
    """A deployment each (``ExLlamaModel``, or ``ExLlamaModel-<i>`` for several) behind the one ingress.

    An entry named "" is served under the model's own name (``build_app(model_dir=...)`` without
    ``served_model_name``).
    """
    from ...errors import InvalidSettingsError
    from .ingress import ExLlamaIngress

    handles, configs = {}, {}
    for i, entry in enumerate(entries):
        entry = dict(entry)
        if not entry.get("model_dir"):
            raise InvalidSettingsError(f"models[{i}] needs model_dir (a model directory or Hub id).")
        if (entry.get("kind") or "chat") != "chat":
            raise InvalidSettingsError(
                f"models[{i}] is of kind {entry['kind']!r}: Ray's deployments serve chat models here; serve an "
                "embedding or rerank model with `exllama-integrations serve`."
            )
        name = entry.get("name")
        name = str(os.path.basename(str(entry["model_dir"]).rstrip("/")) if name is None else name)
        if name in handles:
            raise InvalidSettingsError(f"two models are named {name!r}; give each its own 'name'.")
        for key in ("num_gpus", "num_cpus"):  # the app's, unless the entry sets its own
            if entry.get(key) is None and args.get(key) is not None:
                entry[key] = args[key]
        deployment = "ExLlamaModel" if len(entries) == 1 else f"ExLlamaModel-{i}"
        handles[name], configs[name] = _model(serve, entry, deployment)
    ingress = serve.deployment(serve.ingress()(ExLlamaIngress), **_ingress_options(args))
    return ingress.bind(handles, {"models": configs, **_server_keys(args)})


def ray_entry(spec: Any, replicas: int) -> dict[str, Any]:
    """A served model (a :class:`~..registry.config.ModelSpec`) as ``build_app`` takes it (its ``models`` entries)."""
    return {
        "name": spec.name,
        "model_dir": spec.model_dir,
        "backend": spec.backend,
        "runtime": {k: v for k, v in spec.options.items() if v is not None},
        "kind": spec.kind or "chat",  # one found from its files on the nodes: Ray's deployments serve chat models
        "tool_format": spec.tool_format,
        "chat_template": spec.chat_template,
        "num_replicas": replicas,
    }


def run_ray(config: Any, args: Any, api_key: str | None) -> int:
    """``serve --ray``: what ``serve`` would serve (a :class:`~..registry.config.ServerModels`) as Ray deployments.

    One model or several, each a deployment behind the one ingress, the app of ``serve`` over them: a model served
    alone as ``build_app(model_dir=...)`` (its name ``--served-model-name``, else the model's own, as without
    ``--ray``), several (or a config file) as ``build_app(models=[...])``. Each model's replicas stay loaded (Ray
    places them by their ``num_gpus``; scaling is Ray's ``autoscaling_config``). Ray is started (or joined) here,
    serving on the flags' host and port until interrupted.
    """
    common = {"num_gpus": args.num_gpus, "api_key": api_key, "limits": limits_of_flags(args)}
    entries = [ray_entry(m, args.replicas) for m in config.models]
    what = f"{', '.join(config.names)} on {args.replicas} Ray replica(s) each"
    if len(entries) == 1 and not args.config:
        (entry,) = entries
        del entry["name"]
        return _run({**entry, "served_model_name": args.served_model_name, **common}, args.host, args.port, what)
    return _run({"models": entries, **common}, args.host, args.port, what)


def limits_of_flags(args: Any) -> dict[str, Any]:
    """The ``serve`` flags' limits as the plain values an app's configuration carries to Ray (``limits``)."""
    return {
        "max_tokens": args.max_tokens,
        "max_pending": args.max_pending,
        "max_body_bytes": args.max_body_bytes,
        "body_timeout": args.body_timeout,
        "allow_image_urls": args.allow_image_urls or None,
        "image_url_allow": args.image_url_allow or None,
    }


def _run(app_args: dict[str, Any], host: str, port: int, what: str) -> int:
    before_ray_starts(host)
    import ray

    serve = ray_serve()
    ray.init(include_dashboard=False, ignore_reinit_error=True)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(app_args), name="exllama", route_prefix="/")
    logger.warning("serving %s at http://%s:%d/v1", what, host, port)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
