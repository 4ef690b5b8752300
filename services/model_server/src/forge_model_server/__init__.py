"""Forge model server: one LLM replica behind the OpenAI-compatible HTTP API and gRPC."""
