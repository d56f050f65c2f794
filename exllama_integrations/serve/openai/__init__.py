"""The OpenAI-compatible endpoints, for third-party clients.

The OpenAI-compatible endpoints, for third-party clients: protocol models (requests and responses), one module
per endpoint, and the SSE framing they share.
"""
