"""The model-server replicas behind the gateway: their load, their health, and which one serves a request.

Every replica speaks the vLLM HTTP protocol (Forge's ``model_server`` or ``vllm serve``) and says how
loaded it is on ``/metrics`` under vLLM's names: ``vllm:num_requests_waiting``,
``vllm:num_requests_running`` and ``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` on
older vLLM). :meth:`ReplicaPool.refresh` scrapes them all on a short interval, and its
``/v1/models`` less often, so the pool knows what each replica serves.

Picking a replica (:meth:`ReplicaPool.pick`), as the Gateway API Inference Extension's endpoint
picker and SGLang's cache-aware router do:

1. candidates: healthy replicas that serve the model (its name, and its version when one is
   pinned); when none lists it, the healthy replicas whose models are not known yet, then any
   healthy replica (whose 404 then reaches the caller unchanged); none at all — every replica
   ejected, or an empty pool (none configured, none added yet) — is :class:`NoReplicaError` (503);
2. room: a replica takes a request while its estimated load is under ``max_inflight``, and a
   request below the top priority only while it is under ``max_inflight * (1 - reserve)`` — the
   rest is held for interactive traffic — and its KV cache is under ``kv_high``;
3. score = estimated load / ``max_inflight`` + ``kv_weight`` × KV use, lower is better; the
   estimated load is what the replica reported (waiting + running) plus what this gateway sent it
   since that scrape, and never less than this gateway's own requests in flight on it;
4. prefix affinity: the replica that served the longest run of the request's leading prompt
   blocks (an approximate prefix tree per gateway, as SGLang's router keeps) wins if its score is
   within ``affinity_slack`` of the best, so shared prompts land where their KV blocks are cached;
5. otherwise the least-loaded, ties broken at random (injected).

Health: a scrape or a request that cannot reach a replica counts a failure; ``eject_after``
failures in a row eject it for a back-off that doubles up to ``eject_max_s``; once the back-off is
over it is scraped again and comes back on the first answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import structlog
from prometheus_client import Counter, Gauge

from forge_inference_gateway.replicas.upstream import ModelServerClient, UpstreamUnavailableError, error_for
from forge_kit import errors
from forge_kit.modelref import ModelRef

log = structlog.get_logger(__name__)

REPLICA_HEALTHY = Gauge(
    "forge_gateway_replica_healthy", "1 while a model-server replica is routable", ["replica"]
)
REPLICA_LOAD = Gauge(
    "forge_gateway_replica_load", "Estimated requests on a replica (scraped + sent since)", ["replica"]
)
REPLICA_KV = Gauge(
    "forge_gateway_replica_kv_cache_usage", "A replica's reported KV-cache use, 0-1", ["replica"]
)
ROUTED = Counter(
    "forge_gateway_routed_total", "Requests sent to a replica, by why it was picked", ["replica", "reason"]
)
EJECTIONS = Counter("forge_gateway_replica_ejections_total", "Replicas taken out of routing", ["replica"])

#: vLLM gauge names the pool reads; the KV gauge has had two names across vLLM releases.
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


class NoReplicaError(UpstreamUnavailableError):
    """No healthy replica can serve the model now; retry after the next probe."""


@dataclass(frozen=True)
class RoutingPolicy:
    """How replicas are picked and health-checked (see the module docstring)."""

    max_inflight: int = 64
    reserve: float = 0.25
    kv_high: float = 0.95
    kv_weight: float = 1.0
    affinity_slack: float = 0.25
    block_chars: int = 64
    max_blocks: int = 32
    eject_after: int = 2
    eject_base_s: float = 2.0
    eject_max_s: float = 60.0
    scrape_timeout_s: float = 1.0
    models_refresh_s: float = 10.0

    def room_for(self, level: int) -> float:
        """Estimated load under which a replica takes a request of priority ``level`` (0 = top)."""
        return float(self.max_inflight) if level == 0 else self.max_inflight * (1.0 - self.reserve)


@dataclass(frozen=True)
class Load:
    """What a replica reported about itself in one scrape, summed over the models it serves."""

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0


def parse_load(text: str) -> Load:
    """The vLLM gauges in a Prometheus text exposition (one sample per line); absent ones are 0."""
    waiting = running = 0.0
    kv = 0.0
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, value = match.group(1), match.group(3)
        try:
            number = float(value)
        except ValueError:
            continue
        if not math.isfinite(number):
            continue
        if name == WAITING:
            waiting += number
        elif name == RUNNING:
            running += number
        elif name in KV_USAGE:
            kv = max(kv, number)
    return Load(waiting=waiting, running=running, kv_usage=kv)


@dataclass
class Replica:
    """One model-server replica as the pool tracks it."""

    url: str
    client: ModelServerClient
    source: str = "config"
    cards: dict[str, dict[str, object]] | None = None
    load: Load = field(default_factory=Load)
    inflight: int = 0
    inflight_at_scrape: int = 0
    scraped_at: float | None = None
    models_at: float | None = None
    healthy: bool = True
    failures: int = 0
    ejected_until: float = 0.0
    backoff_s: float = 0.0
    last_error: errors.ForgeError | None = None
    models_error: errors.ForgeError | None = None
    removed: bool = False

    def serves(self, wanted: ModelRef) -> bool | None:
        """Whether it serves ``wanted`` (its name, and its version when one is pinned); None while
        its model list is not known."""
        if self.cards is None:
            return None
        served = self.served(wanted.name)
        return served is not None and wanted.matches(served)

    def served(self, name: str) -> ModelRef | None:
        """The model version it lists under ``name`` (its ``/v1/models`` card), or None."""
        card = (self.cards or {}).get(name)
        if card is None:
            return None
        try:
            return ModelRef(name, str(card.get("version") or ""))
        except ValueError:
            return ModelRef(name)  # a version outside the grammar: known by its name only

    def answering(self, model: ModelRef) -> ModelRef:
        """The version that answers a request for ``model`` here: its pinned one, else the one
        this replica lists under the name."""
        served = None if model.pinned else self.served(model.name)
        return served if served is not None else model

    def estimated_load(self) -> float:
        """Requests on the replica now, as best this gateway can tell (see the module docstring)."""
        scraped = self.load.waiting + self.load.running
        return float(max(self.inflight, scraped + self.inflight - self.inflight_at_scrape))

    def score(self, policy: RoutingPolicy) -> float:
        return self.estimated_load() / policy.max_inflight + policy.kv_weight * self.load.kv_usage

    def has_room(self, level: int, policy: RoutingPolicy) -> bool:
        if self.estimated_load() >= policy.room_for(level):
            return False
        return level == 0 or self.load.kv_usage < policy.kv_high

    def view(self) -> dict[str, object]:
        """What the admin API shows."""
        return {
            "url": self.url,
            "source": self.source,
            "healthy": self.healthy,
            "failures": self.failures,
            "models": sorted(self.cards) if self.cards is not None else None,
            "load": {
                "waiting": self.load.waiting,
                "running": self.load.running,
                "kv_cache_usage": self.load.kv_usage,
                "estimated": self.estimated_load(),
            },
            "in_flight": self.inflight,
            "last_error": self.last_error.message if self.last_error else None,
            "models_error": self.models_error.message if self.models_error else None,
        }


class PrefixIndex:
    """Which replicas served which leading prompt blocks: an approximate, bounded prefix tree.

    A prompt is cut into blocks of ``block_chars`` characters; block ``i``'s key hashes blocks
    ``0..i``, so a key stands for a whole prefix. The least recently used keys go first.
    """

    def __init__(self, block_chars: int, max_blocks: int, capacity: int = 100_000) -> None:
        self._block = block_chars
        self._max_blocks = max_blocks
        self._capacity = capacity
        self._owners: OrderedDict[bytes, set[str]] = OrderedDict()

    def keys(self, text: str) -> list[bytes]:
        """Chained hashes of the full blocks of ``text`` (a partial last block is not cached either)."""
        keys: list[bytes] = []
        digest = hashlib.blake2b(digest_size=16)
        for i in range(min(len(text) // self._block, self._max_blocks)):
            digest.update(text[i * self._block : (i + 1) * self._block].encode())
            keys.append(digest.copy().digest())
        return keys

    def matches(self, keys: list[bytes]) -> dict[str, int]:
        """For each replica that served a prefix of ``keys``: how many leading blocks it has."""
        depth: dict[str, int] = {}
        alive: set[str] | None = None
        for i, key in enumerate(keys):
            owners = self._owners.get(key)
            if not owners:
                break
            alive = set(owners) if alive is None else alive & owners
            if not alive:
                break
            for url in alive:
                depth[url] = i + 1
        return depth

    def record(self, keys: list[bytes], url: str) -> None:
        for key in keys:
            owners = self._owners.get(key)
            if owners is None:
                owners = self._owners[key] = set()
            owners.add(url)
            self._owners.move_to_end(key)
        while len(self._owners) > self._capacity:
            self._owners.popitem(last=False)

    def forget(self, url: str) -> None:
        for owners in self._owners.values():
            owners.discard(url)


@dataclass(frozen=True)
class Pick:
    replica: Replica
    reason: str


class ReplicaPool:
    """The replicas, their scraped state, and the picking policy.

    Called by the admission controller (``pick``, ``release``), by the gateway's control loop
    (``refresh``, ``sync``) and by the admin API (``add``, ``remove``, ``replicas``).
    ``client_factory`` builds the client of each configured replica (``urls``; it holds the
    gateway's model-server credential); ``admin_client_factory`` that of each replica added at run
    time, from its URL and the token issued for it (empty: none) — the gateway's own credential
    never goes to an address an admin added.
    """

    def __init__(
        self,
        urls: Iterable[str],
        client_factory: Callable[[str], ModelServerClient],
        policy: RoutingPolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        admin_client_factory: Callable[[str, str], ModelServerClient] | None = None,
    ) -> None:
        self.policy = policy or RoutingPolicy()
        self._make_client = client_factory
        self._make_admin_client = admin_client_factory or (
            lambda url, token: ModelServerClient(url, token or None)
        )
        self._tokens: dict[str, str] = {}
        """Token of each admin-added replica, to tell when the store's changed."""
        self._clock = clock
        self._rng = rng or random.Random()
        self._replicas: dict[str, Replica] = {}
        self.prefixes = PrefixIndex(self.policy.block_chars, self.policy.max_blocks)
        self._listeners: list[Callable[[], None]] = []
        self._closing: set[asyncio.Task[None]] = set()
        for url in urls:
            self.add(url, source="config")

    # -- membership --------------------------------------------------------------------------

    def add(self, url: str, source: str = "admin", token: str = "") -> Replica:
        """Start routing to ``url``; routable at once, loaded as zero until its first scrape. An
        admin-added replica is sent ``token`` (the credential issued for it), never the gateway's."""
        url = normalize_url(url)
        if url in self._replicas:
            raise errors.AlreadyExistsError(f"replica {url} is already in the pool")
        if source == "config":
            client = self._make_client(url)
        else:
            client = self._make_admin_client(url, token)
            self._tokens[url] = token
        replica = Replica(url=url, client=client, source=source)
        self._replicas[url] = replica
        REPLICA_HEALTHY.labels(url).set(1)
        self._changed()
        return replica

    async def remove(self, url: str) -> None:
        """Stop routing to ``url``; requests already on it finish there."""
        url = normalize_url(url)
        replica = self._replicas.pop(url, None)
        if replica is None:
            raise errors.NotFoundError(f"replica {url} is not in the pool")
        replica.removed = True
        self._tokens.pop(url, None)
        self.prefixes.forget(url)
        for gauge in (REPLICA_HEALTHY, REPLICA_LOAD, REPLICA_KV):
            gauge.remove(url)
        if replica.inflight == 0:
            await replica.client.close()

    async def sync(self, replicas: Mapping[str, str]) -> None:
        """Make the admin-added replicas exactly ``replicas`` (URL → its token; configured ones
        stay); one whose token changed gets a new client."""
        wanted = {normalize_url(u): token for u, token in replicas.items()}
        for url, replica in list(self._replicas.items()):
            if replica.source == "admin" and (url not in wanted or wanted[url] != self._tokens.get(url)):
                await self.remove(url)
        for url, token in wanted.items():  # in the order given: set order would vary per process
            if url not in self._replicas:
                self.add(url, source="admin", token=token)

    def has(self, url: str) -> bool:
        return normalize_url(url) in self._replicas

    def get(self, url: str) -> Replica:
        replica = self._replicas.get(normalize_url(url))
        if replica is None:
            raise errors.NotFoundError(f"replica {url} is not in the pool")
        return replica

    def replicas(self) -> list[Replica]:
        return sorted(self._replicas.values(), key=lambda r: r.url)

    def subscribe(self, listener: Callable[[], None]) -> None:
        """``listener()`` runs whenever capacity may have appeared (scrape, recovery, new replica)."""
        self._listeners.append(listener)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    # -- picking -----------------------------------------------------------------------------

    def candidates(self, target: ModelRef, exclude: frozenset[str] = frozenset()) -> list[Replica]:
        """Step 1 of picking: the healthy replicas that serve (or may serve) ``target``."""
        healthy = [r for r in self._replicas.values() if r.healthy and r.url not in exclude]
        for wanted in (True, None):
            found = [r for r in healthy if r.serves(target) is wanted]
            if found:
                return found
        return healthy

    def serving(self, model: ModelRef, previous: ModelRef | None) -> ModelRef:
        """Where an alias naming ``model`` (and ``previous`` before it) sends its stable traffic:
        ``previous`` while no healthy replica may serve ``model`` — none lists it or is unlisted
        yet, and no configured upstream lists its name (Forge's model server loads any registered
        version of a model it serves) — and one serves ``previous``; else ``model``. A promotion
        applied while the new version's replicas start moves the alias once one of them is ready."""
        healthy = [r for r in self._replicas.values() if r.healthy]
        if previous is None or any(
            r.serves(model) is not False or (r.source == "config" and r.served(model.name)) for r in healthy
        ):
            return model
        return previous if any(r.serves(previous) for r in healthy) else model

    def check_servable(self, target: ModelRef, exclude: frozenset[str] = frozenset()) -> None:
        """Raise :class:`NoReplicaError` when no healthy replica is left that could take ``target``."""
        if not self.candidates(target, exclude):
            raise self.no_replica(target)

    def no_replica(self, target: ModelRef) -> NoReplicaError:
        """Why nothing can take ``target`` now: every replica is ejected (or already tried), or the
        pool is empty — none configured, and no deployment has added a ready replica yet."""
        if not self._replicas:
            return NoReplicaError(
                f"no model-server replica serves {str(target)!r}: the gateway's replica pool is empty "
                "(a deployment adds its replicas once they answer)",
                self.retry_after_s(),
            )
        return NoReplicaError(f"no healthy model-server replica for {str(target)!r}", self.retry_after_s())

    def pick(
        self, target: ModelRef, level: int, prefix: list[bytes], exclude: frozenset[str] = frozenset()
    ) -> Pick | None:
        """A replica for the request and why, or None when every candidate is full for ``level``.

        Raises :class:`NoReplicaError` when no healthy replica is left to try at all. The pick takes
        a slot (``inflight``) that :meth:`release` gives back.
        """
        candidates = self.candidates(target, exclude)
        if not candidates:
            raise self.no_replica(target)
        policy = self.policy
        room = [r for r in candidates if r.has_room(level, policy)]
        if not room:
            return None
        scores = {r.url: r.score(policy) for r in room}
        best = min(room, key=lambda r: (scores[r.url], self._rng.random()))
        chosen, reason = best, "least_load"
        depth = self.prefixes.matches(prefix) if prefix else {}
        if depth:
            affine = max(room, key=lambda r: (depth.get(r.url, 0), -scores[r.url]))
            if depth.get(affine.url, 0) and scores[affine.url] <= scores[best.url] + policy.affinity_slack:
                chosen, reason = affine, "prefix"
        chosen.inflight += 1
        if prefix:
            self.prefixes.record(prefix, chosen.url)
        ROUTED.labels(chosen.url, reason).inc()
        REPLICA_LOAD.labels(chosen.url).set(chosen.estimated_load())
        return Pick(chosen, reason)

    def release(self, replica: Replica) -> None:
        """Give back the slot a pick took (synchronous: it runs in ``finally`` blocks of streams)."""
        replica.inflight -= 1
        if replica.removed:
            if replica.inflight == 0:
                self._close_later(replica)
            return
        REPLICA_LOAD.labels(replica.url).set(replica.estimated_load())

    def _close_later(self, replica: Replica) -> None:
        task = asyncio.get_running_loop().create_task(replica.client.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def retry_after_s(self) -> float:
        """Seconds until the soonest ejected replica is probed again (at least 1)."""
        now = self._clock()
        waits = [r.ejected_until - now for r in self._replicas.values() if not r.healthy]
        return max(1.0, min(waits, default=1.0))

    # -- health ------------------------------------------------------------------------------

    def report_failure(self, replica: Replica, error: errors.ForgeError) -> None:
        """A scrape or a request could not reach ``replica``; eject it after ``eject_after`` in a row."""
        replica.failures += 1
        replica.last_error = error
        policy = self.policy
        if replica.healthy and replica.failures >= policy.eject_after:
            replica.healthy = False
            replica.backoff_s = policy.eject_base_s
            replica.ejected_until = self._clock() + replica.backoff_s
            EJECTIONS.labels(replica.url).inc()
            REPLICA_HEALTHY.labels(replica.url).set(0)
            log.warning("replica.ejected", replica=replica.url, error=error.message, for_s=replica.backoff_s)
        elif not replica.healthy:
            replica.backoff_s = min(policy.eject_max_s, max(policy.eject_base_s, replica.backoff_s * 2))
            replica.ejected_until = self._clock() + replica.backoff_s

    def report_success(self, replica: Replica) -> None:
        replica.failures = 0
        replica.last_error = None
        if not replica.healthy:
            replica.healthy = True
            REPLICA_HEALTHY.labels(replica.url).set(1)
            log.info("replica.restored", replica=replica.url)
            self._changed()

    # -- scraping ----------------------------------------------------------------------------

    async def refresh(self) -> None:
        """One scrape of every replica that is due (healthy ones always, ejected ones after back-off)."""
        now = self._clock()
        due = [r for r in self._replicas.values() if r.healthy or now >= r.ejected_until]
        await asyncio.gather(*(self._scrape(r) for r in due))
        self._changed()

    async def ensure_known(self) -> None:
        """Scrape now when some replica has never been scraped (before the first loop round)."""
        if any(r.scraped_at is None for r in self._replicas.values()):
            await self.refresh()

    async def _scrape(self, replica: Replica) -> None:
        policy = self.policy
        try:
            reply = await replica.client.probe("/metrics", policy.scrape_timeout_s)
            if reply.status_code != 200:
                raise UpstreamUnavailableError(f"/metrics of {replica.url} answered {reply.status_code}")
            load = parse_load(reply.text)
            now = self._clock()
            if replica.cards is None or now - (replica.models_at or 0.0) >= policy.models_refresh_s:
                await self._scrape_models(replica)
        except UpstreamUnavailableError as exc:
            self.report_failure(replica, exc)
            return
        replica.load = load
        replica.inflight_at_scrape = replica.inflight
        replica.scraped_at = self._clock()
        REPLICA_LOAD.labels(replica.url).set(replica.estimated_load())
        REPLICA_KV.labels(replica.url).set(load.kv_usage)
        self.report_success(replica)

    async def _scrape_models(self, replica: Replica) -> None:
        reply = await replica.client.probe("/v1/models", self.policy.scrape_timeout_s)
        if reply.status_code != 200:
            # The replica is up but refuses the listing (a wrong token, say): keep routing to it —
            # its answers will say what is wrong — and keep the reason for list_models.
            replica.models_error = error_for(
                reply.status_code, reply.content, reply.headers.get("retry-after")
            )
            return
        try:
            payload = reply.json()
            data = payload.get("data") if isinstance(payload, dict) else None
            if not isinstance(data, list):
                raise ValueError("no data list")
            cards = fold_versions({str(c["id"]): dict(c) for c in data if isinstance(c, dict) and "id" in c})
        except ValueError:
            raise UpstreamUnavailableError(f"/v1/models of {replica.url} is not a model list") from None
        replica.cards = cards
        replica.models_error = None
        replica.models_at = self._clock()

    async def close(self) -> None:
        for replica in self._replicas.values():
            await replica.client.close()


def fold_versions(cards: dict[str, dict[str, object]]) -> dict[str, dict[str, object]]:
    """A replica's ``/v1/models`` cards by model name. vLLM's cards carry no version: a vLLM replica
    of a pinned version answers to ``name:version`` as well as ``name`` (a deployment serves it
    under both), so that card's version goes onto the name's card, and the ``name:version`` card
    is not listed apart."""
    out = dict(cards)
    for model_id in cards:
        try:
            ref = ModelRef.parse(model_id)
        except ValueError:
            continue
        named = out.get(ref.name)
        if ref.version and named is not None and not named.get("version"):
            out[ref.name] = {**named, "version": ref.version}
            del out[model_id]
    return out


def normalize_url(url: str) -> str:
    """A replica URL as the pool keys it; anything but ``http(s)://host[:port][/path]`` is refused."""
    url = url.strip().rstrip("/")
    try:
        parsed = urlsplit(url)
        port_ok = parsed.port is None or parsed.port > 0
    except ValueError as exc:
        raise errors.ValidationError("url", f"not a URL: {url!r} ({exc})") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname or not port_ok or " " in url:
        raise errors.ValidationError("url", f"must be http(s)://host[:port], got {url!r}")
    return url
