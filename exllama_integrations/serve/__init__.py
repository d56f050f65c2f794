"""Serving one loaded model to many processes.

Serving one loaded model to many processes: the HTTP app (OpenAI-compatible endpoints and the native wire
endpoints) and Ray Serve replicas. The client side, ``RemoteRuntime``, is
:mod:`exllama_integrations.runtime.remote`.

``create_app`` (extra ``serve``) and ``build_app`` for Ray Serve (extra ``ray``) are imported from their
modules, so that using one needs only its extra.
"""

__all__: list[str] = []
