"""Forge trainer agent: one per node, runs the job replicas the scheduler assigns to it."""
