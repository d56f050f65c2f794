"""The OpenAI-compatible endpoints, for third-party clients, in the APIs' file vocabulary.

:mod:`.protocol` (the wire models, one module an API), :mod:`.convert` (a chat completions request to the chat
request, a reply to its message), :mod:`.stream` (OpenAI's SSE framing, and a chat reply's chunks),
:mod:`.endpoint` (the chat completions route); the OpenAI-only APIs each a module of their own
(:mod:`.completions`, :mod:`.embeddings`, :mod:`.tokenize`), :mod:`.choices` (several generations
answered as one response).
"""
