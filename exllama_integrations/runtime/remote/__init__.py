"""The contract over HTTP: :class:`RemoteRuntime` speaks a server's native wire endpoint (extra ``remote``)."""

from .runtime import RemoteRuntime

__all__ = ["RemoteRuntime"]
