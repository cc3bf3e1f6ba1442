"""CUDA graphs for decode steps: the pure logic on CPU, replay against eager on a GPU (marker `gpu`).

On CPU the runner's "static" mode runs the graph path's padded, fixed-size, list-free buffers eagerly (with the
reference attention backend, which reads lengths on the device), so everything but the capture itself is checked
here: size selection, padding rows confined to the scratch block, metadata, and greedy output equal to the eager
path.
"""
from __future__ import annotations

import logging
import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton's CPU interpreter, as tests/kernels sets it: before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conveyor.kernels import ops
from conveyor.serving import LLM, SamplingParams
from conveyor.serving.attention import PagedAttention
from conveyor.serving.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from conveyor.serving.cuda_graphs import (
    DecodeInputs,
    capture_sizes,
    graph_unsafe_reason,
    is_pure_decode,
    padded_size,
)
from conveyor.serving.engine import LLMEngine
from conveyor.serving.memory import cuda_kv_cache_bytes, num_kv_blocks
from conveyor.serving.model_runner import ModelRunner, profile_step
from conveyor.serving.outputs import ScheduledChunk
from conveyor.serving.request import Request
from tests.tiny_model import cast_copy

GiB = 1 << 30


def test_capture_sizes() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1) == [1]
    assert capture_sizes(2048)[-1] == 512  # bigger decode batches run eagerly


def test_padded_size() -> None:
    sizes = capture_sizes(64)
    assert [padded_size(sizes, b) for b in (1, 2, 3, 4, 5, 9, 17, 63, 64)] == [1, 2, 4, 4, 8, 16, 24, 64, 64]
    assert padded_size(sizes, 0) is None
    assert padded_size(sizes, 65) is None


def _request(num_prompt: int, num_output: int, rid: str = "r") -> Request:
    req = Request(rid, list(range(10, 10 + num_prompt)), SamplingParams(max_tokens=64), max_tokens=64)
    req.output_token_ids = list(range(200, 200 + num_output))
    return req


def _decode_chunk(req: Request, block_ids: list[int]) -> ScheduledChunk:
    return ScheduledChunk(req, req.num_tokens - 1, 1, block_ids)


def test_is_pure_decode() -> None:
    req = _request(5, 2)
    assert is_pure_decode([_decode_chunk(req, [0, 1])])
    assert not is_pure_decode([])
    assert not is_pure_decode([_decode_chunk(req, [0, 1]), ScheduledChunk(_request(5, 0), 0, 5, [2, 3])])


def test_decode_inputs_pad_into_scratch_block_only() -> None:
    block_size, num_blocks = 4, 10
    pad_block = num_blocks
    chunks = [_decode_chunk(_request(5, 2, "a"), [3, 7]), _decode_chunk(_request(1, 0, "b"), [5]),
              _decode_chunk(_request(8, 4, "c"), [0, 1, 9])]
    inputs = DecodeInputs(chunks, 8, block_size, pad_block)
    ids, pos, slots = inputs.longs
    # Real rows: the last token, its position, its slot in the request's own blocks.
    assert ids[:3].tolist() == [201, 10, 203]
    assert pos[:3].tolist() == [6, 0, 11]
    assert slots[:3].tolist() == [7 * 4 + 2, 5 * 4 + 0, 9 * 4 + 3]
    assert inputs.seq_lens[:3].tolist() == [7, 1, 12]
    assert inputs.tables[0].tolist() == [3, 7, pad_block] and inputs.tables[2].tolist() == [0, 1, 9]
    # Padding rows: token 0 at position 0, writing and reading only the scratch block, a 1-token context.
    assert (ids[3:] == 0).all() and (pos[3:] == 0).all()
    assert (slots[3:] // block_size == pad_block).all()
    assert (inputs.tables[3:] == pad_block).all()
    assert (inputs.seq_lens[3:] == 1).all()
    real_slots = set(range(num_blocks * block_size))
    assert not real_slots.intersection(slots[3:].tolist())
    with pytest.raises(ValueError):
        DecodeInputs(chunks, 2, block_size, pad_block)


def test_graph_safety_per_backend() -> None:
    cuda = torch.device("cuda")
    assert graph_unsafe_reason(torch.device("cpu"), "triton") is not None
    assert "host-side" in graph_unsafe_reason(cuda, "torch")
    assert graph_unsafe_reason(cuda, "reference") is not None
    for backend in ("triton", "cuda", "flash"):
        assert graph_unsafe_reason(cuda, backend) is None


def test_gpu_memory_utilization_config() -> None:
    assert CacheConfig().gpu_memory_utilization == 0.9
    assert EngineConfig().enable_cuda_graphs is True
    for bad in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            CacheConfig(gpu_memory_utilization=bad)


def test_cuda_kv_budget_rule() -> None:
    # 100 GiB device, 8 GiB used outside torch (context, other processes), torch peak 12 GiB, 0.9 -> 70 GiB.
    budget = cuda_kv_cache_bytes(0.9, total=100 * GiB, free=80 * GiB, torch_reserved=12 * GiB, torch_peak=12 * GiB)
    assert budget == int(90 * GiB) - 12 * GiB - 8 * GiB
    assert cuda_kv_cache_bytes(0.1, 100 * GiB, 50 * GiB, 20 * GiB, 20 * GiB) < 0  # nothing left: caller raises


def test_cpu_sizing_unchanged() -> None:
    cpu = torch.device("cpu")
    assert num_kv_blocks(CacheConfig(num_blocks=7), 1000, cpu) == 7
    assert num_kv_blocks(CacheConfig(kv_cache_bytes=10_500), 1000, cpu) == 10
    # gpu_memory_utilization plays no part on CPU, and no profile step runs there.
    a = num_kv_blocks(CacheConfig(memory_fraction=0.001), 1 << 20, cpu, profile_step=lambda: 1 / 0)
    b = num_kv_blocks(CacheConfig(memory_fraction=0.001, gpu_memory_utilization=0.1), 1 << 20, cpu)
    assert abs(a - b) <= max(2, a // 50)  # MemAvailable moves a little between calls
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        num_kv_blocks(CacheConfig(kv_cache_bytes=10), 1000, cpu)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), num_kv_blocks=64, block_size=4, max_num_seqs=6)


def test_profile_step_runs_on_cpu(tiny_llm) -> None:
    e = tiny_llm.engine
    hf = e.hf_config
    before = [k.clone() for k, _ in e.runner.kv_caches]
    for num_tokens, num_seqs, max_len in ((40, 6, 512), (40, 1, 16), (3, 8, 512)):
        profile_step(e.model, hf.num_hidden_layers, hf.num_key_value_heads, 16, 4, e.device, e.dtype,
                     num_tokens=num_tokens, num_seqs=num_seqs, max_model_len=max_len)
    # it runs on a throwaway cache: the engine's own is left as it was
    assert all(torch.equal(k, b) for (k, _), b in zip(e.runner.kv_caches, before, strict=True))


def test_profile_step_with_a_bfloat16_kv_cache_on_cpu(tiny_llm) -> None:
    e = tiny_llm.engine
    hf = e.hf_config
    before = [k.clone() for k, _ in e.runner.kv_caches]
    profile_step(e.model, hf.num_hidden_layers, hf.num_key_value_heads, 16, 4, e.device, e.dtype,
                 num_tokens=40, num_seqs=6, max_model_len=512, kv_cache_dtype=torch.bfloat16)
    assert all(torch.equal(k, b) for (k, _), b in zip(e.runner.kv_caches, before, strict=True))


def test_capture_is_ignored_on_cpu(tiny_llm, caplog) -> None:
    e = tiny_llm.engine
    assert e.runner.decode_graphs is None and e.runner.kv_caches[0][0].shape[0] == 64
    with caplog.at_level(logging.INFO, logger="conveyor.serving.model_runner"):
        runner = ModelRunner(e.model, 2, 2, 16, 8, 4, e.device, e.dtype, attention_backend="triton",
                             max_model_len=64, cuda_graphs="capture")
    assert runner.decode_graphs is None and runner.kv_caches[0][0].shape[0] == 8
    assert "CUDA graphs off" in caplog.text


def _static_runner(llm: LLM, max_num_seqs: int, backend: str = "reference") -> ModelRunner:
    """Swap the engine's runner for one on the graph path's static buffers (a backend that needs no lists)."""
    e = llm.engine
    for module in e.model.modules():
        if isinstance(module, PagedAttention):
            module.backend = backend
    hf = e.hf_config
    runner = ModelRunner(e.model, hf.num_hidden_layers, hf.num_key_value_heads, 16, e.kv_cache.num_blocks,
                         e.kv_cache.block_size, e.device, e.dtype, attention_backend=backend,
                         max_model_len=e.max_model_len, max_num_seqs=max_num_seqs, cuda_graphs="static")
    e.runner = runner
    return runner


PROMPTS = [[5, 6, 7, 8, 9, 10, 11][: i + 1] * (i + 1) for i in range(5)]


def _static_backends() -> list[str]:
    """reference always; triton where it runs here (its interpreter on CPU): the kernels the GPU graphs launch."""
    return ["reference"] + (["triton"] if "triton" in ops.available_backends("cpu") else [])


PARAMS = [SamplingParams(max_tokens=4 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(5)]


@pytest.fixture(scope="module")
def eager_run(tiny_model_dir):
    eager = LLM(str(tiny_model_dir), num_kv_blocks=64, block_size=4, max_num_seqs=8, enable_prefix_caching=False)
    return [r.token_ids for r in eager.generate(PROMPTS, PARAMS)], eager.engine.runner.kv_caches


@pytest.mark.parametrize("backend", _static_backends())
def test_static_path_matches_eager_and_spares_real_blocks(tiny_model_dir, eager_run, backend: str) -> None:
    """5 requests of different lengths: decode batches 5 -> 1 pad to sizes 8, 4, 2, 1."""
    expected, eager_kv = eager_run
    static = LLM(str(tiny_model_dir), num_kv_blocks=64, block_size=4, max_num_seqs=8, enable_prefix_caching=False)
    runner = _static_runner(static, max_num_seqs=8, backend=backend)
    assert runner.decode_graphs.sizes == [1, 2, 4, 8]
    assert [r.token_ids for r in static.generate(PROMPTS, PARAMS)] == expected
    assert runner.decode_graphs.num_replays > 0
    # Same blocks, same K/V in every real block; padding rows wrote only the scratch block past them.
    for (k_eager, v_eager), (k_static, v_static) in zip(eager_kv, runner.kv_caches, strict=True):
        assert k_static.shape[0] == k_eager.shape[0] + 1
        torch.testing.assert_close(k_static[:64], k_eager, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v_static[:64], v_eager, rtol=1e-4, atol=1e-5)
        assert k_static[64].abs().sum() > 0  # the scratch block did take the padding rows' writes


def test_static_path_skips_mixed_and_oversized_steps(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, block_size=4, max_num_seqs=6)
    runner = _static_runner(llm, max_num_seqs=2)  # captured sizes [1, 2]: decode batches of 3+ run eagerly
    graphs = runner.decode_graphs
    req = _request(5, 1)
    assert graphs.prepare([ScheduledChunk(req, 0, 6, [0, 1])]) is None  # prefill chunk
    assert graphs.prepare([_decode_chunk(_request(5, 1, str(i)), [i]) for i in range(3)]) is None
    assert graphs.prepare([_decode_chunk(req, [3, 4])]) == 1
    assert graphs.slot_mapping[0].item() == 4 * 4 + 1 and graphs.seq_lens[0].item() == 6
    meta = graphs.metadata(2)
    assert meta.max_query_len == 1 and meta.max_seq_len == llm.engine.max_model_len
    assert meta.seq_lens_list is None and meta.query_lens_list is None
    assert meta.query_start_loc.tolist() == [0, 1, 2]


# ---- GPU: replay against eager ---------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module", params=["head_dim16", "head_dim64"])
def gpu_model_dir(request, tiny_model_dir, tmp_path_factory):
    """The tiny Llama (head_dim 16: the CUDA decode kernel has no variant, triton serves it) and one with
    head_dim 64 and a GQA group of 3 (SmolLM2's attention shape, which the CUDA decode kernel serves)."""
    if request.param == "head_dim16":
        return tiny_model_dir
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny_model import build_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama-d64")
    tokenizer = build_tokenizer()
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=192, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)  # clear greedy winners, as tiny_model does
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _graph_backends() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [b for b in ops.available_backends("cuda") if graph_unsafe_reason(torch.device("cuda"), b) is None]


def _engine(model_dir, backend: str, graphs: bool, dtype: str = "float32", max_num_seqs: int = 16) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(model_dir), device="cuda", dtype=dtype),
        cache=CacheConfig(block_size=16, num_blocks=128, enable_prefix_caching=False),
        # No latency targets: a fixed 512-token budget, so one step prefills every test prompt (the TPOT target's
        # cold-start budget is 64 tokens).
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512, tpot_slo_ms=None,
                                  ttft_slo_ms=None),
        attention_backend=backend, enable_cuda_graphs=graphs))


def _generate(engine: LLMEngine, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    reqs = [engine.make_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), f"r{i}")
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    for req in reqs:
        engine.add_request(req)
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", _graph_backends())
@pytest.mark.parametrize("batch", [3, 11])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_matches_eager(gpu_model_dir, backend: str, batch: int, dtype: str) -> None:
    engine = _engine(gpu_model_dir, backend, graphs=True, dtype=dtype)
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.capture and set(graphs.graphs) == {1, 2, 4, 8, 16}
    for i in range(batch):
        engine.add_request(engine.make_request([5 + i] * (3 + 7 * i), SamplingParams(max_tokens=50), f"r{i}"))
    engine.step()  # every prompt prefilled in one eager step
    sched = engine.scheduler.schedule()
    assert is_pure_decode(sched.chunks) and len(sched.chunks) == batch
    runner = engine.runner
    with torch.inference_mode():
        ids, pos, meta, _ = runner._prepare_inputs(sched.chunks)
        eager = runner.model(ids, pos, runner.kv_caches, meta).clone()
        replayed = graphs.run(sched.chunks).clone()
    torch.cuda.synchronize()
    assert replayed.dtype == eager.dtype == getattr(torch, dtype)
    tol = dict(rtol=1e-3, atol=1e-3) if dtype == "float32" else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(replayed, eager, **tol)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", _graph_backends())
def test_engine_greedy_graphs_on_equals_off(gpu_model_dir, backend: str) -> None:
    prompts = [[7 + i] * (2 + 9 * i) for i in range(7)]
    lengths = [5 + 6 * i for i in range(7)]  # requests finish one by one: batches 7..1 pad to 8, 4, 2, 1
    off = _generate(_engine(gpu_model_dir, backend, graphs=False), prompts, lengths)
    engine = _engine(gpu_model_dir, backend, graphs=True)
    on = _generate(engine, prompts, lengths)
    assert engine.runner.decode_graphs.num_replays > 0
    assert on == off


@pytest.mark.gpu
@needs_cuda
def test_bf16_default_path_with_graphs(tiny_model_dir, tmp_path) -> None:
    """A bf16 checkpoint under dtype auto runs bf16 on CUDA (models/checkpoint.py)."""
    bf16_dir = cast_copy(tiny_model_dir, tmp_path / "bf16", torch.bfloat16)
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(bf16_dir), device="cuda"),
                                    cache=CacheConfig(block_size=16, gpu_memory_utilization=0.2)))
    assert engine.dtype == torch.bfloat16 and engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    with torch.inference_mode():
        logits = engine.model.compute_logits(torch.zeros(2, engine.hf_config.hidden_size, dtype=torch.bfloat16,
                                                         device="cuda"))
    assert logits.dtype == torch.float32  # the sampler works on fp32 logits
    expected_graphs = graph_unsafe_reason(engine.device, engine.attention_backend) is None
    assert (engine.runner.decode_graphs is not None) == expected_graphs
    out = _generate(engine, [[5, 6, 7], [8] * 20], [12, 12])
    assert all(len(o) == 12 for o in out)
    # gpu_memory_utilization sized the cache from the device's total memory.
    total = torch.cuda.mem_get_info()[1]
    kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in engine.runner.kv_caches)
    assert 0 < kv_bytes < 0.2 * total
