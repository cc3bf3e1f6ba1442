"""OutputProcessor: core token ids -> text deltas, stop strings, totals; tokens after a stop are dropped."""
from __future__ import annotations

from conveyor.serving.output_processor import CoreOutputs, OutputProcessor, RequestTimes
from conveyor.serving.request import SamplingParams
from tests.tiny_model import build_tokenizer


def _step(*rows: tuple[str, int, str | None]) -> CoreOutputs:
    """One core step's columns: (request id, token id, finish reason) per row, each with its RequestTimes (the
    processor reads them from a request's first output and ignores them after)."""
    out = CoreOutputs([rid for rid, _, _ in rows], [token_id for _, token_id, _ in rows])
    out.finish_reasons = {i: reason for i, (_, _, reason) in enumerate(rows) if reason is not None}
    out.times = {i: RequestTimes(3, 0, 0.0, 0.0, float(i)) for i in range(len(rows))}
    return out


def test_text_totals_stop_strings_and_late_tokens():
    tok = build_tokenizer()
    ids = tok.encode("Paris is the capital. Next", add_special_tokens=False)
    stop_at = tok.decode(ids[:4])  # the text of the first four tokens
    processor = OutputProcessor(tok)
    processor.add("free", [1, 2, 3], SamplingParams())
    processor.add("stops", [1, 2, 3], SamplingParams(stop=(tok.decode(ids[4:6]),)))
    outputs = []
    stopped_ids = []
    for i, token_id in enumerate(ids):
        outs, stopped = processor.process(_step(("free", token_id, "length" if i == len(ids) - 1 else None),
                                                ("stops", token_id, None)))
        outputs += outs
        stopped_ids += stopped
    free = [o for o in outputs if o.request_id == "free"]
    assert "".join(o.delta_text for o in free) == free[-1].text == tok.decode(ids)
    assert free[-1].token_ids == ids and free[-1].finish_reason == "length" and free[-1].finished
    stops = [o for o in outputs if o.request_id == "stops"]
    assert stopped_ids == ["stops"]
    assert stops[-1].finished and stops[-1].finish_reason == "stop"
    assert stops[-1].text.startswith(stop_at) and "Next" not in stops[-1].text
    # tokens the core computed after the stop (or for an aborted request) are dropped, not delivered
    assert len(stops) < len(ids) and "stops" not in processor and "free" not in processor
    assert processor.process(_step(("stops", ids[0], None), ("unknown", ids[0], None))) == ([], [])


def test_prompts_are_decoded_only_once_the_core_accepted_them():
    """An id no tokenizer can decode (the core refuses it) must not fail at add: the prompt tail is decoded at
    the request's first token."""
    processor = OutputProcessor(build_tokenizer())
    processor.add("bad", [3, 1 << 62], SamplingParams())
    assert "bad" in processor
    processor.remove("bad")
    assert "bad" not in processor


def test_request_times_come_with_the_first_output_and_stay_on_every_later_one():
    processor = OutputProcessor(build_tokenizer())
    processor.add("r", [1, 2, 3], SamplingParams())
    first = CoreOutputs(["r"], [5], times={0: RequestTimes(3, 2, 10.0, 11.0, 12.0)})
    later = CoreOutputs(["r", "r"], [6, None], finish_reasons={1: "length"})
    outputs = processor.process(first)[0] + processor.process(later)[0]
    assert [o.delta_token_ids for o in outputs] == [[5], [6], []]
    for out in outputs:
        assert (out.num_prompt_tokens, out.num_cached_tokens, out.arrival_time, out.first_scheduled_time,
                out.first_token_time) == (3, 2, 10.0, 11.0, 12.0)
    assert outputs[-1].finished and outputs[-1].finish_reason == "length" and "r" not in processor
