"""The models the engine runs (vLLM's ``model_executor``): the Llama forward over the paged KV
cache (``llama``), the step's attention plan (``paged_plan``), the native decode-attention kernel
and packed linear layers (``kernels``, built from ``csrc/``), and the LLaVA vision tower and the
image embeddings (``vision``, ``multimodal``)."""
