"""Forge preference feedback service: comparisons, rater preferences and the reward-model registry."""
