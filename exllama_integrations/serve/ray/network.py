"""How every process Ray starts for us is networked: NVLink multicast off, replicas' gRPC on the node's address."""

from __future__ import annotations

import os
from typing import Any

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""Set in every replica (and the driver): a program that uses NVLink multicast can take shared GPUs down."""
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""With this set before Ray starts, a local Ray keeps all of its traffic on 127.0.0.1."""
PROXY_READY_S = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}
"""How long Ray Serve's controller waits for a new HTTP proxy to say it is ready (Ray Serve 2.60: 5 s, then the proxy
is killed and ``serve.start()`` fails with ``ActorDiedError`` instead of waiting for the next one; a proxy on a busy
machine takes longer than 5 s to import). 60 s is how long ``serve.start()`` itself waits (``HTTP_PROXY_TIMEOUT``).
A value the user set wins."""


def before_ray_starts(host: str) -> None:
    """The environment a local Ray inherits when it starts (its controller, proxies and replicas read it)."""
    if host in ("127.0.0.1", "localhost"):
        os.environ.update(LOOPBACK)
    os.environ.update(NO_MULTICAST)
    for k, v in PROXY_READY_S.items():
        os.environ.setdefault(k, v)


def bind_replica_grpc_to_node_address() -> bool:
    """Make this replica's inter-deployment gRPC server listen on the node's own address, not every interface.

    Ray Serve 2.60 starts it with ``"[::]:0"`` (replica.py, after the user constructor, which is where this
    runs). Bound to the address Ray knows the node by, other nodes still reach it, and a local Ray
    (node 127.0.0.1) listens on loopback only. ``EXLLAMA_RAY_BIND_ALL=1`` keeps Ray's own behaviour.
    Returns whether the binding was changed.
    """
    if os.environ.get("EXLLAMA_RAY_BIND_ALL") == "1":
        return False
    try:
        import ray
        from ray.serve._private import replica
    except ImportError:
        return False
    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "_node_address", False):
        return False
    node = ray.util.get_node_ip_address()
    host = f"[{node}]" if ":" in node else node

    def bind(server: Any, address: str) -> Any:
        if address.startswith("[::]:"):
            address = f"{host}:{address.rsplit(':', 1)[1]}"
        return original(server, address)

    bind._node_address = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = bind
    return True
