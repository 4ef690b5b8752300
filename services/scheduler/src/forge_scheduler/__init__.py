"""Forge scheduler service."""
