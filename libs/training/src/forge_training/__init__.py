"""Forge's training runtime: recipes, tokenizer, token shards, one training loop with DDP or FSDP
for pre-training, continual pre-training, SFT, reward models and DPO, checkpoints published by atomic
manifests, and Hugging Face export.

Entry point for a job: ``python -m forge_training.run --recipe NAME`` (under
``torchrun`` for several processes; see :class:`forge_trainer_agent.runner.TorchrunRunner`).
"""
