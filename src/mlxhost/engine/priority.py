"""Priority classes: who is admitted first and who may preempt whom. Imports no tensor library.

Lower classes run first (as vLLM's), then earlier arrivals. A waiting request moves one class up for every
`priority_aging_steps` steps since it arrived, so a low class under a steady stream of better ones still gets
its turn. A request of a better class may preempt running requests of worse ones (the scheduler decides how
many it needs and sends them back to the queue).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable

from mlxhost.config import EngineConfig
from mlxhost.engine.request import Request


class PriorityOrder:
    """Owns each request's arrival (the step it arrived at, and its arrival number: the tie-break within a class),
    each running request's rank when admitted, and the step count aging reads (the scheduler's `tick`)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.num_steps = 0
        self._arrived: dict[str, int] = {}  # request id (waiting or running) -> its arrival step
        self._order: dict[str, int] = {}  # request id -> arrival number
        self._arrivals = itertools.count()
        # Running request id -> its effective priority when admitted: what a newcomer must beat to preempt it.
        self._admitted_rank: dict[str, int] = {}

    def tick(self) -> None:
        self.num_steps += 1

    def arrive(self, request: Request) -> None:
        self._arrived[request.request_id] = self.num_steps
        self._order[request.request_id] = next(self._arrivals)

    def admit(self, request: Request) -> None:
        self._admitted_rank[request.request_id] = self.rank(request)

    def preempted(self, request_id: str) -> None:
        """Back in the queue: it keeps its arrival (its aging and place go on), not its admitted rank."""
        del self._admitted_rank[request_id]

    def forget(self, request_id: str) -> None:
        self._arrived.pop(request_id, None)
        self._order.pop(request_id, None)
        self._admitted_rank.pop(request_id, None)

    def num_waited_steps(self, request: Request) -> int:
        return self.num_steps - self._arrived[request.request_id]

    def rank(self, request: Request) -> int:
        """Its effective priority: one class better for every `priority_aging_steps` steps since it arrived."""
        aging = self.config.priority_aging_steps
        if not aging:
            return request.priority
        return request.priority - self.num_waited_steps(request) // aging

    def admitted_rank(self, request_id: str) -> int:
        return self._admitted_rank[request_id]

    def sorted(self, waiting: deque[Request]) -> deque[Request]:
        """The queue in admission order: rank, then arrival."""
        # Arrival order is the queue's own order while every request is of one class and none was preempted.
        if len(waiting) > 1 and any(r.priority != waiting[0].priority or r.num_preemptions for r in waiting):
            order = self._order
            return deque(sorted(waiting, key=lambda r: (self.rank(r), order[r.request_id])))
        return waiting

    def can_preempt(self, victim: Request, request: Request) -> bool:
        """Whether `request` (waiting) may preempt `victim` (running): a strictly better class than the
        victim's, both as asked and as aged, and a victim whose output a recompute reproduces (no grammar,
        penalties or seeded sampling, whose state the runner rebuilds from the prompt alone)."""
        sp = victim.sampling
        return (request.priority < victim.priority
                and self.rank(request) < self._admitted_rank[victim.request_id]
                and self.config.speculative == "off"
                and sp.constraint is None and sp.prompt_logprobs is None and not sp.needs_processors
                and (sp.seed is None or sp.is_greedy) and not victim.media)

    def victims(self, running: Iterable[Request], request: Request) -> list[Request]:
        """The running requests `request` may preempt, the ones to send back first first: the worst classes,
        and within one the latest arrivals."""
        return sorted((r for r in running if self.can_preempt(r, request)),
                      key=lambda r: (self._admitted_rank[r.request_id], self._order[r.request_id]), reverse=True)
