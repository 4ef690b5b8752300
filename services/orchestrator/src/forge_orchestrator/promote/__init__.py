"""Releases: the ``eval_and_promote`` workflow (the candidate against production on the release
suite, then a guarded canary), its eval and canary activities, and the API's check of its input."""
