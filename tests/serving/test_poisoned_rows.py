"""Numerics that cannot poison a batch (issue 39, item 1): sampling values float32 cannot carry are refused; a row
whose logits have no finite maximum ends only its own request, finish reason "error"; no sampled id is ever
outside the vocabulary; logprobs are finite."""
from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from conveyor.kernels import cpu_ext
from conveyor.router.protocol import ChatCompletionRequest
from conveyor.serving import sampler as sampler_module
from conveyor.serving.request import SamplingParams
from conveyor.serving.request import StructuredOutputsParams as Spec
from conveyor.serving.sampler import LOGPROB_FLOOR, NO_TOKEN, Sampler, make_generator
from tests.cpu_ext_gate import require_cpu_ext

VOCAB = 300


@pytest.mark.parametrize("bad", [
    dict(repetition_penalty=1e-300), dict(repetition_penalty=1e300), dict(repetition_penalty=math.nan),
    dict(repetition_penalty=0.0), dict(temperature=math.nan), dict(temperature=math.inf),
    dict(temperature=1e300), dict(presence_penalty=math.nan), dict(frequency_penalty=math.inf),
    dict(top_p=math.nan), dict(min_p=math.nan), dict(logit_bias={5: math.nan}), dict(logit_bias={5: 1e300}),
    dict(seed=1 << 64), dict(stop_token_ids=(-1,)),
])
def test_sampling_params_refuse_what_float32_cannot_carry(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.mark.parametrize("field, value", [("repetition_penalty", 1e-300), ("repetition_penalty", 1e300),
                                          ("temperature", 1e300), ("logit_bias", {"5": 1e300})])
def test_the_api_refuses_them_with_a_validation_error(field: str, value: object) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(body)


def test_documented_edges_are_accepted() -> None:
    low = SamplingParams(repetition_penalty=0.01, temperature=100.0, seed=(1 << 64) - 1)
    high = SamplingParams(repetition_penalty=100.0, seed=-(1 << 63))
    assert (low.repetition_penalty, low.temperature, low.seed) == (0.01, 100.0, (1 << 64) - 1)
    assert (high.repetition_penalty, high.seed) == (100.0, -(1 << 63))


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch) -> str:
    if request.param == "kernel":
        require_cpu_ext("sample_rows")
    else:
        monkeypatch.setattr(sampler_module, "_cpu_kernel", lambda: False)
    return request.param


def _batch() -> tuple[torch.Tensor, list[SamplingParams], list[int]]:
    """Eight rows: good ones of every kind next to NaN, all -inf and +inf rows, greedy and sampled."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, VOCAB, generator=gen) * 3
    bad = [1, 3, 4, 6]
    logits[1, 17] = math.nan
    logits[3] = -math.inf
    logits[4, VOCAB - 1] = math.nan  # the vector tail
    logits[6, 2] = math.inf
    logits[7, :VOCAB - 5] = -math.inf  # a grammar-like mask that leaves 5 tokens: a good row
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, top_k=5, seed=2),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.5, seed=3),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=4),
              SamplingParams(temperature=1.0, min_p=0.1, seed=5), SamplingParams(temperature=1.0, seed=6)]
    return logits, params, bad


def _generators(params: list[SamplingParams]) -> list[torch.Generator | None]:
    return [None if p.seed is None else make_generator(p.seed) for p in params]


def test_bad_rows_get_no_token_and_leave_the_others_alone(path: str) -> None:
    logits, params, bad = _batch()
    tokens, _ = Sampler(seed=0).sample(logits.clone(), params, _generators(params))
    assert [i for i, t in enumerate(tokens) if t == NO_TOKEN] == bad
    assert all(0 <= t < VOCAB for i, t in enumerate(tokens) if i not in bad)
    assert tokens[7] >= VOCAB - 5  # never a masked token
    good = [i for i in range(len(params)) if i not in bad]
    alone, _ = Sampler(seed=0).sample(logits[good].clone(), [params[i] for i in good],
                                      _generators([params[i] for i in good]))
    assert [tokens[i] for i in good] == alone


def test_all_greedy_steps_mark_bad_rows_too(path: str) -> None:
    logits, _, bad = _batch()
    params = [SamplingParams(temperature=0.0)] * logits.shape[0]
    tokens, _ = Sampler().sample(logits, params, [None] * len(params))
    assert [i for i, t in enumerate(tokens) if t == NO_TOKEN] == bad
    good = [i for i in range(len(params)) if i not in bad]
    assert [tokens[i] for i in good] == logits[good].argmax(-1).tolist()


def test_logprobs_are_finite_under_a_mask_and_on_bad_rows(path: str) -> None:
    logits, _, _ = _batch()
    params = [SamplingParams(temperature=1.0, logprobs=20, seed=i) for i in range(logits.shape[0])]
    _, with_logprobs = Sampler().sample(logits, params, _generators(params))
    for row, sampled in with_logprobs.items():
        values = [sampled.logprob, *sampled.top_logprobs.values()]
        assert all(math.isfinite(v) and v >= LOGPROB_FLOOR for v in values), (row, values)
    assert list(with_logprobs[7].top_logprobs.values()).count(LOGPROB_FLOOR) == 15  # 20 asked, 5 unmasked


def test_the_kernel_never_reads_past_an_empty_row() -> None:
    require_cpu_ext("sample_rows")
    logits = torch.full((4, 4099), -math.inf)
    logits[1, 5] = math.nan
    logits[2, 4098] = math.inf
    logits[3, 9] = 1.0
    for top_k, top_p in [(4099, 1.0), (3, 1.0), (4099, 0.5), (4099, 0.0), (5000 - 1, 0.9)]:
        tokens = cpu_ext.sample_rows(logits, torch.ones(4), torch.full((4,), top_k), torch.full((4,), top_p),
                                     torch.zeros(4), torch.rand(4))
        assert tokens.tolist() == [NO_TOKEN, NO_TOKEN, NO_TOKEN, 9]
    assert torch.ops.conveyor_cpu.argmax_rows(logits).tolist() == [NO_TOKEN, NO_TOKEN, NO_TOKEN, 9]


# ---- the engine: the request ends with "error", its neighbours go on ------------------------------------------
@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(tiny_model_dir, request):
    from conveyor.serving.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from conveyor.serving.engine import LLMEngine

    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(tiny_model_dir), seed=0), cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, async_scheduling=request.param)))


def _masked_out(engine) -> SamplingParams:
    """A grammar that allows only "a" or "b" first, and min_tokens masking both as stop tokens: every logit is
    -inf at the first step (a case the issue names)."""
    ids = [engine.tokenizer.convert_tokens_to_ids(t) for t in ("a", "b")]
    return SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=tuple(ids), structured=Spec("regex", "[ab]c*"))


def test_a_masked_out_request_ends_with_error_and_its_neighbours_are_unchanged(engine) -> None:
    from tests.serving.test_structured_outputs import run

    neighbour = SamplingParams(max_tokens=12, temperature=1.0, seed=7, logprobs=2)
    alone = run(engine, [neighbour])
    together = run(engine, [neighbour, _masked_out(engine), neighbour])
    assert together[1][1:] == ("error", [])
    assert together[0] == together[2] == alone[0]
    assert alone[0][1] == "length"
    assert not engine.scheduler.requests


def test_a_request_masked_out_mid_stream_keeps_its_tokens_and_ends_with_error(engine) -> None:
    from tests.serving.test_structured_outputs import run

    vocab = engine.tokenizer.get_vocab()
    stops = tuple(vocab[t] for t in ("a", "b", "xa", "xb") if t in vocab)  # all but "x" masked at first
    params = SamplingParams(max_tokens=4, min_tokens=3, stop_token_ids=stops, structured=Spec("regex", "x[ab]"))
    text, reason, token_ids = run(engine, [params])[0]
    assert (text, reason, token_ids) == ("x", "error", [vocab["x"]])
    assert not engine.scheduler.requests
