"""The orchestrator's steps of the platform main job (entry-point group ``forge.main_job``), one
module per step, which ``forge up`` calls with its main-job context once every service is healthy:
:mod:`.smoke` (order 10), :mod:`.serve` (``retire`` 15 and ``serve`` 42: the trained model on vLLM
replicas the scheduler places), :mod:`.tracking` (45), :mod:`.chat` (70), :mod:`.rlhf` (80, with
the simulated raters of :mod:`.raters`) and :mod:`.sweep` (90).

The steps never import the CLI or another service: they reach the platform through
``ctx.endpoint(name)`` (``grpc_target``, ``http_url``, ``token``), ``ctx.results`` and
``ctx.object_store_url`` (``forge_kit.mainjob.MainJobContext``).
"""
