"""Serving one loaded model to many processes: the OpenAI-compatible app, its client runtime, Ray Serve replicas.

``create_app`` (extra ``serve``), ``RemoteRuntime`` (extra ``remote``: httpx only) and ``build_app``
for Ray Serve (extra ``ray``) are imported from their modules, so that using one needs only its extra.
"""

__all__: list[str] = []
