"""Anthropic's Messages API (``POST /v1/messages``): its wire models, its endpoint and its stream framing.

Over the one prepared chat (:mod:`exllama_integrations.chat.prepare`) and the contract's values, as the OpenAI
endpoints are; nothing here is decided twice.
"""
