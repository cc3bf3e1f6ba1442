"""min_chunk_tokens with a fake model runner: while streams decode, a prefill chunk under it waits behind
decode-only steps, which put the streams ahead of their TPOT pace until the credit lets the step take a chunk of
that size; never where the credit's cap could not reach it, and never for longer than that cap's time."""
from __future__ import annotations

from tests.fake_runner import make_request, step
from tests.serving.test_slo_scheduling import BASE_S, PER_TOKEN_S, _on_pace, _scheduler_with_known_cost

# No future slack (tpot_credit_quantile None): the credit comes only from time the streams are ahead of pace.
SETTINGS = {"tpot_credit_max": 3.0, "tpot_credit_quantile": None}


def _chunks(min_chunk_tokens: int | None, prompt_len: int = 1000, behind: bool = False,
            num_steps: int = 100) -> list[tuple[float, int]]:
    """Step the 4 on-pace streams of _scheduler_with_known_cost and a long prompt, the clock advancing by each
    step's modelled cost: (seconds since the prompt came, its chunk's tokens or 0) for each step."""
    scheduler, runner = _scheduler_with_known_cost(min_chunk_tokens=min_chunk_tokens, **SETTINGS)
    now = 100.0
    _on_pace(scheduler, now)
    if behind:  # 10 s for ~30 tokens: far behind a 100 ms pace, so it never lends credit
        scheduler.running[0].first_token_time = now - 10.0
    scheduler.add_request(make_request("long", prompt_len, 2, first_token=300))  # no prefix-cache hit
    steps = []
    for _ in range(num_steps):
        scheduler.clock = lambda now=now: now
        sched, _ = step(scheduler, runner)
        chunks = {c.request.request_id: c.num_tokens for c in sched.chunks}
        steps.append((now - 100.0, chunks.pop("long", 0)))
        assert chunks == {f"s{i}": 1 for i in range(4)}
        now += BASE_S + PER_TOKEN_S * sched.num_scheduled_tokens
    return steps


def _first_chunk(min_chunk_tokens: int | None, prompt_len: int = 1000, behind: bool = False) -> tuple[int, float, int]:
    """(the long prompt's first chunk, seconds until then, decode-only steps before it)."""
    steps = _chunks(min_chunk_tokens, prompt_len, behind)
    num_decode_only = next(i for i, (_, tokens) in enumerate(steps) if tokens)
    waited_s, tokens = steps[num_decode_only]
    return tokens, waited_s, num_decode_only


def test_a_small_chunk_waits_for_the_credit_of_decode_only_steps():
    # On pace the room is 176 tokens (10 + 0.5 (4 + n) <= 100 ms). Each 12 ms decode-only step puts the streams
    # 88 ms ahead; 300 tokens need a 162 ms step, i.e. 62 ms of credit: one step.
    tokens, waited_s, num_decode_only = _first_chunk(min_chunk_tokens=300)
    assert num_decode_only == 1 and waited_s < 0.02
    assert 300 <= tokens <= 376  # the credit after one step: 100 + 88 ms, 10 + 0.5 (4 + n) <= 188 ms, n = 352
    tokens, _, num_decode_only = _first_chunk(min_chunk_tokens=450)  # needs 137 ms of credit: two steps
    assert num_decode_only == 2 and tokens >= 450


def test_the_token_budget_bounds_what_the_credit_could_reach():
    # max_num_batched_tokens 512 leaves at most 508 beside the 4 decodes, whatever the credit: no wait for 600.
    tokens, _, num_decode_only = _first_chunk(min_chunk_tokens=600)
    assert num_decode_only == 0 and abs(tokens - 176) <= 2


def test_what_is_pending_below_the_minimum_goes_at_once():
    tokens, _, num_decode_only = _first_chunk(min_chunk_tokens=300, prompt_len=120)
    assert (tokens, num_decode_only) == (120, 0)


def test_no_wait_where_the_credit_cap_could_not_reach_the_minimum():
    # At the cap (3 targets) the room is 10 + 0.5 (4 + n) <= 400 ms, n = 776: 1000 is out of reach.
    tokens, _, num_decode_only = _first_chunk(min_chunk_tokens=1000)
    assert num_decode_only == 0 and abs(tokens - 176) <= 2


def test_the_wait_ends_after_the_credit_caps_time_even_without_credit():
    tokens, waited_s, num_decode_only = _first_chunk(min_chunk_tokens=300, behind=True)
    assert num_decode_only > 1 and 0.3 <= waited_s < 0.3 + 0.02  # 3 targets of 100 ms, then what the room gives
    assert abs(tokens - 176) <= 2
    # And it does not begin again for as long: the prompt's next chunks follow step after step.
    steps = _chunks(min_chunk_tokens=300, behind=True, num_steps=num_decode_only + 4)
    assert all(abs(tokens - 176) <= 2 for _, tokens in steps[num_decode_only:])


def test_off_by_default():
    tokens, _, num_decode_only = _first_chunk(min_chunk_tokens=None)
    assert num_decode_only == 0 and abs(tokens - 176) <= 2
