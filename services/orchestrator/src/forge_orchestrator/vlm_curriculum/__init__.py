"""The VLM curriculum: the ``vlm_curriculum`` workflow (stages of training runs, each from the
previous one's checkpoint) and its input's check."""
