"""Ray Serve: replicas of one model behind Ray's proxy (``build_app`` for ``serve run`` and config files)."""

from .deployment import build_app, run_ray

__all__ = ["build_app", "run_ray"]
