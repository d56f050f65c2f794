"""The exllamav3 backend, a module per role.

The exllamav3 backend, by role: backend (load and free), driver (the Generator's thread), options and cache
sizing, translate (requests to Jobs, results to steps), extras (LoRA, draft model), patches (upstream fixes),
upstream/ (the one place exllamav3 is imported, and what the package relies on in it, declared and checked).
"""

from .backend import ExLlamaV3Backend

__all__ = ["ExLlamaV3Backend"]
