"""OpenAI's Decisions API (``POST /v1/decisions``) over the runtime's label scoring: protocol, convert, endpoint."""
