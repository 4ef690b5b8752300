"""The transports (vLLM's ``entrypoints``): the OpenAI-compatible HTTP API (``openai_api``, with
its image inputs, ``image_inputs``, fetched by ``safe_fetch`` where allowed), the tokenizer routes
(``tokenizer_api``), the admin routes (``admin_api``) and the gRPC servicer (``grpc_api``).
Translation only: the domain is :mod:`forge_model_server.service`."""
