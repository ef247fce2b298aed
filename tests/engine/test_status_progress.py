"""A request's prefill progress as /v1/status lists it and the debug log says it, and a status snapshot over a long
waiting queue (every running request, the first waiting ones and a count of the rest). No model."""

from __future__ import annotations

import time
from collections import deque

from mlxhost.config import EngineConfig
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.engine.scheduler import Scheduler
from mlxhost.engine.status import (
    MAX_NUM_LISTED_WAITING,
    describe_progress,
    request_progress,
    requests_status,
    take_snapshot,
)


def test_progress_through_a_prefill():
    request = Request("r1", list(range(1000)), SamplingParams(max_tokens=4), eos_token_ids=frozenset({0}))
    assert request_progress(request, 5.0)["state"] == "waiting"
    request.scheduled_time, request.num_cached_tokens, request.num_computed_tokens = 10.0, 256, 512
    progress = request_progress(request, 12.0)
    assert progress == {"id": "r1", "state": "prefilling", "prefill_tokens": 1000, "prefilled_tokens": 512,
                        "cached_tokens": 256, "prefill_tokens_per_s": 128.0, "output_tokens": 0, "priority": 0}
    assert describe_progress(progress) == "r1 512/1000 tokens (256 cached), 128.0 tokens/s"
    request.num_computed_tokens = 1000
    done = request_progress(request, 13.0)
    assert done["state"] == "decoding" and done["prefill_tokens_per_s"] is None


class CountingQueue(deque):
    """The scheduler's waiting queue, counting the requests read from it."""

    num_read = 0

    def __iter__(self):
        for request in super().__iter__():
            self.num_read += 1
            yield request


class QueueCore:
    """A core's status() over a real scheduler and no model: what take_snapshot reads."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def status(self) -> dict:
        s = self.scheduler
        return {"num_running": s.num_running, "num_waiting": s.num_waiting,
                **requests_status(s.running.values(), s.waiting, time.monotonic())}


def make_queue(num_requests: int) -> Scheduler:
    config = EngineConfig(max_num_seqs=4, max_num_waiting=num_requests)
    scheduler = Scheduler(config, max_model_len=1024)
    for i in range(num_requests):
        scheduler.add_request(Request(f"r{i}", list(range(100, 110)), SamplingParams(max_tokens=4),
                                      eos_token_ids=frozenset({0})))
    scheduler.schedule()  # admits the first four
    scheduler.waiting = CountingQueue(scheduler.waiting)
    return scheduler


def test_a_snapshot_lists_every_running_request_and_only_the_first_waiting_ones():
    scheduler = make_queue(5000)
    snapshot = take_snapshot(QueueCore(scheduler))
    status, ids = snapshot.status, [r["id"] for r in snapshot.status["requests"]]
    assert (status["num_running"], status["num_waiting"]) == (4, 4996)  # the counts stay exact
    assert ids == [f"r{i}" for i in range(4 + MAX_NUM_LISTED_WAITING)]
    assert [r["prefilled_tokens"] for r in status["requests"]] == [10] * 4 + [0] * MAX_NUM_LISTED_WAITING
    assert status["num_waiting_unlisted"] == 4996 - MAX_NUM_LISTED_WAITING
    assert scheduler.waiting.num_read == MAX_NUM_LISTED_WAITING  # not the whole queue
    assert all(f"r{i}" in snapshot.requests for i in range(4)) and "r4999" not in snapshot.requests


def test_a_short_queue_is_listed_whole():
    status = take_snapshot(QueueCore(make_queue(10))).status
    assert [r["id"] for r in status["requests"]] == [f"r{i}" for i in range(10)]
    assert status["num_waiting_unlisted"] == 0
