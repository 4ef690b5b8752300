"""Forge eval service: eval runs, statistics, the model registry and the release gate."""
