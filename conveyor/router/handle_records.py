"""The records that cross the DeploymentHandle between the ingress and an engine replica (router/replica.py).

Ingress -> replica: one small dict per request (`make_request`); the replica turns it into its engine's inputs
(`engine_inputs`). Replica -> ingress: one small dict per engine delta (`output_record`). Errors that belong to the
client (bad input, full queue) come back as a single typed record `{"error": kind, ...}` rather than an exception,
so that nothing depends on how Ray pickles exception types and the ingress can map them straight onto HTTP statuses.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from conveyor.serving.engine_client import EngineClient
from conveyor.serving.outputs import RequestOutput, SampledToken
from conveyor.serving.request import SamplingParams

ROUTING_PREFIX_CHARS = 2048


def make_request(prompt: str | list[int] | None, params: SamplingParams, request_id: str, *,
                 messages: list[dict[str, str]] | None = None, stream: bool = True,
                 unset: list[str] | None = None) -> dict[str, Any]:
    """The record the ingress sends: the first positional argument of `generate`.

    `routing_prefix` is what the request router (conveyor/router/routing.py) reads for prefix affinity. It only needs
    to be a stable text for a shared prompt prefix: chat messages are rendered with a fixed pseudo-template
    (the ingress does not load the tokenizer), token-id prompts as their decimal ids.
    """
    if messages is not None:
        prefix = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
    elif isinstance(prompt, str):
        prefix = prompt
    else:
        prefix = ",".join(map(str, prompt or []))
    return {"prompt": prompt, "messages": messages, "params": params, "request_id": request_id,
            "routing_prefix": prefix[:ROUTING_PREFIX_CHARS], "stream": stream, "unset": unset or []}


def apply_generation_defaults(params: SamplingParams, defaults: dict[str, Any], unset: Any) -> SamplingParams:
    """Sampling settings the client left out (`unset`) take the model's generation-config values, as vLLM does
    (SmolLM2: temperature 0.2, top_p 0.9); what the client sent always wins."""
    chosen = {k: v for k, v in defaults.items() if k in unset}
    return dataclasses.replace(params, **chosen) if chosen else params


def engine_inputs(request: dict[str, Any], engine: EngineClient,
                  defaults: dict[str, Any]) -> tuple[list[int], SamplingParams]:
    """What the replica hands its engine for a request record: the prompt's token ids (tokenized once, here: the
    length decides an unset max_tokens) and the sampling params with the model's defaults applied."""
    prompt = request["prompt"]
    if request.get("messages") is not None:
        prompt = engine.apply_chat_template(request["messages"])
    token_ids = engine.tokenize(prompt)
    params = apply_generation_defaults(request["params"], defaults, request.get("unset", ()))
    # OpenAI clients often omit max_tokens ("up to the context"). The engine would refuse that when this
    # replica's KV cache is smaller than the context, so cap it at what can ever fit here instead.
    if params.max_tokens is None:
        room = min(engine.max_model_len, engine.max_tokens_ever) - len(token_ids)
        if room >= 1:
            params = dataclasses.replace(params, max_tokens=room)
    return token_ids, params


def output_record(out: RequestOutput, tokenizer: Any) -> dict[str, Any]:
    """One engine delta as the record the ingress formats (router/formatting.py)."""
    record: dict[str, Any] = {"text": out.delta_text, "num_tokens": len(out.delta_token_ids),
                              "prompt_tokens": out.num_prompt_tokens}
    if out.finished:
        record["finish_reason"] = out.finish_reason
        record["cached_tokens"] = out.num_cached_tokens
    if out.delta_logprobs is not None:
        record["logprobs"] = [_logprob_entry(s, tokenizer) for s in out.delta_logprobs]
    return record


def _logprob_entry(sampled: SampledToken, tokenizer: Any) -> dict[str, Any]:
    top = sampled.top_logprobs or {}
    return {"token": tokenizer.decode([sampled.token_id]), "logprob": sampled.logprob,
            "top": [(tokenizer.decode([tid]), lp) for tid, lp in top.items()]}
