"""Forge's load, soak and stress scenarios (``python -m load``; ``make load``, ``make bench``)."""
