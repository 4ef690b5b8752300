"""The engine, split as vLLM v1's is: the synchronous core (``core``: paged KV blocks, the
scheduler, one step at a time), the asyncio engine that drives it and loads models
(``async_engine``), and the incremental detokenizer of its outputs (``detokenize``)."""
