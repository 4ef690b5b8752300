"""Forge inference gateway: the public inference API in front of the model servers."""
