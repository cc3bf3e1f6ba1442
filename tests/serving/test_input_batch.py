"""The persistent batch (conveyor/serving/input_batch.py): rows follow the scheduler's tables through every step."""
from __future__ import annotations

import numpy as np
import pytest

from conveyor.serving import LLM, SamplingParams
from conveyor.serving.input_batch import InputBatch
from conveyor.serving.outputs import ScheduledChunk
from conveyor.serving.request import Request


def test_rows_hold_exactly_the_live_tables_after_every_step(tiny_model_dir):
    """Chunked prefill, preemption, prefix hits and finishing: after each step every row belongs to a live request
    (or one that ended this step, released at the next) and holds its block ids; ended requests leave no row."""
    llm = LLM(str(tiny_model_dir), num_kv_blocks=14, block_size=4, max_num_batched_tokens=12, max_num_seqs=4)
    engine = llm.engine
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 10, 11, 12, 14], list(range(20, 31)), [40, 41]]
    for i, prompt in enumerate(prompts * 2):
        engine.add_request(engine.make_request(prompt, SamplingParams(max_tokens=20 + i, ignore_eos=True)))
    batch = engine.runner.input_batch
    num_steps = 0
    while engine.has_unfinished():
        engine.step()
        num_steps += 1
        live = {rid: engine.kv_cache.block_ids(rid) for rid in engine.kv_cache.block_tables}
        pending_release = set(engine.scheduler._finished_ids)
        batch.check_invariants(live, pending_release)
    assert engine.scheduler.num_preemptions_total > 0 and engine.kv_cache.num_prefix_hits > 0
    assert num_steps > 10
    engine.runner.execute(engine.scheduler.schedule())  # an empty step still hands the runner the last ended ids
    assert batch.rows == {}


def _chunk(rid: str, prompt: list[int], start: int, num: int, blocks: list[int]) -> ScheduledChunk:
    return ScheduledChunk(Request(rid, prompt, SamplingParams()), start, num, blocks)


def test_prepare_packs_positions_slots_and_tables():
    batch = InputBatch(max_num_seqs=2, max_blocks_per_seq=4, block_size=4)
    prefill = _chunk("a", list(range(10, 16)), 0, 6, [3, 7])
    decode = _chunk("b", [1, 2, 3, 4, 5], 4, 1, [9, 2])
    arrays = batch.prepare([prefill, decode])
    assert arrays.token_ids.tolist() == [10, 11, 12, 13, 14, 15, 5]
    assert arrays.positions.tolist() == [0, 1, 2, 3, 4, 5, 4]
    assert arrays.slot_mapping.tolist() == [12, 13, 14, 15, 28, 29, 8]
    assert arrays.block_tables.tolist() == [[3, 7], [9, 2]]
    assert arrays.query_start_loc.tolist() == [0, 6, 7]
    assert arrays.logits_indices.tolist() == [5, 6]
    batch.release(["a"])
    grown = _chunk("c", [1] * 9, 8, 1, [4, 5, 6])  # takes a's row; 2 rows were enough
    arrays = batch.prepare([grown, decode])
    assert arrays.block_tables.tolist() == [[4, 5, 6], [9, 2, 0]]
    assert np.array_equal(arrays.slot_mapping, [24, 8])
    third = _chunk("d", [1, 2], 0, 2, [1])  # more live requests than rows: the arrays grow
    assert batch.prepare([grown, decode, third]).block_tables.shape == (3, 3)
    with pytest.raises(ValueError, match="rows hold"):
        batch.prepare([_chunk("e", [1] * 30, 0, 20, list(range(5)))])
