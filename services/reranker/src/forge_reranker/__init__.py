"""Forge reranker service."""
