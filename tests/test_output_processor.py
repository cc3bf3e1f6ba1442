"""OutputProcessor: core token ids -> text deltas, stop strings, totals; tokens after a stop are dropped."""
from __future__ import annotations

from conveyor.serving.output_processor import CoreOutput, OutputProcessor
from conveyor.serving.request import SamplingParams
from tests.tiny_model import build_tokenizer


def _core(rid: str, token_id: int, finish_reason: str | None = None) -> CoreOutput:
    return CoreOutput(rid, token_id, finish_reason, None, 3, 0, 0.0, 0.0, 0.0)


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
        outs, stopped = processor.process([_core("free", token_id, "length" if i == len(ids) - 1 else None),
                                           _core("stops", token_id)])
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
    assert processor.process([_core("stops", ids[0]), _core("unknown", ids[0])]) == ([], [])


def test_prompts_are_decoded_only_once_the_core_accepted_them():
    """An id no tokenizer can decode (the core refuses it) must not fail at add: the prompt tail is decoded at
    the request's first token."""
    processor = OutputProcessor(build_tokenizer())
    processor.add("bad", [3, 1 << 62], SamplingParams())
    assert "bad" in processor
    processor.remove("bad")
    assert "bad" not in processor
