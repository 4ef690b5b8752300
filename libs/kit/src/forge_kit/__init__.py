"""Shared building blocks for Forge services.

Each module is one concern: ``settings``, ``grpckit``, ``kafka`` (events and the transactional
outbox), ``db``, ``cache``, ``objectstore``, ``http``, ``logs``, ``errors`` and ``testing``.
"""
