"""Reward-model scoring outside training: :mod:`.eval` (held-out pairs scored with a checkpoint,
what ``forge rm eval`` runs), :mod:`.score` (``python -m forge_training.rm.score``, the same as a
job: the RLHF round's reward gate) and :mod:`.residual` (``python -m forge_training.rm.residual``:
the post-hoc length-decorrelated reward)."""
