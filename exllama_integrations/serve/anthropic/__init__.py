"""Anthropic's Messages API (``POST /v1/messages``), over the one prepared chat, in the APIs' file vocabulary.

:mod:`.protocol` (its wire models), :mod:`.convert` (a request to the chat request, a reply to the Messages
shapes), :mod:`.stream` (a streamed reply's events), :mod:`.endpoint` (the routes), :mod:`.errors` (Anthropic's
error shapes). Nothing here is decided twice: the chat layer and the contract's values decide.
"""
