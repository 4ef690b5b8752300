"""Tenants: API keys, priority classes, rate limits and their training-prompt consent."""
