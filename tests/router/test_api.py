"""The OpenAI-compatible API against one tiny-model deployment: the official client, streaming, bad inputs,
and a client that disconnects mid-stream."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from tests.router.conftest import deploy, engine_handle, engine_state, wait_until

pytestmark = pytest.mark.timeout(180)

APP = "conveyor-test-api"
PREFIX = "/api"
MODEL = "tiny"


@pytest.fixture(scope="module")
def base_url(serve_cluster: str, tiny_model_dir) -> Iterator[str]:
    args = {"model": str(tiny_model_dir), "served_model_name": MODEL, "num_kv_blocks": 64, "max_num_seqs": 8,
            "torch_num_threads": 1, "request_router_class": None, "test_hooks": True}
    with deploy(args, APP, PREFIX):
        yield serve_cluster + PREFIX


@pytest.fixture(scope="module")
def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=60, max_retries=0)


def test_completions_plain_and_streamed_agree(client: OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0.0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    assert full.object == "text_completion" and full.model == MODEL
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 0
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_plain_and_streamed_with_usage(client: OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is Paris?"}]
    kwargs = dict(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0.0,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 10
    usage_on = {"include_usage": True}
    chunks = list(client.chat.completions.create(stream=True, stream_options=usage_on, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_models_list_health_and_metrics(client: OpenAI, base_url: str) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(base_url + "/health", timeout=10).status_code == 200
    metrics = httpx.get(base_url + "/metrics", timeout=10)
    assert metrics.status_code == 200 and "python_info" in metrics.text


def test_n_seeds_logprobs_and_token_prompts(client: OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=["Paris is", "The fox"], n=3, max_tokens=5,
                                    temperature=1.0, seed=7, logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == list(range(6))
    assert all(len(c.logprobs.tokens) == 5 and len(c.logprobs.top_logprobs[0]) <= 2 for c in out.choices)
    again = client.completions.create(model=MODEL, prompt=["Paris is", "The fox"], n=3, max_tokens=5,
                                      temperature=1.0, seed=7, logprobs=2, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seed + i: reproducible
    assert len({c.text for c in out.choices[:3]}) > 1  # ...and distinct across the n choices
    ids = client.completions.create(model=MODEL, prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=2)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 6
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 3 and all(len(e.top_logprobs) == 2 for e in entries)


def test_penalties_and_logit_bias_through_the_api(client: OpenAI, tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    forced = tokenizer.encode(" fox")[0]
    out = client.completions.create(model=MODEL, prompt="The quick", max_tokens=4, temperature=0,
                                    logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert out.choices[0].text == tokenizer.decode([forced] * 4)
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=24, temperature=0)
    plain = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text
    penalized = client.completions.create(**kwargs, frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={"ignore_eos": True}).choices[0].text
    repetition = client.completions.create(**kwargs, extra_body={"ignore_eos": True, "repetition_penalty": 1.8})
    assert plain not in (penalized, repetition.choices[0].text)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logit_bias={str(forced): 100},
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == tokenizer.decode([forced] * 3)


def _post(base_url: str, path: str, body: bytes | dict, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(base_url + path, content=content, timeout=30,
                      headers={"content-type": "application/json", **(headers or {})})


OK = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
BAD_INPUTS = {
    "malformed_json": (b'{"prompt": "hi", ', 400, "invalid_json"),
    "not_an_object": (b'["hi"]', 400, "invalid_json"),
    "invalid_utf8": (b'{"prompt": "\xff\xfe"}', 400, "invalid_encoding"),
    "lone_surrogate": (b'{"prompt": "a\\ud800b"}', 400, "invalid_value"),
    "prompt_wrong_type": ({**OK, "prompt": 12}, 400, "invalid_value"),
    "max_tokens_wrong_type": ({**OK, "max_tokens": "many"}, 400, "invalid_value"),
    "max_tokens_negative": ({**OK, "max_tokens": -5}, 400, "invalid_value"),
    "max_tokens_huge": ({**OK, "max_tokens": 10**12}, 400, "invalid_value"),
    "max_tokens_beyond_context": ({**OK, "max_tokens": 5000}, 400, "invalid_prompt"),
    "temperature_negative": ({**OK, "temperature": -0.1}, 400, "invalid_value"),
    "top_p_zero": ({**OK, "top_p": 0.0}, 400, "invalid_value"),
    "top_p_above_one": ({**OK, "top_p": 1.5}, 400, "invalid_value"),
    "unknown_model": ({**OK, "model": "gpt-7"}, 400, "model_not_found"),
    "empty_prompt": ({**OK, "prompt": ""}, 400, "invalid_prompt"),
    "empty_prompt_list": ({**OK, "prompt": []}, 400, "invalid_value"),
    "prompt_beyond_context": ({**OK, "prompt": "hello world " * 400}, 400, "invalid_prompt"),
    "token_id_out_of_vocab": ({**OK, "prompt": [1, 10**6]}, 400, "invalid_prompt"),
    "n_too_large": ({**OK, "n": 100}, 400, "invalid_value"),
    "presence_penalty_out_of_range": ({**OK, "presence_penalty": 2.5}, 400, "invalid_value"),
    "repetition_penalty_zero": ({**OK, "repetition_penalty": 0}, 400, "invalid_value"),
    "logit_bias_value_out_of_range": ({**OK, "logit_bias": {"5": 150}}, 400, "invalid_value"),
    "logit_bias_key_not_a_token_id": ({**OK, "logit_bias": {"fox": 1}}, 400, "invalid_value"),
    "logit_bias_token_out_of_vocab": ({**OK, "logit_bias": {"1000000": 1}}, 400, "invalid_prompt"),
    "min_tokens_above_max_tokens": ({**OK, "min_tokens": 5}, 400, "invalid_value"),
    "too_many_stops": ({**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value"),
    "body_10mb": (b'{"prompt": "' + b"a" * (10 << 20) + b'"}', 413, "request_too_large"),
    # Structured outputs: refused at the ingress, never answered in free text.
    "schema_invalid": ({**OK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, 400, "invalid_value"),
    "schema_unsupported_keyword": ({**OK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, 400, "invalid_value"),
    "schema_without_name": ({**OK, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}}}}, 400, "invalid_value"),
    "response_format_unknown": ({**OK, "response_format": {"type": "xml"}}, 400, "invalid_value"),
    "regex_does_not_compile": ({**OK, "structured_outputs": {"regex": "(abc"}}, 400, "invalid_value"),
    "two_constraints": ({**OK, "structured_outputs": {"regex": "a+", "choice": ["a"]}}, 400, "invalid_value"),
    "both_constraint_fields": ({**OK, "structured_outputs": {"regex": "a+"},
                                "response_format": {"type": "json_object"}}, 400, "invalid_value"),
    "grammar_undefined_rule": ({**OK, "structured_outputs": {"grammar": "root ::= answer"}}, 400, "invalid_value"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input_gets_openai_error(base_url: str, case: str) -> None:
    body, status, code = BAD_INPUTS[case]
    resp = _post(base_url, "/v1/completions", body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == code and error["message"] and "type" in error


def test_ingress_refusals_are_counted_by_reason(base_url: str) -> None:
    """What the ingress refuses itself (never reaching an engine) is counted with the engines' refusals."""
    for body in (b'{"prompt": "hi", ', {**OK, "model": "gpt-7"}, {**OK, "temperature": -1}):
        assert _post(base_url, "/v1/completions", body).status_code == 400
    metrics = httpx.get(base_url + "/metrics", timeout=30).text
    counted = {}
    for line in metrics.splitlines():
        if line.startswith("conveyor_requests_rejected_total{") and 'replica="ingress-' in line:
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            counted[reason] = float(line.rsplit(" ", 1)[1])
    assert all(counted.get(r, 0) >= 1 for r in ("invalid_json", "model_not_found", "invalid_value")), counted


def test_chunked_body_over_the_limit_gets_413(base_url: str) -> None:
    # No Content-Length: the ingress must count the bytes as they stream in.
    chunks = iter([b'{"prompt": "'] + [b"a" * (256 << 10)] * 8 + [b'"}'])
    resp = httpx.post(base_url + "/v1/completions", content=chunks, timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


def test_chat_bad_inputs_and_server_keeps_serving(base_url: str, client: OpenAI) -> None:
    bad_chats = [{"model": MODEL, "messages": []},
                 {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
                 {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
                 {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 50,
                  "logprobs": True},
                 {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                 *[{"model": MODEL, "messages": [{"role": "user", "content": "x"}], **tools}
                   for tools in BAD_TOOLS]]
    for body in bad_chats:
        resp = _post(base_url, "/v1/chat/completions", body)
        assert resp.status_code == 400 and resp.json()["error"]["param"], resp.text
    assert httpx.get(base_url + "/v1/nope", timeout=10).status_code == 404
    out = client.completions.create(model=MODEL, prompt="still alive?", max_tokens=3)
    assert out.choices[0].text is not None
    state = engine_state(APP)
    assert state["num_block_tables"] == 0 and state["num_running"] == 0


UNIT_TOOL = {"type": "function", "function": {"name": "get_temperature", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"]}}}
BAD_TOOLS = [
    {"tools": [{"type": "function", "function": {"description": "no name"}}]},
    {"tools": [{"type": "function", "function": {"name": "has space"}}]},
    {"tools": [UNIT_TOOL, UNIT_TOOL]},
    {"tools": [UNIT_TOOL], "tool_choice": {"type": "function", "function": {"name": "missing"}}},
    {"tool_choice": "required"},
    {"tools": [UNIT_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
     "tool_choice": "required"},
]


def test_structured_outputs_through_the_api(client: OpenAI) -> None:
    """The tiny model writes noise; only the constraint makes these answers what was asked for."""
    choices = ["red", "green", "blue"]
    extra = {"structured_outputs": {"choice": choices}}
    out = client.completions.create(model=MODEL, prompt="a colour:", max_tokens=8, extra_body=extra, n=2, seed=1)
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.choices)
    chat = [{"role": "user", "content": "a colour?"}]
    streamed = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=8, stream=True,
                                              extra_body=extra)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) in choices
    # No other property (random weights write long strings) and room for the bounded whitespace of every gap (the
    # tiny tokenizer spends a token per space): the answer always completes.
    schema = UNIT_TOOL["function"]["parameters"] | {"additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "unit", "schema": schema}}
    answer = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=200, response_format=fmt, seed=3)
    assert json.loads(answer.choices[0].message.content)["unit"] in ("celsius", "fahrenheit")


def test_first_chunk_is_not_buffered(base_url: str) -> None:
    body = {"model": MODEL, "prompt": "stream me", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.monotonic()
    first_at = None
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = []
        for line in resp.iter_lines():
            if line.startswith("data:"):
                first_at = first_at or time.monotonic() - start
                lines.append(line)
    total = time.monotonic() - start
    # Tokens that queue up behind a busy path travel together (conveyor/router/replica.py), so chunks <= tokens.
    assert lines[-1] == "data: [DONE]" and 3 <= len(lines) <= 402
    assert json.loads(lines[-2][len("data:"):])["usage"]["completion_tokens"] == 400
    assert first_at < 0.5 * total, (first_at, total)


def test_disconnect_mid_stream_frees_blocks(base_url: str) -> None:
    before = engine_state(APP)
    body = {"model": MODEL, "prompt": "a long answer please", "max_tokens": 480, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        for _ in range(3):
            assert next(lines).startswith("data:")
            next(lines)  # the blank line between events
        assert engine_state(APP)["num_block_tables"] == 1
    # Leaving the `with` closed the connection: the proxy, ingress and replica must all let go.
    state = wait_until(lambda: (s := engine_state(APP))["num_block_tables"] == 0 and s, 15,
                       "the aborted request to free its blocks")
    assert state["num_free_blocks"] == state["num_blocks"]
    assert state["num_aborted"] == before["num_aborted"] + 1


def test_replica_publishes_routing_and_autoscaling_stats(client: OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="warm", max_tokens=4, extra_body={"ignore_eos": True})
    handle = engine_handle(APP)
    routing = handle.record_routing_stats.remote().result(timeout_s=10)
    assert set(routing) == {"num_waiting", "num_running", "kv_cache_usage", "max_num_seqs",
                            "max_waiting_requests"}
    assert routing["max_num_seqs"] == 8
    scaling = handle.record_autoscaling_stats.remote().result(timeout_s=10)
    assert {"num_waiting", "num_running", "kv_cache_usage", "ttft_p99_s", "itl_p99_s",
            "refused_fraction"} <= set(scaling)
    assert scaling["ttft_p99_s"] > 0 and scaling["itl_p99_s"] > 0 and 0 <= scaling["refused_fraction"] < 1
    assert all(isinstance(v, float) for v in scaling.values())


def test_unset_max_tokens_is_capped_to_the_replica_kv_cache(base_url: str) -> None:
    # 64 blocks x 16 = 1024 tokens of KV (more than the 512-token context): up to the context it goes.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "ignore_eos": True}
    resp = _post(base_url, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 512


def test_disconnect_before_a_plain_response_aborts(base_url: str) -> None:
    before = engine_state(APP)["num_aborted"]
    # The engine stops stepping for longer than the client waits, so the client leaves before the answer however
    # fast the machine is (the tiny model writes 480 tokens in under 0.3 s on a 2-core Zen 5).
    engine_handle(APP).stall_engine_for_test.remote(2.0).result(timeout_s=10)
    body = {"model": MODEL, "prompt": "a long answer please", "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    # The replica counts the abort as it closes the engine stream; the engine frees the blocks a step later.
    wait_until(lambda: (s := engine_state(APP))["num_aborted"] == before + 1 and s["num_block_tables"] == 0,
               15, "the abandoned request to be aborted and its blocks freed")


def test_concurrent_streams_share_messages_and_equal_their_plain_answers(client: OpenAI) -> None:
    """Streamed records from the replica come on the ingress's subscription, several streams per message
    (conveyor/router/mux.py), and reassemble to exactly what the non-streamed requests return: text, tokens, logprobs,
    finish reason and usage."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    kwargs = dict(model=MODEL, max_tokens=24, temperature=0.0, logprobs=1, extra_body={"ignore_eos": True})
    prompts = [f"number {i} of a list of" for i in range(6)]
    plain = [client.completions.create(prompt=p, **kwargs).choices[0] for p in prompts]
    # A stream that starts before the ingress has a subscription opens one; a second, started while it is open,
    # is carried by it and keeps it open (it ends a few seconds after its last stream) while the six run.
    def keep(prompt: str) -> threading.Thread:
        thread = threading.Thread(target=lambda: list(client.completions.create(
            prompt=prompt, stream=True, **kwargs | {"max_tokens": 400})))
        thread.start()
        return thread

    keepers = [keep("open")]
    wait_until(lambda: engine_state(APP)["num_subscriptions"] > 0, 20, "a subscription")
    keepers.append(keep("keep"))
    wait_until(lambda: engine_state(APP)["num_muxed_streams"] > 0, 20, "a multiplexed stream")
    before = engine_state(APP)

    def streamed(prompt: str) -> list:
        return list(client.completions.create(prompt=prompt, stream=True, stream_options={"include_usage": True},
                                              **kwargs))

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(streamed, prompts))
    after = engine_state(APP)
    for thread in keepers:
        thread.join(timeout=60)
    for full, chunks in zip(plain, results, strict=True):
        choices = [c.choices[0] for c in chunks if c.choices]
        assert "".join(c.text for c in choices) == full.text
        assert [t for c in choices for t in c.logprobs.tokens] == full.logprobs.tokens
        assert [lp for c in choices for lp in c.logprobs.token_logprobs] == full.logprobs.token_logprobs
        assert choices[-1].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == 24
    num_batches = after["num_batches"] - before["num_batches"]
    num_records = after["num_muxed_records"] - before["num_muxed_records"]
    assert num_batches > 0 and num_records > num_batches, (num_batches, num_records)


def test_a_subscription_outlives_the_stream_that_opened_it(base_url: str) -> None:
    """The ingress opens its subscription (router/demux.py) while it serves some request. Serve cancels the child
    calls of a request whose client leaves: the subscription must not be one of them, or a batch that was on its
    way to the ingress is lost with it (a stream then ends with 'records of a multiplexed stream never arrived',
    as the soak drill once did). It ends only when idle (router/replica.py SUBSCRIPTION_IDLE_S), not cancelled."""
    wait_until(lambda: engine_state(APP)["num_subscriptions"] == 0, 20, "an idle subscription to end")
    cancelled = engine_state(APP)["num_subscriptions_cancelled"]
    body = {"model": MODEL, "prompt": "a long answer please", "max_tokens": 480, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data:")
        wait_until(lambda: engine_state(APP)["num_subscriptions"] == 1, 20, "the stream to open a subscription")
    wait_until(lambda: engine_state(APP)["num_block_tables"] == 0, 15, "the stream's abort")
    wait_until(lambda: engine_state(APP)["num_subscriptions"] == 0, 20, "the idle subscription to end")
    assert engine_state(APP)["num_subscriptions_cancelled"] == cancelled
