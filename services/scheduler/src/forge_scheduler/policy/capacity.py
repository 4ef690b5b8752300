"""Free-GPU index with best-fit buckets, so placing one gang costs O(GPUs per node), not O(nodes).

Buckets are insertion-ordered dicts (never sets): the node picked among equals depends only on the
order of operations, so the same input always gives the same placement.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from forge_scheduler.policy.model import ANY_GPU_TYPE, Job, Node, Placement

Slots = tuple[tuple[str, int], ...]


class CapacityIndex:
    """Free GPUs of a set of nodes; ``take``/``give`` keep the best-fit buckets in step."""

    def __init__(self, nodes: Iterable[Node], free: Mapping[str, int]) -> None:
        self.nodes: dict[str, Node] = {}
        self.free: dict[str, int] = {}
        self._by_type: dict[str, list[dict[str, None]]] = {}
        self._by_group: dict[tuple[str, str], list[dict[str, None]]] = {}
        self.type_free: dict[str, int] = {}
        self.group_free: dict[tuple[str, str], int] = {}
        self._groups_of_type: dict[str, list[str]] = {}
        self.max_gpus = 0
        self._total_free = 0
        for node in nodes:
            self.add_node(node, free.get(node.name, node.gpus))

    def copy(self) -> CapacityIndex:
        """An independent copy (trial placements for preemption must not touch the real one)."""
        other = CapacityIndex([], {})
        other.nodes = dict(self.nodes)
        other.free = dict(self.free)
        other._by_type = {k: [dict(b) for b in v] for k, v in self._by_type.items()}
        other._by_group = {k: [dict(b) for b in v] for k, v in self._by_group.items()}
        other.type_free = dict(self.type_free)
        other.group_free = dict(self.group_free)
        other._groups_of_type = {k: list(v) for k, v in self._groups_of_type.items()}
        other.max_gpus = self.max_gpus
        other._total_free = self._total_free
        return other

    def add_node(self, node: Node, free: int) -> None:
        """Put ``node`` (with ``free`` GPUs) under this index."""
        self.nodes[node.name] = node
        self.free[node.name] = free
        self.max_gpus = max(self.max_gpus, node.gpus)
        t, g = node.gpu_type, (node.gpu_type, node.group)
        for key, table in ((t, self._by_type), (g, self._by_group)):
            buckets = table.setdefault(key, [])  # type: ignore[arg-type]
            while len(buckets) <= node.gpus:
                buckets.append({})
            buckets[free][node.name] = None
        if g not in self.group_free:
            self._groups_of_type.setdefault(t, []).append(node.group)
        self.type_free[t] = self.type_free.get(t, 0) + free
        self.group_free[g] = self.group_free.get(g, 0) + free
        self._total_free += free

    def remove_node(self, name: str) -> int:
        """Take ``name`` out of the index (a reservation); returns its free GPUs."""
        node = self.nodes.pop(name)
        free = self.free.pop(name)
        self._by_type[node.gpu_type][free].pop(name)
        self._by_group[(node.gpu_type, node.group)][free].pop(name)
        self.type_free[node.gpu_type] -= free
        self.group_free[(node.gpu_type, node.group)] -= free
        self._total_free -= free
        return free

    def _move(self, name: str, delta: int) -> None:
        node = self.nodes[name]
        old = self.free[name]
        new = old + delta
        if new < 0 or new > node.gpus:
            raise ValueError(f"node {name}: free GPUs would become {new}")
        self.free[name] = new
        g = (node.gpu_type, node.group)
        for buckets in (self._by_type[node.gpu_type], self._by_group[g]):
            buckets[old].pop(name)
            buckets[new][name] = None
        self.type_free[node.gpu_type] += delta
        self.group_free[g] += delta
        self._total_free += delta

    def take(self, slots: Slots) -> None:
        for name, gpus in slots:
            self._move(name, -gpus)

    def give(self, slots: Slots) -> None:
        for name, gpus in slots:
            if name in self.nodes:
                self._move(name, gpus)

    @property
    def total_free(self) -> int:
        return self._total_free

    def types_for(self, job: Job) -> list[str]:
        if job.gpu_type != ANY_GPU_TYPE:
            return [job.gpu_type] if job.gpu_type in self.type_free else []
        return sorted(self.type_free)

    def by_free(self, types: list[str]) -> Iterator[tuple[int, list[Node]]]:
        """Nodes of ``types`` grouped by free GPUs, most free first (empty levels skipped)."""
        top = max((len(self._by_type[t]) for t in types if t in self._by_type), default=0)
        for free in range(top - 1, -1, -1):
            level = [
                self.nodes[name]
                for t in types
                if free < len(self._by_type.get(t, ()))
                for name in self._by_type[t][free]
            ]
            if level:
                yield free, level

    def _best(self, buckets: list[dict[str, None]], need: int) -> str | None:
        for free in range(need, len(buckets)):
            bucket = buckets[free]
            if bucket:
                return next(iter(bucket))
        return None

    def largest_block(self, job: Job) -> int:
        """Largest free amount a gang of this shape could use at once (for pending reasons)."""
        best = 0
        for t in self.types_for(job):
            if job.placement is Placement.SAME_NODE:
                buckets = self._by_type[t]
                best = max(best, next((f for f in range(len(buckets) - 1, -1, -1) if buckets[f]), 0))
            elif job.placement is Placement.SAME_GROUP:
                best = max(best, max((self.group_free[(t, g)] for g in self._groups_of_type[t]), default=0))
            else:
                best = max(best, self.type_free[t])
        return best

    def place(self, job: Job, commit: bool = True) -> Slots | None:
        """Best-fit placement of the whole gang, or ``None``; all-or-nothing.

        Best fit (the node with the fewest free GPUs that still fits) keeps whole nodes and whole
        groups free for the large gangs that need them, which is what limits fragmentation.
        """
        need, per = job.gpus, job.gpus_per_task
        for t in self.types_for(job):
            if self.type_free[t] < need:
                continue
            if job.placement is Placement.SAME_NODE:
                name = self._best(self._by_type[t], need)
                if name is None:
                    continue
                slots: Slots = tuple((name, per) for _ in range(job.tasks))
                if commit:
                    self.take(slots)
                return slots
            if job.placement is Placement.ANY:
                found = self._greedy(self._by_type[t], job.tasks, per)
                if found is not None:
                    if not commit:
                        self.give(found)
                    return found
                continue
            groups = sorted(
                (g for g in self._groups_of_type[t] if self.group_free[(t, g)] >= need),
                key=lambda g: (self.group_free[(t, g)], g),
            )
            for g in groups:
                found = self._greedy(self._by_group[(t, g)], job.tasks, per)
                if found is not None:
                    if not commit:
                        self.give(found)
                    return found
        return None

    def _greedy(self, buckets: list[dict[str, None]], tasks: int, per: int) -> Slots | None:
        """Tasks one by one, each on the best-fitting node; rolls back on failure."""
        # greedy succeeds exactly when the nodes hold ``tasks`` slots of ``per`` between them
        slots = 0
        for free in range(per, len(buckets)):
            if buckets[free]:
                slots += len(buckets[free]) * (free // per)
        if slots < tasks:
            return None
        taken: list[tuple[str, int]] = []
        for _ in range(tasks):
            name = self._best(buckets, per)
            if name is None:
                self.give(tuple(taken))
                return None
            self._move(name, -per)
            taken.append((name, per))
        return tuple(taken)
