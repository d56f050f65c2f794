"""OpenAI's Responses API (``POST /v1/responses``), over the one prepared chat, in the APIs' file vocabulary.

:mod:`.protocol` (the request and response wire models), :mod:`.convert` (a request to the chat request),
:mod:`.stream` (a reply as the API's events, and the response they build), :mod:`.endpoint` (the route),
:mod:`.truncation` (``truncation: "auto"``). No state is kept between requests: a client sends the whole
conversation as ``input`` items, as with ``store: false``.
"""
