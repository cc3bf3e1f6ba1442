"""The logits edits a request asks for, applied in place before sampling: min_tokens, logit bias, then penalties.

Semantics are vLLM's (vllm/model_executor/layers/utils.py, apply_penalties; OpenAI's for presence and frequency),
in vLLM V1's order:
- min_tokens: EOS (unless ignore_eos) and stop_token_ids get -inf while the output is shorter;
- logit_bias: the bias is added to the token's logit;
- repetition_penalty r, over every token in the prompt or the output so far: a positive logit is divided by r,
  a negative one multiplied by it (r > 1 discourages repeats);
- frequency_penalty f and presence_penalty p, over the output so far: f x (the token's count) + p is subtracted.

They apply to greedy rows too, as in vLLM: a penalty changes which token is the argmax.

Sparse: only the logits of tokens a request has seen are read and written, never a [rows, vocab] count matrix;
a penalized row costs in proportion to its tokens, not the vocabulary (64 rows of 256 prompt and 128 output
tokens over SmolLM2's 49k vocabulary: ~1 ms for all three penalties on 2 cores).
"""
from __future__ import annotations

import itertools

import numpy as np
import torch
from torch import Tensor

from conveyor.serving.request import SamplingParams


def edited_rows(params: list[SamplingParams]) -> list[int]:
    """The rows whose request asks for a penalty, a bias or min_tokens."""
    return [i for i, p in enumerate(params) if p.has_logits_edits]


def edit_logits(logits: Tensor, params: list[SamplingParams], prompt_ids: list[list[int]],
                output_ids: list[list[int]], eos_ids: list[int | None]) -> tuple[Tensor, Tensor | None]:
    """The step's logits with every row's edits, and the unedited logits where an edited row wants logprobs
    (vLLM reports raw ones), else None. Rows that ask for nothing leave `logits` as it is, uncopied."""
    rows = edited_rows(params)
    if not rows:
        return logits, None
    logits = logits.float().contiguous()
    raw = logits.clone() if any(params[i].logprobs is not None for i in rows) else None
    apply_logits_edits(logits, params, prompt_ids, output_ids, eos_ids, rows)
    return logits, raw


def apply_logits_edits(logits: Tensor, params: list[SamplingParams], prompt_ids: list[list[int]],
                       output_ids: list[list[int]], eos_ids: list[int | None] | None = None,
                       rows: list[int] | None = None) -> None:
    """Edit float32 logits [rows, vocab] in place for the rows that ask (`rows`, when the caller knows them);
    prompt_ids[i] and output_ids[i] are row i's tokens, eos_ids[i] its EOS (for min_tokens). Token ids must be
    < vocab (the engine checks prompts and logit_bias at admission; a stop token id past the vocabulary can never
    be sampled, so it needs no mask)."""
    if rows is None:
        rows = edited_rows(params)
    if not rows:
        return
    vocab, device = logits.shape[-1], logits.device
    flat = logits.view(-1)
    masked = [i * vocab + t for i in rows if len(output_ids[i]) < params[i].min_tokens
              for t in _stop_ids(params[i], None if eos_ids is None else eos_ids[i]) if t < vocab]
    if masked:
        flat[torch.tensor(masked, device=device)] = float("-inf")
    bias_rows = [i for i in rows if params[i].logit_bias]
    if bias_rows:
        keys = [i * vocab + t for i in bias_rows for t, _ in params[i].logit_bias]
        values = [b for i in bias_rows for _, b in params[i].logit_bias]
        flat.index_add_(0, torch.tensor(keys, device=device), torch.tensor(values, dtype=logits.dtype, device=device))
    repetition_rows = [i for i in rows if params[i].repetition_penalty != 1.0]
    if repetition_rows:
        # Repeated tokens repeat a key: each copy computes the same new value from the same old one, so
        # writing them all back needs no unique().
        keys = _keys(vocab, repetition_rows, [prompt_ids[i] for i in repetition_rows],
                     [output_ids[i] for i in repetition_rows], device)
        penalty = _per_row(params, "repetition_penalty", device)[keys // vocab]
        seen = flat[keys]
        flat[keys] = torch.where(seen > 0, seen / penalty, seen * penalty)
    frequency_rows = [i for i in rows if params[i].frequency_penalty and output_ids[i]]
    if frequency_rows:  # one subtraction per occurrence: count x penalty
        keys = _keys(vocab, frequency_rows, [output_ids[i] for i in frequency_rows], None, device)
        flat.index_add_(0, keys, -_per_row(params, "frequency_penalty", device)[keys // vocab])
    presence_rows = [i for i in rows if params[i].presence_penalty and output_ids[i]]
    if presence_rows:
        keys = _keys(vocab, presence_rows, [output_ids[i] for i in presence_rows], None, device).unique()
        flat.index_add_(0, keys, -_per_row(params, "presence_penalty", device)[keys // vocab])


def _stop_ids(params: SamplingParams, eos_id: int | None) -> list[int]:
    """The tokens that would end the request: masked until min_tokens (vLLM's MinTokensLogitsProcessor)."""
    ids = list(params.stop_token_ids)
    if eos_id is not None and not params.ignore_eos:
        ids.append(eos_id)
    return ids


def _keys(vocab: int, rows: list[int], first: list[list[int]], second: list[list[int]] | None,
          device: torch.device) -> Tensor:
    """row * vocab + token id for every token of first[j] (and second[j]) of rows[j]: flat indices into
    logits.view(-1). Through numpy: torch.tensor() of Python lists is ~8x slower."""
    lists = first if second is None else [token for pair in zip(first, second, strict=True) for token in pair]
    lengths = np.array([len(ids) for ids in lists], dtype=np.int64)
    ids = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=int(lengths.sum()))
    row_of_list = np.repeat(np.asarray(rows, dtype=np.int64), 1 if second is None else 2)
    ids += np.repeat(row_of_list * vocab, lengths)
    return torch.from_numpy(ids).to(device)


def _per_row(params: list[SamplingParams], name: str, device: torch.device) -> Tensor:
    return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=device)
