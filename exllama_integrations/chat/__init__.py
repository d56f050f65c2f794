"""Chat, decided once for every door.

Chat, decided once for every door: a chat call prepared into a request (history, tools, reasoning, grammars) and
a reply finished into an outcome (tool calls, reasoning apart, the constraint rule).
"""
