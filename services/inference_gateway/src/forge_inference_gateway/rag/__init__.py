"""Retrieval-augmented answers: the service (``service``: retrieve → rerank → assemble →
generate), the request's parsing and limits (``query``), the retriever and reranker clients
(``clients``), the context assembly (``context``) and the chat-shaped answers (``chat``)."""
