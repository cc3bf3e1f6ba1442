"""Penalties and logit bias: the sparse edits against a dense reference, and the engine against transformers.

The reference is dense and written from the definitions: repetition through transformers' own
RepetitionPenaltyLogitsProcessor (vLLM's formula over prompt and output), frequency and presence as OpenAI
defines them (over the output, by count), logit bias added first, as vLLM V1 orders them.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, RepetitionPenaltyLogitsProcessor

from conveyor.serving import LLM, SamplingParams
from conveyor.serving.logits_processors import apply_logits_edits


def reference_edit(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row [vocab], dense."""
    row = logits.clone()
    for token_id, bias in params.logit_bias:
        row[token_id] += bias
    if params.repetition_penalty != 1.0:
        seen = torch.tensor([prompt + output])
        row = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(seen, row.unsqueeze(0)).squeeze(0)
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=row.shape[0]).float()
    row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return row


ROW_PARAMS = [
    SamplingParams(),  # no edits: the row must come out untouched
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(frequency_penalty=0.7, presence_penalty=0.4),
    SamplingParams(presence_penalty=-1.5),  # negative: encourages repeats
    SamplingParams(logit_bias={3: 100.0, 7: -100.0, 11: 2.5}),
    SamplingParams(repetition_penalty=0.8, frequency_penalty=2.0, presence_penalty=2.0, logit_bias={5: -3.0}),
    SamplingParams(frequency_penalty=1.0, temperature=0.0),  # greedy rows are edited too
]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sparse_edits_match_the_dense_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = 97
    logits = torch.randn(len(ROW_PARAMS), vocab, generator=gen) * 4
    prompts = [torch.randint(0, vocab, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
               for _ in ROW_PARAMS]
    # Outputs with repeats (counts above 1), and one row with no output yet (a prefill's first token).
    outputs = [torch.randint(0, 12, (n,), generator=gen).tolist() for n in (5, 9, 14, 0, 3, 20, 8)]
    expected = torch.stack([reference_edit(logits[i], p, prompts[i], outputs[i]) for i, p in enumerate(ROW_PARAMS)])
    edited = logits.clone()
    apply_logits_edits(edited, ROW_PARAMS, prompts, outputs)
    torch.testing.assert_close(edited, expected)
    assert torch.equal(edited[0], logits[0])


def test_masked_logits_stay_masked():
    """A grammar's -inf survives every edit (repetition multiplies it, the others add finite values)."""
    logits = torch.full((1, 8), float("-inf"))
    logits[0, 2] = 1.0
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=1.0,
                             logit_bias={4: 50.0})]
    apply_logits_edits(logits, params, [[4, 5]], [[4, 4, 2]])
    assert logits[0, 4] == float("-inf") and logits[0, 5] == float("-inf")
    assert logits[0, 2] == pytest.approx(1.0 / 1.5 - 1.0 - 1.0)


@pytest.mark.parametrize("bad", [
    dict(presence_penalty=2.5), dict(frequency_penalty=-3.0), dict(repetition_penalty=0.0),
    dict(repetition_penalty=float("nan")), dict(repetition_penalty=float("inf")),
    dict(logit_bias={1: 101.0}), dict(logit_bias={-1: 1.0}), dict(logit_bias={1: float("nan")}),
])
def test_out_of_range_values_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_logit_bias_is_kept_as_sorted_pairs_and_params_stay_hashable():
    params = SamplingParams(logit_bias={"9": 1, 2: -0.5})
    assert params.logit_bias == ((2, -0.5), (9, 1.0))
    assert hash(params) == hash(SamplingParams(logit_bias={2: -0.5, 9: 1.0}))
    assert not SamplingParams().has_logits_edits and params.has_logits_edits


def reference_greedy(model_dir, prompt: list[int], params: SamplingParams, num_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    output: list[int] = []
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(torch.tensor([prompt + output])).logits[0, -1]
            output.append(int(reference_edit(logits, params, prompt, output).argmax()))
    return output


EDITS = [
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, logit_bias={40: 3.0, 41: -100.0}),
]


@pytest.mark.parametrize("engine_kwargs", [
    dict(num_kv_blocks=256, block_size=4, max_num_batched_tokens=512),
    dict(num_kv_blocks=40, block_size=4, max_num_batched_tokens=16),  # chunked prefills and preemption
], ids=["plain", "chunked-preempting"])
def test_engine_greedy_with_edits_matches_transformers(tiny_model_dir, engine_kwargs):
    llm = LLM(str(tiny_model_dir), **engine_kwargs)
    prompts = [llm.engine.tokenize(t) for t in ("The quick brown fox", "What is the capital of France? " * 3,
                                                "Continuous batching admits new requests")]
    num_tokens = 24
    params = [dataclasses.replace(p, max_tokens=num_tokens, temperature=0.0, ignore_eos=True) for p in EDITS]
    plain = [SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)] * len(prompts)
    results = llm.generate(prompts + prompts, params + plain)  # edited and unedited rows share the steps
    reference = [reference_greedy(tiny_model_dir, ids, p, num_tokens) for ids, p in zip(prompts, params, strict=True)]
    assert [r.token_ids for r in results[:3]] == reference
    assert [r.token_ids for r in results[3:]] == [reference_greedy(tiny_model_dir, ids, plain[0], num_tokens)
                                                  for ids in prompts]
    assert [r.token_ids for r in results[:3]] != [r.token_ids for r in results[3:]]  # the edits did something
    if engine_kwargs["num_kv_blocks"] == 40:
        assert llm.engine.scheduler.num_preemptions_total > 0


def test_logprobs_are_the_raw_models_not_the_edited_ones(tiny_model_dir):
    """As vLLM's default (raw logprobs): a bias that forces a token does not make its logprob 0."""
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64)
    prompt = llm.engine.tokenize("The quick")
    free = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))[0]
    forced_id = min(free.logprobs[0].top_logprobs, key=free.logprobs[0].top_logprobs.get)  # the 5th most likely
    forced = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5,
                                                   logit_bias={forced_id: 100.0}))[0]
    assert forced.token_ids == [forced_id]
    assert forced.logprobs[0].logprob == pytest.approx(free.logprobs[0].top_logprobs[forced_id], abs=1e-5)
    assert forced.logprobs[0].top_logprobs == pytest.approx(free.logprobs[0].top_logprobs, abs=1e-5)


def test_logit_bias_beyond_the_vocabulary_is_refused(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.engine.make_request("hi", SamplingParams(logit_bias={10**6: 1.0}))


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(3, 10)
    params = [SamplingParams(min_tokens=3, stop_token_ids=(4, 99)),  # 99: past the vocabulary, nothing to mask
              SamplingParams(min_tokens=3, ignore_eos=True),  # EOS is no stop token here
              SamplingParams(min_tokens=2)]  # reached: nothing masked
    apply_logits_edits(logits, params, [[1], [1], [1]], [[5, 6], [5], [5, 6]], [2, 2, 2])
    assert torch.isinf(logits[0, [2, 4]]).all() and torch.isfinite(logits[0, [0, 1, 3, 5]]).all()
    assert torch.isfinite(logits[1:]).all()
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_engine_min_tokens_holds_back_a_stop_token(tiny_model_dir):
    """Greedy with the plain run's 3rd token as a stop token: it stops there, unless min_tokens holds the stop
    token back, in which case the output is the greedy run with that token masked for the first min_tokens steps."""
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64)
    prompt = llm.engine.tokenize("What is the capital of France? Paris")
    plain = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    stop_id = plain[2]
    assert stop_id not in plain[:2]  # the prompt is chosen so that the stop token first comes 3rd
    stopped = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                    stop_token_ids=(stop_id,)))[0]
    assert stopped.token_ids == plain[:3] and stopped.finish_reason == "stop"
    held = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, min_tokens=8,
                                                 stop_token_ids=(stop_id,)))[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    expected: list[int] = []
    with torch.no_grad():
        while len(expected) < 12:
            logits = model(torch.tensor([prompt + expected])).logits[0, -1]
            if len(expected) < 8:
                logits[stop_id] = float("-inf")
            expected.append(int(logits.argmax()))
            if len(expected) >= 8 and expected[-1] == stop_id:
                break
    assert held.token_ids == expected and stop_id not in held.token_ids[:8]
