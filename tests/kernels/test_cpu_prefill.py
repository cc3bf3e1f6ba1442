"""The CPU prefill kernel (csrc/cpu/prefill_attention_cpu.cpp) and backend "cpu"'s split of a step between it and
the decode kernel (conveyor/kernels/cpu_plan.py), against reference.py."""
from __future__ import annotations

import pytest
import torch

from conveyor.kernels import cpu_ext, cpu_plan, ops, reference
from tests.kernels.cases import MIXED_SPECS, TOL, PagedCase, make_case, rel_err

try:
    KERNELS = cpu_ext.load()
except RuntimeError as exc:
    pytest.skip(f"CPU extension cannot be built here: {exc}", allow_module_level=True)

# (q_len, seq_len) per chunk: fresh prompts, chunks continuing a context, a lone row, lengths around the kernel's
# 64-position tiles and its 16-64 query tiles.
PREFILL_SPECS = {
    "prompt-256": [(256, 256)],
    "odd-prompt": [(37, 37)],
    "chunk-over-context": [(16, 700), (5, 5)],
    "mixed-tiles": [(100, 1100), (65, 65), (1, 30), (64, 129)],
}


def _reference(case: PagedCase) -> torch.Tensor:
    return reference.paged_attention(*case.to(torch.float64).args())


def _prefill(case: PagedCase, out: torch.Tensor | None = None) -> torch.Tensor:
    starts = case.query_start_loc[:-1]
    lens = torch.tensor(case.query_lens_list, dtype=torch.int32)
    return cpu_ext.paged_prefill(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                                 starts, lens, case.scale, out=out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("specs", list(PREFILL_SPECS.values()), ids=list(PREFILL_SPECS))
def test_prefill_matches_reference(specs: list[tuple[int, int]], heads: tuple[int, int], head_dim: int,
                                   dtype: torch.dtype) -> None:
    """Cache slots past each context hold NaN and table columns past the last block are out of bounds: the
    kernel must read neither (causal: no row sees a later position)."""
    case = make_case(specs, *heads, head_dim=head_dim, block_size=16, dtype=dtype, seed=head_dim + heads[0])
    out = _prefill(case)
    assert out.dtype == dtype and out.shape == case.query.shape
    assert rel_err(out, _reference(case)) < TOL[dtype]


@pytest.mark.parametrize("block_size", [1, 8, 32, 128])
def test_prefill_block_sizes(block_size: int) -> None:
    case = make_case(PREFILL_SPECS["mixed-tiles"], 9, 3, head_dim=64, block_size=block_size, seed=block_size)
    assert rel_err(_prefill(case), _reference(case)) < TOL[torch.float32]


@pytest.mark.parametrize("head_dim", [12, 16, 40, 72, 256])
def test_prefill_odd_head_dims(head_dim: int) -> None:
    """Head dims that are not whole vectors (12: AVX2 too), or more than one column block of the value sum."""
    case = make_case([(70, 70), (9, 200)], 6, 2, head_dim=head_dim, block_size=8, seed=head_dim)
    assert rel_err(_prefill(case), _reference(case)) < TOL[torch.float32]


def test_prefill_float16() -> None:
    case = make_case([(80, 80)], 9, 3, head_dim=64, block_size=16, dtype=torch.float16)
    assert rel_err(_prefill(case), _reference(case)) < TOL[torch.float16]


@pytest.mark.parametrize("threads", [1, 3])
def test_prefill_thread_counts(threads: int) -> None:
    """Tasks go to threads dynamically: every count of threads gives the same answer."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        case = make_case(PREFILL_SPECS["mixed-tiles"], 8, 2, head_dim=64, block_size=16, seed=threads)
        assert rel_err(_prefill(case), _reference(case)) < TOL[torch.float32]
    finally:
        torch.set_num_threads(before)


def test_prefill_leaves_rows_outside_its_chunks() -> None:
    case = make_case([(1, 9), (20, 20)], 4, 2, head_dim=32, block_size=4)
    out = torch.full_like(case.query, 7.0)
    only_second = cpu_ext.paged_prefill(case.query, case.key_cache, case.value_cache, case.block_tables[1:],
                                        case.seq_lens[1:], torch.tensor([1]), torch.tensor([20]), case.scale,
                                        out=out)
    assert only_second is out and torch.equal(out[0], torch.full_like(out[0], 7.0))
    assert rel_err(out[1:], _reference(case)[1:]) < TOL[torch.float32]


@pytest.mark.parametrize(("change", "message"), [
    ({"query_lens": [300]}, "do not fit the query"),
    ({"seq_lens": [10]}, "do not fit the query"),
    ({"seq_lens": [4000]}, "needs more blocks"),
    ({"block_tables": "bad"}, "is not a block of the cache"),
])
def test_prefill_rejects_bad_inputs(change: dict, message: str) -> None:
    case = make_case([(20, 40)], 4, 2, head_dim=32, block_size=8)
    args = {"block_tables": case.block_tables, "seq_lens": case.seq_lens, "query_starts": torch.tensor([0]),
            "query_lens": torch.tensor([20])}
    for key, value in change.items():
        args[key] = case.block_tables.clone().fill_(-3) if value == "bad" else torch.tensor(value)
    with pytest.raises(RuntimeError, match=message):
        cpu_ext.paged_prefill(case.query, case.key_cache, case.value_cache, args["block_tables"],
                              args["seq_lens"], args["query_starts"], args["query_lens"], case.scale)


STEP_SPECS = {
    "mixed": MIXED_SPECS,
    "decodes-and-long-chunk": [(1, 40), (200, 300), (1, 1), (1, 77)],
    "short-and-long-chunks": [(3, 20), (90, 90), (8, 400), (1, 33), (9, 9)],
    "prefill-only": [(37, 37)],
}


@pytest.mark.parametrize("max_rows_chunk", [1, cpu_plan.MAX_CHUNK_AS_DECODE_ROWS, 10_000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("specs", list(STEP_SPECS.values()), ids=list(STEP_SPECS))
def test_step_plan_matches_reference(specs: list[tuple[int, int]], dtype: torch.dtype, max_rows_chunk: int) -> None:
    """A step through ops with its plan: everything on the prefill kernel but decodes (1), the default split,
    and every row through the decode kernel (10 000)."""
    case = make_case(specs, 9, 3, head_dim=64, block_size=16, dtype=dtype, seed=len(specs))
    kwargs = case.kwargs()
    assert ops.uses_cpu_plan("cpu", kwargs["max_query_len"])
    plan = ops.cpu_step_plan(case.block_tables, case.query_start_loc, case.seq_lens, case.query_lens_list,
                             case.seq_lens_list, max_rows_chunk=max_rows_chunk)
    num_rows = sum(q for q, _ in specs if q <= max(1, max_rows_chunk))
    assert (plan.decode_lens is None and num_rows == 0) or plan.decode_lens.numel() == num_rows
    assert (plan.prefill is None) == all(q <= max(1, max_rows_chunk) for q, _ in specs)
    out = ops.paged_attention(*case.args(), **kwargs, backend="cpu", plan=plan)
    assert rel_err(out, _reference(case)) < TOL[dtype]


def test_step_without_plan_or_host_lists() -> None:
    """paged_attention plans the step itself when the caller gave no plan (and no host lists)."""
    case = make_case(STEP_SPECS["short-and-long-chunks"], 4, 2, head_dim=16, block_size=4)
    out = ops.paged_attention(*case.args(), max_query_len=90, max_seq_len=400, backend="cpu")
    assert rel_err(out, _reference(case)) < TOL[torch.float32]


def test_plan_wanted_only_for_cpu_steps_with_chunks() -> None:
    assert ops.uses_cpu_plan("cpu", 2) and ops.uses_cpu_plan("cpu", 4096)
    assert not ops.uses_cpu_plan("cpu", 1) and not ops.uses_cpu_plan("torch", 16)
