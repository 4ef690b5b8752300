"""Forge orchestrator service: Temporal workflows over the other services."""
