"""Forge's experiment science: how experiments are specified, stopped, analysed and judged, with
no torch and no service in it (the training library and the orchestrator build on it; serving
services never import it)."""
