"""The engine against transformers, token for token, with chunking and preemption forced."""
from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from conveyor.serving import LLM, AsyncEngine, EngineConfig, SamplingParams
from conveyor.serving.admission import QueueFullError
from conveyor.serving.config import CacheConfig, ModelConfig, SchedulerConfig
from conveyor.serving.engine import LLMEngine

PROMPTS = [
    "The quick brown fox",
    "What is the capital of France? Paris is the capital. " * 4,
    "héllo wörld 🙂",
    "Continuous batching admits new requests at every token step; paged attention keeps KV in blocks. " * 3,
    "numbers 0123456789",
    "a",
]


def hf_greedy(model_dir, prompt_ids: list[int], num_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(num_tokens):
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=256, block_size=4)
    prompt_ids = [llm.engine.tokenize(p) for p in PROMPTS]
    lengths = [12 + 5 * i for i in range(len(PROMPTS))]
    return prompt_ids, lengths, [hf_greedy(tiny_model_dir, ids, n) for ids, n in zip(prompt_ids, lengths, strict=True)]


@pytest.mark.parametrize("engine_kwargs", [
    dict(num_kv_blocks=256, block_size=4, max_num_batched_tokens=512),
    # A small token budget chunks every long prompt, mixed with the others' decodes.
    dict(num_kv_blocks=256, block_size=4, max_num_batched_tokens=16),
    # A cache too small for everyone at once forces preemption and recompute.
    dict(num_kv_blocks=40, block_size=4, max_num_batched_tokens=24),
    dict(num_kv_blocks=256, block_size=16, max_num_batched_tokens=64, scheduling="static", max_num_seqs=3),
], ids=["plain", "chunked", "preempting", "static"])
def test_greedy_matches_transformers(tiny_model_dir, expected, engine_kwargs):
    prompt_ids, lengths, reference = expected
    llm = LLM(str(tiny_model_dir), **engine_kwargs)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    results = llm.generate(prompt_ids, params)
    assert [r.token_ids for r in results] == reference
    assert all(r.finish_reason == "length" for r in results)
    if engine_kwargs["num_kv_blocks"] == 40:
        assert llm.engine.scheduler.num_preemptions_total > 0
    assert llm.engine.kv_cache.num_free_blocks == engine_kwargs["num_kv_blocks"]


def test_seeded_sampling_is_reproducible_and_independent_of_batch(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=128, block_size=8)
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate("The quick brown fox", seeded)[0].token_ids
    noise = [SamplingParams(max_tokens=15, temperature=1.0, ignore_eos=True)] * 3
    batch = llm.generate(["numbers", "The quick brown fox", "héllo", "a b c"], [noise[0], seeded, *noise[1:]])
    assert batch[1].token_ids == alone
    other_seed = llm.generate("The quick brown fox", SamplingParams(max_tokens=20, seed=99, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_text_stop_strings_and_finish_reasons(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=128)
    full = llm.generate("The quick", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    assert full.text == llm.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    stop = full.text[len(full.text) // 2:][:3]
    if not stop.strip():
        pytest.skip("greedy text of the random model has no usable stop string")
    cut = llm.generate("The quick", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop]))
    assert cut[0].finish_reason == "stop"
    assert cut[0].text == full.text[:full.text.index(stop)]


def test_bad_input_is_refused_and_nothing_else_is_disturbed(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=16, block_size=4, max_model_len=128)
    with pytest.raises(ValueError, match="context"):
        llm.generate([1] * 200)
    with pytest.raises(ValueError, match="KV cache"):
        llm.generate([1] * 10, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="empty"):
        llm.generate("")
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([10**9])
    ok = llm.generate("The quick", SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(ok[0].token_ids) == 5
    assert llm.engine.kv_cache.num_free_blocks == 16


def test_chat_template_is_applied(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64)
    result = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert llm.tokenizer.decode(result.prompt_token_ids).endswith("<|im_start|>assistant\n")


def _async_engine(model_dir, **sched) -> AsyncEngine:
    config = EngineConfig(model=ModelConfig(model=str(model_dir)), cache=CacheConfig(num_blocks=64, block_size=4),
                          scheduler=SchedulerConfig(**sched))
    return AsyncEngine(LLMEngine(config))


def test_async_engine_streams_and_aborts_when_the_consumer_leaves(tiny_model_dir):
    engine = _async_engine(tiny_model_dir)

    async def main():
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        streamed = [o async for o in engine.generate("The quick brown fox", params)]
        assert len(streamed) == 12 and streamed[-1].finished
        assert "".join(o.delta_text for o in streamed) == streamed[-1].text
        gen = engine.generate("The quick brown fox", SamplingParams(max_tokens=200, ignore_eos=True))
        async for _ in gen:
            break
        await gen.aclose()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not engine.engine.kv_cache.block_tables and not engine.engine.has_unfinished():
                break
        assert not engine.engine.kv_cache.block_tables
        assert engine.engine.kv_cache.num_free_blocks == 64

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_async_engine_refuses_past_the_queue_bound(tiny_model_dir):
    engine = _async_engine(tiny_model_dir, max_waiting_requests=1, max_num_seqs=1)

    async def main():
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        gens = [engine.generate("The quick", params) for _ in range(6)]
        results = await asyncio.gather(*(g.__anext__() for g in gens), return_exceptions=True)
        assert any(isinstance(r, QueueFullError) for r in results)
        assert any(not isinstance(r, BaseException) for r in results)
        for g in gens:
            await g.aclose()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_logprobs_are_returned_per_generated_token(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64)
    result = llm.generate("The quick", SamplingParams(max_tokens=4, temperature=0.0, logprobs=3,
                                                      ignore_eos=True))[0]
    assert result.logprobs is not None and len(result.logprobs) == 4
    for token_id, entry in zip(result.token_ids, result.logprobs, strict=True):
        assert entry.token_id == token_id and entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        # Greedy: the sampled token is the most likely one.
        assert max(entry.top_logprobs.values()) == pytest.approx(entry.logprob)


def test_an_argmax_only_batch_samples_the_tokens_of_the_general_path(tiny_model_dir):
    """Greedy rows without logprobs take one argmax for the whole step; a logprobs row sends the step through the
    sampler. Both give every row the same tokens."""
    prompts = ["The quick", "Hello there, my", "A"]
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with_logprobs = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64)
    fast = [r.token_ids for r in llm.generate(prompts, plain)]
    general = [r.token_ids for r in llm.generate(prompts, [plain, with_logprobs, plain])]
    assert fast == general and all(len(ids) == 6 for ids in fast)
    assert llm.engine.make_request("x", plain).argmax_only
    assert not llm.engine.make_request("x", with_logprobs).argmax_only


def test_bfloat16_engine_on_cpu(tiny_model_dir):
    """dtype bfloat16 on CPU runs through chunked prefill and decodes: KV cache in bf16, linears packed for oneDNN
    where the CPU multiplies bf16 natively, every request to its length, every block back. (Its logits against
    transformers: tests/serving/test_model.py.)"""
    from conveyor.serving.models.cpu_packing import PackedLinear, packable_dtypes

    llm = LLM(str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=256, block_size=4, max_num_batched_tokens=16)
    engine = llm.engine
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    packed = any(isinstance(m, PackedLinear) for m in engine.model.modules())
    assert packed == (torch.bfloat16 in packable_dtypes())
    results = llm.generate(PROMPTS, SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    assert [len(r.token_ids) for r in results] == [9] * len(PROMPTS)
    assert engine.kv_cache.num_free_blocks == 256


def test_kv_cache_dtype_config_is_validated():
    assert CacheConfig().kv_cache_dtype == "auto"
    for ok in ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"):
        assert CacheConfig(kv_cache_dtype=ok).kv_cache_dtype == ok
    for bad in ("bf16", "fp8_e4m3fn", "int8", "torch.bfloat16", ""):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, float16, fp8"):
            CacheConfig(kv_cache_dtype=bad)


def test_kv_cache_dtype_resolution_and_backends():
    from conveyor.serving.memory import resolve_kv_cache_dtype

    f32, bf16 = torch.float32, torch.bfloat16
    assert resolve_kv_cache_dtype("auto", f32, "cpu") is f32
    assert resolve_kv_cache_dtype("auto", bf16, "flash") is bf16  # auto never differs from the model
    assert resolve_kv_cache_dtype("bfloat16", bf16, "cuda") is bf16  # named, but the model's own: fine
    assert resolve_kv_cache_dtype("float16", f32, "torch") is torch.float16
    for backend in ("cpu", "torch", "triton"):
        assert resolve_kv_cache_dtype("bfloat16", f32, backend) is bf16
        assert resolve_kv_cache_dtype("float32", bf16, backend) is f32
    for backend in ("cuda", "flash"):
        with pytest.raises(ValueError, match="kv_cache_dtype bfloat16 with a float32 model needs the cpu, torch or "
                                             f"triton attention backend, not '{backend}'"):
            resolve_kv_cache_dtype("bfloat16", f32, backend)
        with pytest.raises(ValueError, match="kv_cache_dtype float32 with a bfloat16 model"):
            resolve_kv_cache_dtype("float32", bf16, backend)
    for model_dtype in (f32, bf16):
        for backend in ("cpu", "torch"):
            assert resolve_kv_cache_dtype("fp8", model_dtype, backend) is torch.float8_e4m3fn  # vLLM's alias
            assert resolve_kv_cache_dtype("fp8_e4m3", model_dtype, backend) is torch.float8_e4m3fn
            assert resolve_kv_cache_dtype("fp8_e5m2", model_dtype, backend) is torch.float8_e5m2
        for backend in ("triton", "cuda", "flash"):
            with pytest.raises(ValueError, match=f"kv_cache_dtype fp8_e5m2 needs the cpu or torch attention "
                                                 f"backend, not '{backend}'"):
                resolve_kv_cache_dtype("fp8_e5m2", model_dtype, backend)


def test_bfloat16_kv_cache_doubles_the_blocks_of_the_same_budget(tiny_model_dir):
    """Engine construction only (no step runs): the budget buys blocks at the cache's dtype, and the runner's (and
    the profile step's) cache tensors are in it, while the weights stay float32."""
    from conveyor.serving.memory import block_bytes

    budget = 64 * block_bytes(2, 16, 2, 16, torch.float32)  # the tiny model: 2 layers, 2 KV heads of 16

    def engine(kv_cache_dtype: str) -> LLMEngine:
        return LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_model_dir)),
                                      cache=CacheConfig(kv_cache_bytes=budget, kv_cache_dtype=kv_cache_dtype),
                                      attention_backend="torch"))

    auto, fp32, bf16 = engine("auto"), engine("float32"), engine("bfloat16")
    assert auto.dtype == auto.kv_cache_dtype == torch.float32
    assert auto.kv_cache.num_blocks == fp32.kv_cache.num_blocks == 64
    assert bf16.kv_cache.num_blocks == 128
    assert bf16.dtype == torch.float32 and bf16.kv_cache_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    assert all(t.dtype == torch.bfloat16 and t.shape[0] == 128 for kv in bf16.runner.kv_caches for t in kv)
    assert all(t.dtype == torch.float32 and t.shape[0] == 64 for kv in auto.runner.kv_caches for t in kv)

    def cache_bytes(e: LLMEngine) -> int:
        return sum(t.numel() * t.element_size() for kv in e.runner.kv_caches for t in kv)

    assert cache_bytes(bf16) == cache_bytes(auto) == budget
    fp8 = engine("fp8")  # vLLM's alias of fp8_e4m3: a quarter of the bytes per block
    assert fp8.kv_cache.num_blocks == 256 and cache_bytes(fp8) == budget
    assert all(t.dtype == torch.float8_e4m3fn for kv in fp8.runner.kv_caches for t in kv)


KV_PROMPTS = PROMPTS[:4] + ["Paris is the capital", "emoji 🙂🚀 and numbers"]


# kv_cache_dtype: (its torch dtype, its relative rounding error, the share of greedy tokens that must match, how far
# a matching token's logprob may move). The tiny model's random weights make flat distributions with near ties,
# which fp8's rounding flips: measured 92, 81 and 55 of 96 tokens the same, logprobs up to 0.15, 0.76, 0.33 apart.
NARROW_KV = {"bfloat16": (torch.bfloat16, 2 ** -8, 0.75, 0.05), "fp8_e4m3": (torch.float8_e4m3fn, 2 ** -4, 0.65, 1.0),
             "fp8_e5m2": (torch.float8_e5m2, 2 ** -3, 0.4, 1.0)}


@pytest.mark.parametrize("kv_cache_dtype", NARROW_KV)
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_narrow_kv_cache_on_a_float32_model(tiny_model_dir, backend, kv_cache_dtype):
    """A narrow or fp8 cache under fp32 weights: the cache holds the fp32 engine's K/V rounded to its dtype, and
    greedy decoding (which reads every earlier token's K/V from the cache) follows the fp32-cache engine's tokens."""
    from conveyor.kernels import ops

    if ops.resolve_backend("auto", "cpu") != "cpu" and backend == "cpu":
        pytest.skip("the C++ CPU attention extension is unavailable here")
    cache_dtype, rounding, min_same, logprob_tol = NARROW_KV[kv_cache_dtype]
    kwargs = dict(num_kv_blocks=128, block_size=4, max_num_batched_tokens=64, attention_backend=backend)
    ref, narrow = LLM(str(tiny_model_dir), **kwargs), LLM(str(tiny_model_dir), kv_cache_dtype=kv_cache_dtype, **kwargs)
    assert narrow.engine.runner.kv_caches[0][0].dtype == cache_dtype
    assert ref.engine.runner.kv_caches[0][0].dtype == torch.float32
    prompt_ids = [ref.engine.tokenize(p) for p in KV_PROMPTS]

    # Prefill only: both engines write the same slots; the narrow cache is the fp32 one rounded (layer 0 up to
    # rounding, later layers up to what the rounding upstream moved). A cache written garbage, or not at all, fails.
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ref.generate(prompt_ids, one)
    narrow.generate(prompt_ids, one)
    written = sum(len(p) for p in prompt_ids)
    for layer, ((k_ref, v_ref), (k_n, v_n)) in enumerate(zip(ref.engine.runner.kv_caches,
                                                               narrow.engine.runner.kv_caches, strict=True)):
        for got, want in ((k_n, k_ref), (v_n, v_ref)):
            assert (want.flatten(0, 1).flatten(1).abs().sum(-1) > 0).sum() >= written  # every prompt token's slot
            tol = 2.5 * rounding if layer == 0 else 5 * rounding
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    want = ref.generate(prompt_ids, params)
    got = narrow.generate(prompt_ids, params)
    assert all(len(r.token_ids) == 16 for r in got)
    same = sum(a == b for w, g in zip(want, got, strict=True) for a, b in zip(w.token_ids, g.token_ids, strict=True))
    assert same >= min_same * 16 * len(KV_PROMPTS), (same, [r.token_ids for r in want], [r.token_ids for r in got])
    # Where both chose the same tokens so far, the chosen token's logprob agrees closely (the decode read the cache).
    for w, g in zip(want, got, strict=True):
        for i, (a, b) in enumerate(zip(w.token_ids, g.token_ids, strict=True)):
            if a != b:
                break
            assert g.logprobs[i].logprob == pytest.approx(w.logprobs[i].logprob, abs=logprob_tol, rel=logprob_tol)
    assert narrow.engine.kv_cache.num_free_blocks == 128
