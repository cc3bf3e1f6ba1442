"""A model's recommended sampling settings apply to requests that leave them unset (vLLM's generation config)."""
from __future__ import annotations

import json

from conveyor.router.handle_records import apply_generation_defaults
from conveyor.router.protocol import ChatCompletionRequest, CompletionRequest
from conveyor.serving.models.hub import SMOLLM2_GENERATION, add_generation_defaults
from conveyor.serving.models.loader import generation_defaults


def test_defaults_are_added_to_an_existing_generation_config(tmp_path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "top_p": 0.5}))
    add_generation_defaults(tmp_path, SMOLLM2_GENERATION)
    config = json.loads((tmp_path / "generation_config.json").read_text())
    assert config == {"eos_token_id": 2, "top_p": 0.5, "temperature": 0.2}  # a value already there stays
    assert generation_defaults(tmp_path) == {"temperature": 0.2, "top_p": 0.5}


def test_unusable_or_missing_configs_give_no_defaults(tmp_path) -> None:
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -3}))
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert generation_defaults(tmp_path) == {}


def test_only_what_the_client_left_out_takes_the_default() -> None:
    defaults = {"temperature": 0.2, "top_p": 0.9}
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 "temperature": 1.0})
    params = apply_generation_defaults(chat.to_sampling_params(), defaults, chat.unset_sampling_fields())
    assert (params.temperature, params.top_p) == (1.0, 0.9)
    plain = CompletionRequest.model_validate({"prompt": "hi"})
    params = apply_generation_defaults(plain.to_sampling_params(), defaults, plain.unset_sampling_fields())
    assert (params.temperature, params.top_p, params.top_k) == (0.2, 0.9, -1)


def test_a_generation_config_repetition_penalty_applies_when_unset(tmp_path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.15, "temperature": 0.7}))
    defaults = generation_defaults(tmp_path)
    assert defaults == {"repetition_penalty": 1.15, "temperature": 0.7}
    plain = CompletionRequest.model_validate({"prompt": "hi"})
    params = apply_generation_defaults(plain.to_sampling_params(), defaults, plain.unset_sampling_fields())
    assert params.repetition_penalty == 1.15
    sent = CompletionRequest.model_validate({"prompt": "hi", "repetition_penalty": 1.0})
    params = apply_generation_defaults(sent.to_sampling_params(), defaults, sent.unset_sampling_fields())
    assert params.repetition_penalty == 1.0
