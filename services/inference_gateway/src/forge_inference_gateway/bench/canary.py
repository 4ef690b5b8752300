"""``forge bench canary --out DIR``: the guarded canary's analysis on live traffic through the gateway.

Real: each model is a replica of its own, a model_server process serving a random tiny Llama
(the same weights for all four), behind the same kind of front (:mod:`forge_inference_gateway.
fault_replica`, in this process, so every model takes the same extra hop): ``prod`` (production)
and ``identical`` unchanged, ``errors`` (5 % of requests answered 500) and ``slow``, whose front
reaches its model server through a delaying TCP proxy (:class:`forge_kit.testing.fault_proxy.
FaultProxy`): every chunk each way arrives later, so each request's TTFT at the client grows by
``--slowdown`` (0.5) x production's client TTFT p95 under the run's load (measured first, with
the identical candidate: a delay sized on an idle replica vanished in the spread of a loaded
one). A gateway process routes to the four. The alias ``forge-chat`` names ``prod``.

1. preflight: the injected faults must reach the client before any rule is judged. Requests for
   each candidate and for ``prod`` take turns at the run's fixed rate (pinned by name, through
   the gateway); a faulty
   candidate whose faults are not measurable at the client (``slow``: its TTFT median not above
   production's by half the injected delay; ``errors``: no more errors than production) is
   reported ``arms_not_different`` and not judged;
2. each candidate in turn becomes the canary at the policy's share (``policies/canary/bench.yaml``),
   sticky per ``user``. Streamed completions arrive at a fixed rate; every ``interval_s`` the
   gateway's ``/metrics`` are read and :func:`forge_experiments.canary.analyze` (the orchestrator's
   analysis) decides, until ``promote`` or ``rollback`` or the window (with its extensions) ends.

Resampled: the false-rollback rate over ``--repetitions`` seeded repetitions replays the same
sequential analysis (same policy, rate, share and looks) on per-request outcomes drawn with
replacement from those the client recorded in the real run of each candidate and of production
(status, TTFT, mean inter-token gap; a 5xx the gateway relays as 502 stays an error).

Writes ``DIR/summary.json``: ``candidates.{identical,errors,slow}.{decision,decided_after_s,
requests_seen}`` from the real runs (with each one's ``preflight``), ``false_rollback_rate``
(identical candidate, resampled) and every figure behind them.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import typer

from forge_experiments.canary import (
    CanaryPolicy,
    Outcome,
    SplitCounts,
    analyze,
    counts_of,
    load_policy,
    parse_metrics,
)
from forge_inference_gateway.bench import start_gateway
from forge_inference_gateway.bench import start_model_server as launch_model_server
from forge_inference_gateway.bench.fault_replica import fault_replica
from forge_kit.http import HttpServer
from forge_kit.testing import ServiceProcess
from forge_kit.testing.fault_proxy import FaultProxy

TOKEN = "bench-canary-token"
API_KEY = "bench-canary-key"
PRODUCTION = "prod"
CANDIDATES: dict[str, dict[str, float]] = {
    "identical": {},
    "errors": {"error_rate": 0.05},
    "slow": {},
}
IDENTICAL = "identical"
#: The candidate whose replica is reached through the delaying proxy.
SLOW = "slow"
#: Requests per arm in a candidate's preflight (at 5 % injected errors, 0 of 100 has p = 0.006).
PREFLIGHT_REQUESTS = 100
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wise",
    "owls",
    "watch",
    "from",
    "an",
    "old",
    "oak",
]

app = typer.Typer(add_completion=False, help="Benchmarks (canary).")


@app.callback()
def bench() -> None:
    """Benchmarks (``forge bench canary``)."""


@dataclass
class Sent:
    arm: str
    status: str
    ttft_s: float | None
    itl_s: float | None
    at_s: float


async def send(
    client: httpx.AsyncClient, user: str, prompt: str, max_tokens: int, t0: float, model: str = "forge-chat"
) -> Sent:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "user": user,
    }
    started = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as reply:
            arm = reply.headers.get("x-forge-model", "")
            if reply.status_code != 200:
                await reply.aread()
                return Sent(arm, str(reply.status_code), None, None, started - t0)
            first: float | None = None
            events = 0
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if '"error"' in line:
                    return Sent(arm, "broken", None, None, started - t0)
                events += 1
                if first is None:
                    first = time.perf_counter()
            end = time.perf_counter()
    except httpx.HTTPError:
        return Sent("", "unavailable", None, None, started - t0)
    ttft = (first - started) if first is not None else None
    itl = (end - first) / (events - 1) if first is not None and events > 1 else None
    return Sent(arm, "200", ttft, itl, started - t0)


async def scrape(client: httpx.AsyncClient, candidate: str) -> tuple[SplitCounts, SplitCounts]:
    text = (await client.get("/metrics")).text
    counts = parse_metrics(text, [(candidate, "canary"), (PRODUCTION, "stable")])
    return counts[(candidate, "canary")], counts[(PRODUCTION, "stable")]


async def real_run(
    gateway: str, candidate: str, policy: CanaryPolicy, rate: float, max_tokens: int, seed: int
) -> dict[str, Any]:
    """One candidate as canary under fixed-rate traffic until the analysis decides."""
    admin = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=gateway, headers=admin, timeout=30) as control:
        reply = await control.put(
            "/admin/v1/aliases/forge-chat/canary",
            json={"model": {"name": candidate}, "weight": policy.traffic_percent},
        )
        reply.raise_for_status()
        start_c, start_p = await scrape(control, candidate)
        rng = random.Random(seed)
        sent: list[asyncio.Task[Sent]] = []
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(
            base_url=gateway, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60, limits=limits
        ) as traffic:
            t0 = time.perf_counter()
            stop = asyncio.Event()

            async def drive() -> None:
                i = 0
                while not stop.is_set():
                    due = t0 + i / rate
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
                    prompt = " ".join(rng.choice(WORDS) for _ in range(12))
                    user = f"user-{rng.randrange(1_000_000)}"
                    sent.append(asyncio.create_task(send(traffic, user, prompt, max_tokens, t0)))
                    i += 1

            driver = asyncio.create_task(drive())
            previous: dict[str, list[float]] = {}
            extensions, looks = 0, 0
            result = None
            while True:
                await asyncio.sleep(max(0.0, t0 + (looks + 1) * policy.interval_s - time.perf_counter()))
                looks += 1
                now_c, now_p = await scrape(control, candidate)
                elapsed = time.perf_counter() - t0
                result = analyze(
                    now_c.minus(start_c),
                    now_p.minus(start_p),
                    policy,
                    elapsed_s=elapsed,
                    extensions=extensions,
                    previous=previous,
                )
                previous = result.p_values()
                if result.decision == "extend":
                    extensions += 1
                elif result.decision != "continue":
                    break
            stop.set()
            await driver
            outcomes = await asyncio.gather(*sent)
        await control.delete("/admin/v1/aliases/forge-chat/canary")
    errors = result.metrics["errors"]
    return {
        "decision": result.decision,
        "decided_after_s": result.elapsed_s,
        "requests_seen": errors.canary_n,
        "production_requests_seen": errors.production_n,
        "reason": result.reason,
        "looks": looks,
        "extensions": extensions,
        "evidence": result.evidence(),
        "client": [asdict(o) for o in outcomes],
    }


def outcome_of(sent: dict[str, Any]) -> Outcome:
    return Outcome(sent["status"], sent["ttft_s"], sent["itl_s"], False)


def resampled(
    canary: list[Outcome], production: list[Outcome], policy: CanaryPolicy, rate: float, seed: int
) -> tuple[str, float, int]:
    """The sequential analysis replayed on outcomes drawn with replacement (see module docstring)."""
    rng = np.random.default_rng(seed)
    share = policy.traffic_percent / 100
    c_all: list[Outcome] = []
    p_all: list[Outcome] = []
    previous: dict[str, list[float]] = {}
    extensions, t = 0, 0.0
    while True:
        t += policy.interval_s
        arrivals = rng.poisson(rate * policy.interval_s)
        to_canary = int(rng.binomial(arrivals, share))
        c_all += [canary[i] for i in rng.integers(0, len(canary), to_canary)]
        p_all += [production[i] for i in rng.integers(0, len(production), arrivals - to_canary)]
        result = analyze(
            counts_of(c_all), counts_of(p_all), policy, elapsed_s=t, extensions=extensions, previous=previous
        )
        previous = result.p_values()
        if result.decision == "extend":
            extensions += 1
        elif result.decision != "continue":
            return result.decision, round(t, 3), len(c_all)


def start_model_server(models: Path, work: Path, threads: int, name: str) -> ServiceProcess:
    return launch_model_server(
        models,
        work,
        TOKEN,
        log_name=f"model_server-{name}.log",
        settings={"TORCH_THREADS": str(threads)},
        timeout_s=180,
    )


async def wait_routable(gateway: str, models: list[str]) -> None:
    """Until the gateway lists every model (its replicas scraped) and each answers once."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=gateway, headers=headers, timeout=60) as client:
        for _ in range(300):
            listed = {m["id"] for m in (await client.get("/v1/models")).json()["data"]}
            if set(models) <= listed:
                break
            await asyncio.sleep(0.2)
        for model in models:
            for _ in range(3):
                body = {"model": model, "prompt": "to be", "max_tokens": 4, "temperature": 0}
                await client.post("/v1/completions", json=body)


async def measure(
    gateway: str, arms: list[str], n: int, rate: float, max_tokens: int, seed: int
) -> dict[str, list[Sent]]:
    """``n`` streamed requests per arm, pinned by model name, the arms taking turns at ``rate``
    requests/s in all (a canary run's load, split as the policy's 50 % splits it)."""
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=gateway, headers=headers, timeout=60, limits=limits) as client:
        t0 = time.perf_counter()
        tasks: list[tuple[str, asyncio.Task[Sent]]] = []
        for i in range(n * len(arms)):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            arm = arms[i % len(arms)]
            prompt = " ".join(rng.choice(WORDS) for _ in range(12))
            user = f"pre-{rng.randrange(10**6)}"
            tasks.append((arm, asyncio.create_task(send(client, user, prompt, max_tokens, t0, arm))))
        sent = await asyncio.gather(*(task for _, task in tasks))
    out: dict[str, list[Sent]] = {arm: [] for arm in arms}
    for (arm, _), one in zip(tasks, sent, strict=True):
        out[arm].append(one)
    return out


def _ttft_ms(sent: list[Sent], q: float) -> float | None:
    ttft = [s.ttft_s for s in sent if s.ttft_s is not None]
    return round(1000 * float(np.percentile(ttft, q)), 2) if ttft else None


def _error_rate(sent: list[Sent]) -> float:
    return round(sum(s.status != "200" for s in sent) / max(1, len(sent)), 4)


def preflight(name: str, candidate: list[Sent], production: list[Sent], injected_ms: float) -> dict[str, Any]:
    """Whether ``name``'s injected fault is measurable at the client (step 1 of the module docstring)."""
    c50, p50 = _ttft_ms(candidate, 50), _ttft_ms(production, 50)
    c_err, p_err = _error_rate(candidate), _error_rate(production)
    if name == SLOW:
        differs = c50 is not None and p50 is not None and c50 - p50 >= injected_ms / 2
    elif CANDIDATES[name].get("error_rate"):
        differs = c_err > p_err
    else:
        differs = None  # nothing injected: nothing that must differ
    return {
        "requests_per_arm": len(candidate),
        "candidate_ttft_p50_ms": c50,
        "production_ttft_p50_ms": p50,
        "candidate_error_rate": c_err,
        "production_error_rate": p_err,
        "injected_ttft_ms": round(injected_ms, 2) if name == SLOW else 0.0,
        "arms_differ": differs,
    }


async def run_bench(out: Path, policy: CanaryPolicy, args: dict[str, Any]) -> dict[str, dict[str, Any]]:
    from forge_kit.testing.tiny_llama import save_tiny_llama

    work = Path(tempfile.mkdtemp(prefix="canary-bench-"))
    servers: dict[str, ServiceProcess] = {}
    wrappers: list[HttpServer] = []
    proxy: FaultProxy | None = None
    gateway_process: ServiceProcess | None = None
    runs: dict[str, dict[str, Any]] = {}
    try:
        # Every model a replica of its own, the same weights in each.
        for name in (PRODUCTION, *CANDIDATES):
            save_tiny_llama(
                work / name / name, seed=args["seed"], hidden=args["hidden"], layers=args["layers"]
            )
            servers[name] = start_model_server(work / name, work, args["threads"], name)
        upstream = urlsplit(servers[SLOW].http_url)
        proxy = FaultProxy((upstream.hostname or "127.0.0.1", upstream.port or 80), name=SLOW).start()
        for name in (PRODUCTION, *CANDIDATES):
            server = f"http://{proxy.address}" if name == SLOW else servers[name].http_url
            app = fault_replica(
                server, name=name, serves=name, token=TOKEN, seed=args["seed"], **CANDIDATES.get(name, {})
            )
            wrapper = HttpServer(app, "127.0.0.1", 0)
            await wrapper.start()
            wrappers.append(wrapper)
        gateway_process = start_gateway(
            [f"http://127.0.0.1:{w.port}" for w in wrappers],
            work,
            TOKEN,
            API_KEY,
            # The slow replica's scrapes cross the delaying proxy too: no ejection for that.
            settings={"SCRAPE_TIMEOUT_S": "10"},
            timeout_s=60,
        )
        gateway = gateway_process.http_url
        async with httpx.AsyncClient(base_url=gateway, headers={"Authorization": f"Bearer {TOKEN}"}) as admin:
            (
                await admin.put("/admin/v1/aliases/forge-chat", json={"model": {"name": PRODUCTION}})
            ).raise_for_status()
        await wait_routable(gateway, [PRODUCTION, *CANDIDATES])
        # Calibration, which is also the identical candidate's preflight: production's client TTFT
        # p95 with the fixed-rate traffic split between two replicas, as in a canary run; the slow
        # candidate's delay is a share of it.
        calibration = await measure(
            gateway,
            [IDENTICAL, PRODUCTION],
            PREFLIGHT_REQUESTS,
            args["rate"],
            args["max_tokens"],
            args["seed"],
        )
        injected_ms = args["slowdown"] * (_ttft_ms(calibration[PRODUCTION], 95) or 0.0)
        # Each chunk is held once each way: the request going up, then the first answer coming down.
        proxy.configure(latency_s=injected_ms / 2000)
        for i, name in enumerate(CANDIDATES):
            arms = calibration
            if name != IDENTICAL:
                arms = await measure(
                    gateway,
                    [name, PRODUCTION],
                    PREFLIGHT_REQUESTS,
                    args["rate"],
                    args["max_tokens"],
                    args["seed"] + 100 + i,
                )
            check = preflight(name, arms[name], arms[PRODUCTION], injected_ms)
            typer.echo(f"preflight {name}: {json.dumps(check)}", err=True)
            if check["arms_differ"] is False:
                runs[name] = {"decision": "arms_not_different", "preflight": check, "client": []}
                continue
            typer.echo(f"canary {name}: fixed {args['rate']:g} req/s through the gateway …", err=True)
            runs[name] = await real_run(
                gateway, name, policy, args["rate"], args["max_tokens"], args["seed"] + i
            )
            runs[name]["preflight"] = check
            typer.echo(
                f"  {runs[name]['decision']} after {runs[name]['decided_after_s']:.1f}s, "
                f"{runs[name]['requests_seen']} canary requests ({runs[name]['reason']})",
                err=True,
            )
    finally:
        if gateway_process is not None:
            gateway_process.stop()
        for wrapper in wrappers:
            await wrapper.stop()
        if proxy is not None:
            proxy.stop()
        for process in servers.values():
            process.stop()
    shutil.rmtree(work, ignore_errors=True)
    return runs


def summarize(runs: dict[str, dict[str, Any]], policy: CanaryPolicy, args: dict[str, Any]) -> dict[str, Any]:
    production_pool = [
        outcome_of(o) for run in runs.values() for o in run["client"] if o["arm"] == PRODUCTION
    ]
    candidates: dict[str, Any] = {}
    repetitions: dict[str, Any] = {}
    deadline = policy.deadline_s(policy.max_extensions)
    for name, run in runs.items():
        if not run["client"]:
            # Not judged: the injected fault did not reach the client (the preflight says how far).
            candidates[name] = {
                "decision": run["decision"],
                "decided_after_s": None,
                "requests_seen": 0,
                "within_window": False,
                "preflight": run["preflight"],
            }
            continue
        pool = [outcome_of(o) for o in run["client"] if o["arm"] == name]
        # Each candidate against the production requests of its own run (the same minutes of load).
        own = [outcome_of(o) for o in run["client"] if o["arm"] == PRODUCTION]
        reps = [resampled(pool, own, policy, args["rate"], seed) for seed in range(args["repetitions"])]
        decisions = [d for d, _, _ in reps]
        repetitions[name] = {
            "decisions": {d: decisions.count(d) for d in sorted(set(decisions))},
            "decided_after_s_median": float(np.median([t for _, t, _ in reps])),
            "requests_seen_median": float(np.median([n for _, _, n in reps])),
        }
        client = [o for o in run["client"] if o["arm"] == name]
        ttft = [o["ttft_s"] for o in client if o["ttft_s"] is not None]
        itl = [o["itl_s"] for o in client if o["itl_s"] is not None]
        own_ttft = [o["ttft_s"] for o in run["client"] if o["arm"] == PRODUCTION and o["ttft_s"] is not None]
        candidates[name] = {
            "decision": run["decision"],
            "decided_after_s": run["decided_after_s"],
            "requests_seen": run["requests_seen"],
            "production_requests_seen": run["production_requests_seen"],
            "reason": run["reason"],
            "within_window": run["decided_after_s"] <= deadline,
            "client_error_rate": round(sum(o["status"] != "200" for o in client) / max(1, len(client)), 4),
            "client_ttft_p95_ms": round(1000 * float(np.percentile(ttft, 95)), 2) if ttft else None,
            "client_itl_p95_ms": round(1000 * float(np.percentile(itl, 95)), 2) if itl else None,
            "production_client_ttft_p95_ms": (
                round(1000 * float(np.percentile(own_ttft, 95)), 2) if own_ttft else None
            ),
            "preflight": run["preflight"],
            "evidence": run["evidence"],
        }
    p_ttft = [o.ttft_s for o in production_pool if o.ttft_s is not None]
    p_itl = [o.itl_s for o in production_pool if o.itl_s is not None]
    identical = repetitions.get("identical", {}).get("decisions", {})
    false_rollback = identical.get("rollback", 0) / args["repetitions"]
    met = {
        "identical_promoted": candidates["identical"]["decision"] == "promote",
        "errors_rolled_back": candidates["errors"]["decision"] == "rollback",
        "slow_rolled_back": candidates["slow"]["decision"] == "rollback",
        "within_window": all(c["within_window"] for c in candidates.values()),
        "faults_reached_client": all(c["preflight"]["arms_differ"] is not False for c in candidates.values()),
        "false_rollback_rate_at_most_0.05": false_rollback <= 0.05,
    }
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": (
            f"forge bench canary --out {args['out']} --rate {args['rate']:g} --repetitions {args['repetitions']}"
            f" --policy {policy.family} --seed {args['seed']} --slowdown {args['slowdown']:g}"
        ),
        "policy": policy.model_dump(),
        "rate_rps": args["rate"],
        "max_tokens": args["max_tokens"],
        "candidates": candidates,
        "false_rollback_rate": false_rollback,
        "repetitions": {
            "n": args["repetitions"],
            "method": "sequential analysis replayed on per-request outcomes resampled (with replacement) "
            "from the real run's client records of each arm; Poisson arrivals at rate_rps, canary share "
            "binomial at the policy's traffic_percent",
            **repetitions,
        },
        "production": {
            "requests": len(production_pool),
            "client_ttft_p95_ms": round(1000 * float(np.percentile(p_ttft, 95)), 2) if p_ttft else None,
            "client_itl_p95_ms": round(1000 * float(np.percentile(p_itl, 95)), 2) if p_itl else None,
        },
        "targets_met": met,
    }


@app.command()
def canary(
    out: Annotated[Path, typer.Option(help="Directory for summary.json.")],
    rate: Annotated[float, typer.Option(min=1, max=200, help="Requests per second, fixed.")] = 10.0,
    repetitions: Annotated[int, typer.Option(min=1, max=1000)] = 20,
    policy_family: Annotated[str, typer.Option("--policy", help="Canary policy family.")] = "bench",
    max_tokens: Annotated[int, typer.Option(min=1, max=256)] = 8,
    threads: Annotated[int, typer.Option(min=1, max=64, help="Model server torch threads.")] = 1,
    hidden: Annotated[int, typer.Option(min=16, max=1024)] = 64,
    layers: Annotated[int, typer.Option(min=1, max=16)] = 2,
    slowdown: Annotated[
        float, typer.Option(min=0.05, max=10, help="The slow candidate's added TTFT, x production's p95.")
    ] = 0.5,
    seed: int = 0,
) -> None:
    """Production and three candidates (identical, 5 % errors, +50 % TTFT) on replicas of their own."""
    policy = load_policy(policy_family)
    args = {
        "out": str(out),
        "rate": rate,
        "repetitions": repetitions,
        "max_tokens": max_tokens,
        "threads": threads,
        "hidden": hidden,
        "layers": layers,
        "seed": seed,
        "slowdown": slowdown,
    }
    out.mkdir(parents=True, exist_ok=True)
    runs = asyncio.run(run_bench(out, policy, args))
    summary = summarize(runs, policy, args)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    typer.echo(
        json.dumps(
            {
                "candidates": {
                    k: {f: v[f] for f in ("decision", "decided_after_s", "requests_seen")}
                    for k, v in summary["candidates"].items()
                },
                "false_rollback_rate": summary["false_rollback_rate"],
                "targets_met": summary["targets_met"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    app()
