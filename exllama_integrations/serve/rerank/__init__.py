"""The rerank API in the shape Cohere, Jina and the RAG tools speak (``/v1/rerank``, ``/rerank``, ``/v2/rerank``)."""
