"""A model directory and what reads it.

A model directory and what reads it: directory checks, config, files, hub ids, the native tokenizer, the chat
template (sandboxed), the detokenizer and stop strings, and grammars compiled against the tokenizer.
"""
