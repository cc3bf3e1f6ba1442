"""The TTFT forecast read off the step thread: the engine process's pipe reader refuses with it at once what the
scheduler would refuse after the step in flight, and passes everything else on in order."""
from __future__ import annotations

import socket
import threading
import time
from multiprocessing.connection import Connection

import pytest

from conveyor.serving.admission import QueueFullError
from conveyor.serving.engine_inbox import Inbox
from conveyor.serving.engine_messages import Abort, Add, Reject
from conveyor.serving.request import SamplingParams
from conveyor.serving.ttft_forecast import TtftForecast, cached_prefix_tokens
from tests.fake_runner import FakeRunner, make_request, make_scheduler, step
from tests.serving.test_slo_scheduling import _scheduler_with_known_cost


def test_forecast_is_what_admission_holds_a_prompt_against():
    scheduler, _ = _scheduler_with_known_cost()
    for i in range(3):
        scheduler.add_request(make_request(f"q{i}", 1000, 8, first_token=100 + i))
    forecast = scheduler.ttft_forecast()
    assert forecast is not None and forecast.limit_s == 2.0
    # ~176 prefill tokens a step at 100 ms: 3,000 queued tokens take ~1.7 s, 1,000 more ~0.6 s.
    assert 1.5 < forecast.predict_s(0, 0) < 1.9
    assert forecast.predict_s(0, 1000) > forecast.limit_s > forecast.predict_s(0, 100)
    assert forecast.predict_s(900, 1000) < forecast.predict_s(0, 1000)  # a cached prefix is not recomputed
    assert 0.09 < forecast.step_s() < 0.11


def test_no_refusal_without_a_backlog_and_no_forecast_without_a_target():
    scheduler, _ = _scheduler_with_known_cost()
    forecast = scheduler.ttft_forecast()
    assert forecast is not None and forecast.backlog_tokens == 0  # decodes only: nothing queued ahead
    scheduler.add_request(make_request("alone", 5000, 8, first_token=100))  # too long for the target alone
    assert scheduler.num_refused_ttft == 0
    scheduler, _ = _scheduler_with_known_cost(admission_policy="queue")
    scheduler.add_request(make_request("q", 1000, 8, first_token=100))
    assert scheduler.ttft_forecast() is None


def test_cached_prefix_tokens_reads_what_the_kv_cache_finds():
    scheduler = make_scheduler(num_blocks=64, block_size=4)
    runner = FakeRunner()
    done = make_request("a", 20, 1)
    scheduler.add_request(done)
    step(scheduler, runner)
    kv = scheduler.kv_cache
    again = make_request("b", 22, 1)  # the same first 20 tokens, then two more
    assert cached_prefix_tokens(kv.pool, kv.block_size, again.prompt_token_ids) == 20
    assert "b" not in kv._hashes  # memoizes nothing: callable off the step thread
    assert kv.get_computed_blocks(again)[1] == 20  # what the scheduler then finds
    assert cached_prefix_tokens(kv.pool, kv.block_size, [499, 498, 497, 496, 495]) == 0


def test_a_refused_request_leaves_no_state():
    scheduler, _ = _scheduler_with_known_cost()
    for i in range(3):
        scheduler.add_request(make_request(f"q{i}", 1000, 8, first_token=100 + i))
    try:
        scheduler.add_request(make_request("late", 1000, 8, first_token=200))
    except QueueFullError:
        pass
    assert scheduler.num_refused_ttft == 1
    assert "late" not in scheduler.kv_cache._hashes and "late" not in scheduler.requests


def _forecast(backlog_tokens: int) -> TtftForecast:
    return TtftForecast(coef=(0.010, 0.0005, 0.0, 0.0), num_decodes=4, decode_kv_reads=0, num_seqs=5,
                        prefill_per_step=176, backlog_tokens=backlog_tokens, backlog_kv_reads=0, limit_s=2.0)


def _add(request_id: str, num_tokens: int) -> Add:
    return Add(request_id, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=8))


def test_inbox_refuses_at_once_and_passes_the_rest_in_order():
    ours, theirs = socket.socketpair()
    child, parent = Connection(ours.detach()), Connection(theirs.detach())
    inbox = Inbox(child, lambda token_ids: 0)
    inbox.set_forecast(_forecast(3000))
    inbox.start()
    for message in (_add("fits", 100), _add("late", 2000), Abort("fits"), _add("also-fits", 50)):
        parent.send(message)
    # Nobody drains the inbox (the step thread is busy): the refusal still arrives.
    assert parent.poll(5.0)
    reject = parent.recv()
    assert isinstance(reject, Reject) and reject.request_id == "late" and reject.kind == "ttft_slo"
    assert reject.retry_after_s >= 1.0
    deadline = time.monotonic() + 5.0
    passed = []
    while len(passed) < 3 and time.monotonic() < deadline:
        message = inbox.get(0.1)
        if message is not None:
            passed.append(message)
    assert [(type(m).__name__, m.request_id) for m in passed] == [("Add", "fits"), ("Abort", "fits"),
                                                                  ("Add", "also-fits")]
    assert inbox.num_refused_early == 1
    parent.close()
    closed = threading.Event()

    def read_to_eof() -> None:
        try:
            while True:
                inbox.get(0.1)
        except EOFError:
            closed.set()

    threading.Thread(target=read_to_eof, daemon=True).start()
    assert closed.wait(5.0)


def test_the_inbox_decision_is_final_and_counts_what_it_admitted():
    scheduler, _ = _scheduler_with_known_cost()
    for i in range(3):
        scheduler.add_request(make_request(f"q{i}", 1000, 8, first_token=100 + i))
    late = make_request("late", 1000, 8, first_token=200)
    scheduler.add_request(late, check_ttft=False)  # the inbox admitted it: not held against the target again
    assert scheduler.num_refused_ttft == 0 and "late" in scheduler.requests

    ours, theirs = socket.socketpair()
    child, parent = Connection(ours.detach()), Connection(theirs.detach())
    inbox = Inbox(child, lambda token_ids: 0)
    inbox.set_forecast(_forecast(1000))
    inbox.start()
    # Each fits behind the forecast's backlog alone; the third does not behind the two admitted before it.
    for name in ("a", "b", "c"):
        parent.send(_add(name, 900))
    assert parent.poll(5.0)
    assert parent.recv().request_id == "c"
    first = _get(inbox)
    assert first.request_id == "a" and first.ttft_admitted
    # The step thread took "a" and its next forecast holds it: only "b" still counts on top of it.
    inbox.set_forecast(_forecast(1900))
    assert [(start, end) for _, start, end in inbox._admitted] == [(0, 900)]
    assert _get(inbox).request_id == "b"
    inbox.set_forecast(_forecast(0))
    parent.send(_add("d", 5000))  # nothing queued ahead: a prompt alone is not refused
    message = _get(inbox)
    assert message.request_id == "d" and message.ttft_admitted and inbox.num_refused_early == 1
    parent.close()


def _get(inbox: Inbox) -> Add:
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if (message := inbox.get(0.1)) is not None:
            return message
    raise AssertionError("nothing passed the inbox")


def test_inbox_without_a_forecast_refuses_nothing():
    ours, theirs = socket.socketpair()
    child, parent = Connection(ours.detach()), Connection(theirs.detach())
    inbox = Inbox(child, lambda token_ids: 0)
    inbox.start()
    parent.send(_add("huge", 4000))
    message = _get(inbox)
    assert isinstance(message, Add) and not message.ttft_admitted and not parent.poll(0.1)
    parent.close()


def test_inbox_closes_when_a_refusal_cannot_be_sent():
    ours, theirs = socket.socketpair()
    child, parent = Connection(ours.detach()), Connection(theirs.detach())
    inbox = Inbox(child, lambda token_ids: 0)
    inbox.set_forecast(_forecast(3000))

    def parent_gone(message: object) -> None:
        raise BrokenPipeError("the parent closed its end")

    inbox.send = parent_gone
    inbox.start()
    parent.send(_add("late", 2000))
    # The reader ends with the pipe and says so: the step thread sees EOF instead of waiting on a dead reader.
    deadline = time.monotonic() + 5.0
    with pytest.raises(EOFError):
        while time.monotonic() < deadline:
            inbox.get(0.1)
    parent.close()
