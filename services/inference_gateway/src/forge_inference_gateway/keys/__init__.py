"""A tenant's API keys: the lifecycle (``service``: authenticate, scopes, expiry, rotation,
revocation, usage, audit), its HTTP routes (``api``) and its tables (``rows``)."""
