"""Blocks behind a sliding window go back to the pool (kv_cache_manager.py): scheduler-level, fake runner, no torch.
Free-block counts per step, many long requests in a cache too small for their whole contexts, prefix caching over
freed blocks, preemption and async scheduling."""
from __future__ import annotations

import pytest

from conveyor.serving.kv_cache_manager import FREED, KVCacheManager, cdiv
from tests.fake_runner import FakeRunner, make_request, make_scheduler, run_to_completion, step

WINDOW, BLOCK = 8, 4


def test_blocks_behind_the_window_are_freed_each_step() -> None:
    """After every step a request holds exactly the blocks from the one holding its first visible position at
    the step's start on: cdiv(tokens computed, 4) - (start - 8) // 4."""
    scheduler = make_scheduler(num_blocks=64, block_size=BLOCK, sliding_window=WINDOW, max_num_batched_tokens=16)
    request = make_request("r", 40, 30)
    scheduler.add_request(request)
    runner = FakeRunner()
    held_counts = []
    while scheduler.has_unfinished():
        start = request.num_computed_tokens
        step(scheduler, runner)
        if not scheduler.has_unfinished():
            break
        held = cdiv(request.num_computed_tokens, BLOCK) - max(0, (start - WINDOW) // BLOCK)
        assert scheduler.kv_cache.num_free_blocks == 64 - held
        table = scheduler.kv_cache.block_tables["r"]
        assert all(b is FREED for b in table[:len(table) - held]) and FREED not in table[len(table) - held:]
        held_counts.append(held)
    assert max(held_counts) <= cdiv(WINDOW + 16, BLOCK) + 1  # the window plus one chunk, never the context
    assert held_counts[-1] == 3  # decoding at 69 tokens: blocks 15..17 (positions 60..71)
    assert scheduler.kv_cache.num_window_freed_blocks == 15
    assert scheduler.kv_cache.num_free_blocks == 64


def test_without_a_window_nothing_is_freed_early() -> None:
    scheduler = make_scheduler(num_blocks=64, block_size=BLOCK, max_num_batched_tokens=16)
    request = make_request("r", 40, 30)
    scheduler.add_request(request)
    runner = FakeRunner()
    while request.num_output_tokens < 29:
        step(scheduler, runner)
    assert scheduler.kv_cache.num_free_blocks == 64 - cdiv(request.num_computed_tokens, BLOCK)


def _outputs(sliding_window: int | None, num_blocks: int, **config) -> tuple[dict[str, list[int]], int]:
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=BLOCK, sliding_window=sliding_window,
                               max_num_batched_tokens=16, max_num_seqs=6, **config)
    requests = [make_request(f"r{i}", 30 + 7 * i, 40, first_token=i) for i in range(6)]
    for request in requests:
        scheduler.add_request(request)
    run_to_completion(scheduler, FakeRunner())
    assert scheduler.kv_cache.num_free_blocks == num_blocks
    return {r.request_id: r.output_token_ids for r in requests}, scheduler.num_preemptions_total


def test_long_requests_share_a_small_cache() -> None:
    """Six requests of 70-105 tokens in 28 blocks (112 tokens): without the window they preempt each other; with
    it each holds a few blocks and none is preempted. The same tokens either way."""
    full, full_preemptions = _outputs(None, 28)
    windowed, windowed_preemptions = _outputs(WINDOW, 28)
    assert windowed == full and full_preemptions > 0 and windowed_preemptions == 0


def test_preemption_with_freed_blocks() -> None:
    """A cache too small even for the windows: preempted requests recompute (their freed blocks are gone from
    their tables) and end with the same tokens."""
    reference, _ = _outputs(None, 200)
    tight, preemptions = _outputs(WINDOW, 9)
    assert tight == reference and preemptions > 0


@pytest.mark.parametrize("ahead", [False, True])
def test_async_scheduling_with_a_window(ahead: bool) -> None:
    """Step N+1 scheduled (and blocks freed) before step N's update: the same tokens as the synchronous run."""
    reference, _ = _outputs(None, 200)
    scheduler = make_scheduler(num_blocks=14, block_size=BLOCK, sliding_window=WINDOW, max_num_batched_tokens=16,
                               max_num_seqs=6, async_scheduling=ahead)
    requests = [make_request(f"r{i}", 30 + 7 * i, 40, first_token=i) for i in range(6)]
    for request in requests:
        scheduler.add_request(request)
    runner, in_flight = FakeRunner(), []
    while scheduler.has_unfinished() or in_flight:
        if scheduler.has_unfinished():
            sched = scheduler.schedule()
            in_flight.append((sched, runner.execute(sched)))
        if len(in_flight) == 2 or not ahead or not scheduler.has_unfinished():
            scheduler.update(*in_flight.pop(0))
            live = {r.request_id for r in scheduler.running} | {r.request_id for r in scheduler.waiting}
            scheduler.kv_cache.check_invariants(live)
    assert {r.request_id: r.output_token_ids for r in requests} == reference
    assert scheduler.kv_cache.num_free_blocks == 14


def test_prefix_hits_need_every_block_still_cached() -> None:
    """A finished request's blocks, freed behind the window or at its end, keep their hashes until the pool hands
    them out again: the same prompt later hits the whole prefix; once one block of it is handed out, only the
    blocks before that one."""
    kv = KVCacheManager(32, BLOCK, sliding_window=WINDOW)
    scheduler = make_scheduler(num_blocks=32, block_size=BLOCK, sliding_window=WINDOW, max_num_batched_tokens=8)
    scheduler.kv_cache = kv
    first = make_request("a", 41, 1)
    scheduler.add_request(first)
    run_to_completion(scheduler, FakeRunner())
    assert kv.num_window_freed_blocks > 0 and kv.num_free_blocks == 32
    again = make_request("b", 41, 1)
    hits, num_cached = kv.get_computed_blocks(again)
    assert num_cached == 40
    for i, block in enumerate(hits):
        assert block.token_ids == tuple(again.token_slice(i * BLOCK, (i + 1) * BLOCK))
    # Hold the first three (another request shares them), then hand out free blocks until a later block of the
    # chain goes: the prefix ends before it, although blocks after it may still be cached.
    kv.pool.touch(hits[:3])
    taken = []
    while all(block.block_hash is not None for block in hits):
        taken += kv.pool.allocate(1)
    gone = min(i for i, block in enumerate(hits) if block.block_hash is None)
    hits_after, num_cached = kv.get_computed_blocks(make_request("c", 41, 1))
    assert gone >= 3 and num_cached == gone * BLOCK and hits_after == hits[:gone]
    kv.pool.free(taken + hits[:3])
