"""OpenAI's Responses API (``POST /v1/responses``), over the one prepared chat.

:mod:`.request` (the request model and its chat), :mod:`.response` (the response object and its items),
:mod:`.events` (the stream's event sequence) and :mod:`.endpoint` (the route). No state is kept between
requests: a client sends the whole conversation as ``input`` items, as with ``store: false``.
"""
