"""The service chassis every Forge package builds on.

Each module is one concern: ``settings``, ``grpckit``, ``events``, ``outbox`` and ``consumer``,
``db``, ``cache``, ``objectstore``, ``http``, ``logs``, ``errors``, ``localinfra`` (how the local
broker and MLflow are launched) and ``testing``. Experiment science lives in
:mod:`forge_experiments`, training in :mod:`forge_training`.
"""
