"""Trace-driven simulator: the policy engine under a simulated clock, with baselines side by side."""
