"""Forge retriever service."""
