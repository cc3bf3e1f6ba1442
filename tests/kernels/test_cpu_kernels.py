"""The C++ CPU kernels (conveyor/kernels/csrc/cpu/, backend "cpu") against reference.py."""
from __future__ import annotations

import warnings

import pytest
import torch

from conveyor.kernels import cpu_ext, ops, reference, torch_native
from tests.cpu_ext_gate import require_cpu_ext
from tests.kernels.cases import (
    BAD_BLOCK,
    DECODE_SPECS,
    MIXED_SPECS,
    TOL,
    PagedCase,
    make_case,
    make_kv_write,
    rel_err,
)

KERNELS = require_cpu_ext()  # the first run on a machine builds it (~30 s)

HEADS = [(4, 4), (9, 3), (8, 2)]  # (H, KVH): groups 1, 3, 4


def _decode_lens(batch: int, block_size: int, seed: int) -> list[int]:
    """Contexts of 1, around block boundaries and ~700 first, then random ones up to 300."""
    edges = [1, 700, block_size - 1, block_size, block_size + 1, 2 * block_size, 3 * block_size + 5]
    gen = torch.Generator().manual_seed(seed)
    extra = torch.randint(1, 300, (max(0, batch - len(edges)),), generator=gen).tolist()
    return (edges + extra)[:batch]


def _decode(case: PagedCase, out: torch.Tensor | None = None) -> torch.Tensor:
    return cpu_ext.paged_decode(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                                case.scale, out=out)


def _reference(case: PagedCase) -> torch.Tensor:
    return reference.paged_attention(*case.to(torch.float64).args())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("batch", [1, 7, 17])
def test_decode_matches_reference(batch: int, heads: tuple[int, int], head_dim: int, block_size: int,
                                  dtype: torch.dtype) -> None:
    """Unused cache slots hold NaN and unused table columns point out of bounds: neither may be read."""
    lens = _decode_lens(batch, block_size, seed=batch + head_dim)
    case = make_case([(1, n) for n in lens], *heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
                     seed=block_size)
    out = _decode(case)
    assert out.dtype == dtype and out.shape == case.query.shape
    assert rel_err(out, _reference(case)) < TOL[dtype]


@pytest.mark.parametrize("head_dim", [16, 40, 72, 256])
def test_decode_odd_head_dims(head_dim: int) -> None:
    """Head dims that are not whole AVX-512 vectors (or exceed the unrolled variants) take the generic path."""
    case = make_case([(1, n) for n in (1, 9, 33, 130)], 6, 2, head_dim=head_dim, block_size=8, seed=head_dim)
    assert rel_err(_decode(case), _reference(case)) < TOL[torch.float32]


def test_decode_float16() -> None:
    case = make_case([(1, n) for n in (1, 17, 300)], 9, 3, head_dim=64, block_size=16, dtype=torch.float16)
    assert rel_err(_decode(case), _reference(case)) < TOL[torch.float16]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_split_contexts_merge(threads: int) -> None:
    """Few (sequence, kv head) pairs and long contexts: the kernel splits contexts and merges the partials."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for specs in ([(1, 2000)], [(1, 700), (1, 3), (1, 1300)]):
            case = make_case(specs, 8, 2, head_dim=64, block_size=16, seed=len(specs))
            assert rel_err(_decode(case), _reference(case)) < TOL[torch.float32]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("garbage", ["nan_block", "negative", "huge"])
def test_unused_table_entries_never_read(garbage: str) -> None:
    case = make_case([(1, n) for n in (5, 16, 17, 40)], 4, 2, head_dim=32, block_size=8, spare_blocks=2)
    used = {int(case.block_tables[i, b]) for i, n in enumerate(case.seq_lens_list) for b in range(-(-n // 8))}
    nan_block = min(set(range(case.key_cache.shape[0])) - used)  # a spare block: all NaN (poisoned)
    assert torch.isnan(case.key_cache[nan_block]).all()
    value = {"nan_block": nan_block, "negative": -7, "huge": BAD_BLOCK}[garbage]
    for i, n in enumerate(case.seq_lens_list):
        case.block_tables[i, -(-n // 8):] = value
    assert rel_err(_decode(case), _reference(case)) < TOL[torch.float32]


def test_writes_into_given_out_and_handles_empty_contexts() -> None:
    case = make_case([(1, 9), (1, 4)], 4, 2, head_dim=32, block_size=4)
    out = torch.full_like(case.query, float("nan"))
    assert _decode(case, out=out) is out
    assert rel_err(out, _reference(case)) < TOL[torch.float32]
    case.seq_lens[1] = 0  # a padding row: nothing to attend to, zeros out
    _decode(case, out=out)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    empty = cpu_ext.paged_decode(case.query[:0], case.key_cache, case.value_cache, case.block_tables[:0],
                                 case.seq_lens[:0], case.scale)
    assert empty.shape == (0, 4, 32)


@pytest.mark.parametrize("specs", [MIXED_SPECS, DECODE_SPECS, [(1, 40), (6, 6)], [(3, 20), (1, 1), (1, 33)]],
                         ids=["mixed", "decode", "one-decode", "decodes-after-prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_backend_matches_reference(specs: list[tuple[int, int]], dtype: torch.dtype) -> None:
    """Steps mixing prefill chunks (SDPA) and decodes (the kernel), through the one dispatch point."""
    case = make_case(specs, 6, 2, head_dim=32, block_size=4, dtype=dtype, seed=len(specs))
    out = ops.paged_attention(*case.args(), **case.kwargs(), backend="cpu")
    assert out.dtype == dtype and out.shape == case.query.shape
    assert rel_err(out, _reference(case)) < TOL[dtype]


@pytest.mark.parametrize("specs", [MIXED_SPECS, [(16, 700), (1, 300), (1, 1), (5, 5)], [(37, 37)]],
                         ids=["mixed", "chunk-over-long-context", "prefill-only"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_as_decode_rows_match_reference(specs: list[tuple[int, int]], block_size: int,
                                               dtype: torch.dtype) -> None:
    """Every row of a prefill chunk as a decode over its causal prefix (cpu_plan.decode_rows), one kernel call."""
    case = make_case(specs, 9, 3, head_dim=64, block_size=block_size, dtype=dtype, seed=block_size)
    kwargs = case.kwargs()
    plan = ops.cpu_step_plan(case.block_tables, case.query_start_loc, case.seq_lens, max_rows_chunk=10_000)
    assert plan.prefill is None and plan.decode_index is None
    assert plan.decode_lens.tolist() == [n for q_len, seq_len in specs
                                         for n in range(seq_len - q_len + 1, seq_len + 1)]
    out = ops.paged_attention(*case.args(), **kwargs, backend="cpu", plan=plan)
    assert rel_err(out, _reference(case)) < TOL[dtype]


def test_ops_backend_without_host_lists() -> None:
    case = make_case(MIXED_SPECS, 4, 2, head_dim=16, block_size=4)
    out = ops.paged_attention(*case.args(), max_query_len=5, max_seq_len=13, backend="cpu")
    assert rel_err(out, _reference(case)) < TOL[torch.float32]


def test_write_kv_cache_strided_rows() -> None:
    """key/value as the model hands them over: column slices of one fused qkv projection."""
    tokens, kv_heads, head_dim = 5, 2, 8
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * head_dim)
    _, key, value = qkv.split([4 * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    key, value = key.view(tokens, kv_heads, head_dim), value.view(tokens, kv_heads, head_dim)
    kc, vc = torch.zeros(4, 4, kv_heads, head_dim), torch.zeros(4, 4, kv_heads, head_dim)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    slots = torch.tensor([3, -1, 0, 15, 8])
    reference.write_kv_cache(key, value, kc_ref, vc_ref, slots)
    cpu_ext.write_kv_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    cpu_ext.write_kv_cache(key.transpose(0, 1).contiguous().transpose(0, 1), value, kc, vc, slots)  # copied
    assert torch.equal(kc, kc_ref)


def _raw_args(case: PagedCase) -> dict:
    return {"out": torch.empty_like(case.query), "query": case.query, "key_cache": case.key_cache,
            "value_cache": case.value_cache, "block_tables": case.block_tables, "seq_lens": case.seq_lens,
            "scale": case.scale}


@pytest.mark.parametrize(("change", "message"), [
    (lambda a: {"block_tables": a["block_tables"].long()}, "block_tables must be a contiguous int32"),
    (lambda a: {"seq_lens": a["seq_lens"].long()}, "seq_lens must be a contiguous int32"),
    (lambda a: {"query": a["query"].transpose(0, 1).contiguous().transpose(0, 1)}, "must be contiguous"),
    (lambda a: {"out": a["out"][:, :2].contiguous()}, "must match query"),
    (lambda a: {"query": a["query"].double(), "out": a["out"].double()}, "dtype must be float32"),
    (lambda a: {"out": a["out"].bfloat16()}, "must have query's dtype"),
    (lambda a: {"key_cache": a["key_cache"].bfloat16()}, "must share one dtype"),
    (lambda a: {"value_cache": a["value_cache"][:-1]}, "differ in shape"),
    (lambda a: {"key_cache": a["key_cache"][..., :16], "value_cache": a["value_cache"][..., :16]},
     "must be contiguous"),
    (lambda a: {"query": a["query"][:, :3].contiguous(), "out": a["out"][:, :3].contiguous()},
     "must be a multiple of num_kv_heads"),
    (lambda a: {"seq_lens": a["seq_lens"][:1]}, "one per query"),
    (lambda a: {"seq_lens": a["seq_lens"] + 100}, "is outside"),
    (lambda a: {"block_tables": a["block_tables"].fill_(-1)}, "is not a block of the cache"),
])
def test_decode_rejects_bad_inputs(change, message: str) -> None:
    args = _raw_args(make_case(DECODE_SPECS, 4, 2, head_dim=32, block_size=8))
    args.update(change(args))
    with pytest.raises(RuntimeError, match=message):
        KERNELS.paged_decode(**args)


def test_write_kv_cache_rejects_bad_inputs() -> None:
    key, value, kc, vc, slots = make_kv_write(4, 2, 8, 4, num_blocks=2)
    with pytest.raises(RuntimeError, match="past the cache"):
        KERNELS.write_kv_cache(key, value, kc, vc, torch.tensor([0, 1, 2, 8]))
    with pytest.raises(RuntimeError, match="int64"):
        KERNELS.write_kv_cache(key, value, kc, vc, slots.int())
    with pytest.raises(RuntimeError, match="dtype must be float32"):
        KERNELS.write_kv_cache(key.double(), value.double(), kc, vc, slots)
    with pytest.raises(RuntimeError, match="must share one dtype"):
        KERNELS.write_kv_cache(key, value, kc, vc.bfloat16(), slots)


def test_backend_is_listed_and_chosen_by_auto() -> None:
    assert "cpu" in ops.available_backends("cpu")
    assert ops.resolve_backend("auto", "cpu") == "cpu"
    assert ops.resolve_backend("cpu", "cpu") == "cpu"


def test_falls_back_to_torch_when_the_kernel_cannot_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise RuntimeError("conveyor CPU kernels unavailable: test")

    monkeypatch.setattr(cpu_ext, "load", broken)
    ops._warn_once.cache_clear()
    case = make_case(MIXED_SPECS, 4, 2, head_dim=16, block_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ops.paged_attention(*case.args(), **case.kwargs(), backend="cpu")
    assert any("using torch" in str(w.message) for w in caught)
    expected = torch_native.paged_attention(*case.args(), seq_lens_list=case.seq_lens_list,
                                            query_lens_list=case.query_lens_list)
    assert torch.equal(out, expected)
    ops._warn_once.cache_clear()
