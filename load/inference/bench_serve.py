"""Serving benchmark with vLLM's ``bench serve`` methodology: ``forge load inference`` as a script.

    python load/inference/bench_serve.py --base-url URL --model NAME
        (--request-rate R | --max-concurrency C) --num-prompts N --out DIR [options]

The load generator lives in the gateway package (:mod:`forge_inference_gateway.bench.loadgen`) so that
the ``forge`` CLI can run it; this file keeps the script form working. Options: ``--help``.
"""

from __future__ import annotations

import sys

from forge_inference_gateway.bench.load_cli import app

if __name__ == "__main__":
    app(args=["inference", *sys.argv[1:]], prog_name="bench_serve.py")
