"""Engine throughput against Hugging Face ``generate`` on the same weights, in one run.

    python load/inference/bench_engine.py --out DIR [options]

The same as ``forge bench engine --out DIR [options]``; the benchmark lives in the model server
package (``forge_model_server/bench.py``, where its method and options are described) so the
``forge`` command can run it. Writes ``DIR/summary.json``.
"""

from __future__ import annotations

import sys

from forge_model_server.bench import app

if __name__ == "__main__":
    app(args=["engine", *sys.argv[1:]], prog_name="bench_engine.py")
