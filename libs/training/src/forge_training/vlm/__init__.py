"""Vision-language models: data, model, export and evaluation of Forge's VLM path.

Contract with serving (model server, gateway, eval service) — what an exported VLM folder is:

- **Model**: transformers' ``LlavaForConditionalGeneration`` (``config.json``: ``model_type:
  "llava"``, ``architectures: ["LlavaForConditionalGeneration"]``): a ``CLIPVisionModel`` tower
  (``vision_config``, ``clip_vision_model``: patch embedding + ViT; the recipes' ``image_size``
  32 and ``patch_size`` 8, 16 patches, 4 per cell of the synthetic world's 2 x 2 grid), the
  two-layer GELU MLP ``multi_modal_projector``, and a Llama text model (``text_config``,
  ``llama``, ``architectures: ["LlamaForCausalLM"]``) initialised from a Forge causal-LM parent. Features are the last
  encoder layer's (``vision_feature_layer: -1``, before ``post_layernorm``) with CLS dropped
  (``vision_feature_select_strategy: "default"``).
- **Weights** (``model.safetensors``, the names of published LLaVA-1.5 checkpoints):
  ``vision_tower.vision_model.*``, ``multi_modal_projector.linear_1/linear_2.*``,
  ``language_model.model.*`` (the Llama body) and ``language_model.lm_head.weight``
  (transformers 5.25 writes ``vision_tower.*`` without ``vision_model``; :func:`model.export_vlm`
  renames it, and transformers loads either). Loaded, the
  module names are ``model.vision_tower.*``, ``model.multi_modal_projector.*``,
  ``model.language_model.*`` and ``lm_head.*`` (transformers maps them).
- **Image token**: the tokenizer (``tokenizer.json``, Forge's byte-level BPE of the parent with
  ``<|endoftext|>`` as bos/eos/pad) has the special token ``<image>`` whose id is
  ``config.image_token_id`` (written to ``config.json`` as ``image_token_index``). Each image
  is ONE ``<image>`` in the rendered text, expanded to ``config.image_seq_length`` copies of the
  id (= (image_size / patch_size)^2 patches) before the forward; the model replaces those
  embeddings by the image's projected patches, in order over the flattened batch.
  :meth:`tokens.SequenceEncoder.prompt_ids` does the expansion; HF's ``LlavaProcessor`` loaded
  from the folder gives the same ids (tested).
- **Chat template** (:data:`model.CHAT_TEMPLATE`, in ``tokenizer_config.json`` and
  ``chat_template.jinja``): ``User: {content}\\n`` / ``Assistant: {content}<|endoftext|>\\n``,
  generation prompt ``Assistant:``; a content list renders its parts with nothing between them,
  an image part (``{"type": "image"}`` or ``{"type": "image_url", ...}``) as ``<image>``, a text
  part as its text. Python twin: :func:`model.render_chat`.
- **Pixels**: :func:`images.preprocess` (bytes -> ``[3, S, S]``): Pillow decode (PNG, JPEG,
  WebP, GIF; size and pixel limits: :class:`images.ImageError`), RGB, bicubic resize to S x S,
  /255, per-channel (x - mean) / std with CLIP's mean/std. ``preprocessor_config.json`` holds
  the ``CLIPImageProcessor`` settings that give the same tensor (no centre crop; tested equal),
  ``processor_config.json`` a ``LlavaProcessor`` (patch size, strategy), so
  ``AutoProcessor.from_pretrained(folder)`` works. Serving calls :func:`model.load_vlm` and
  :func:`images.preprocess`; it need not use the HF processor.

vLLM: its ``LlavaForConditionalGeneration`` reads this layout (CLIP tower + Llama via
``text_config``, the legacy weight names, ``image_token_index``, ``vision_feature_layer``,
the ``default`` strategy) and builds prompts with the folder's ``LlavaProcessor``; what it cannot
do is in ``load/vlm/README.md`` (tiny sizes, e.g. head sizes its attention kernels refuse).

Modules: :mod:`.world` (the synthetic visual world), :mod:`.dataset` (it written as shards),
:mod:`.shards` (WebDataset / Parquet reader and writer; LAION and OBELICS mappings),
:mod:`.images`, :mod:`.tokens` (placeholders, labels, batches), :mod:`.model`, :mod:`.metrics`.
"""
