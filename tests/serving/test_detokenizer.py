"""IncrementalDetokenizer against real tokenizers trained offline in the test."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from conveyor.serving.detokenizer import IncrementalDetokenizer

TEXTS = [
    "héllo wörld 日本語 🙂",
    "the quick brown fox 🙂🙂 jumps, 日本語の テキスト; ünïcödé  double  spaces",
    "🙂",
    "a",
]
_CORPUS = ["héllo wörld 日本語 🙂", "hello world, the quick brown fox", "wörld héllo again and again"] * 20


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE ("Ġ"); a small vocab splits CJK and emoji over several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def sentencepiece() -> PreTrainedTokenizerFast:
    """Llama style "▁" BPE with byte fallback: every non-ASCII char becomes <0xNN> tokens."""
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    trainer_tok.train_from_iterator(["hello world, the quick brown fox", "hello again and again world"] * 20,
                                    trainer)
    model = json.loads(trainer_tok.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)


@pytest.fixture(params=["byte_level", "sentencepiece"])
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return request.getfixturevalue(request.param)


def _encode(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _stream(tok: Any, prompt: list[int], output: list[int], chunk: int = 1,
            **kwargs: Any) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed `output` in chunks, then flush; return the detokenizer and every delta (flush last)."""
    detok = IncrementalDetokenizer(tok, prompt, **kwargs)
    deltas = [detok.update(output[i:i + chunk]) for i in range(0, len(output), chunk)]
    deltas.append(detok.flush())
    return detok, deltas


def test_tokenizers_split_multibyte_chars(byte_level: Any, sentencepiece: Any) -> None:
    """Guard the premise: single tokens of these texts decode to incomplete characters."""
    for tok in (byte_level, sentencepiece):
        ids = _encode(tok, TEXTS[0])
        assert tok.decode(ids) == TEXTS[0]
        assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_deltas_join_to_full_decode(tokenizer: Any, chunk: int) -> None:
    for text in TEXTS:
        ids = _encode(tokenizer, text)
        detok, deltas = _stream(tokenizer, [], ids, chunk=chunk)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
        assert detok.text == text and detok.output_token_ids == ids
        assert deltas[-1] == ""  # nothing was left to flush: every character completed in-stream
        assert all("\ufffd" not in d for d in deltas)


def test_every_prompt_split(tokenizer: Any) -> None:
    """Whatever prompt/output boundary, the output text is the full decode minus the prompt's text."""
    for text in TEXTS[:2]:
        ids = _encode(tokenizer, text)
        full = tokenizer.decode(ids)
        for split in range(1, len(ids)):
            prompt_text = tokenizer.decode(ids[:split])
            if prompt_text.endswith("\ufffd"):
                continue  # the prompt ends mid-character: that character belongs to neither side
            _, deltas = _stream(tokenizer, ids[:split], ids[split:])
            assert full.startswith(prompt_text)
            assert "".join(deltas) == full[len(prompt_text):], (split, deltas)
            assert all("\ufffd" not in d for d in deltas)


def test_never_emits_partial_characters(tokenizer: Any) -> None:
    """After each token the emitted text is final, and complete whenever the tokens end a character."""
    ids = _encode(tokenizer, TEXTS[1])
    detok = IncrementalDetokenizer(tokenizer, [])
    for i, token_id in enumerate(ids):
        detok.update([token_id])
        decoded = tokenizer.decode(ids[:i + 1])
        assert TEXTS[1].startswith(detok.text)
        if "\ufffd" not in decoded:  # the prefix ends on a character boundary: nothing may lag
            assert detok.text == decoded


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer: Any, skip: bool) -> None:
    ids = _encode(tokenizer, "héllo wörld")
    ids = ids[:3] + [tokenizer.eos_token_id] + ids[3:] + [tokenizer.eos_token_id]
    _, deltas = _stream(tokenizer, [], ids, skip_special_tokens=skip)
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == expected
    assert (tokenizer.eos_token in expected) is not skip


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop", ["日本", "wörld 日", "ö", "🙂"])
def test_stop_string_spanning_tokens(tokenizer: Any, stop: str, include: bool) -> None:
    text = "héllo wörld 日本語 🙂 and then more text 日本"
    ids = _encode(tokenizer, text)
    cut = text.index(stop) + (len(stop) if include else 0)
    expected = text[:cut]
    detok = IncrementalDetokenizer(tokenizer, [], stop=(stop,), include_stop_str_in_output=include)
    emitted = ""
    for token_id in ids:
        emitted += detok.update([token_id])
        # Streaming safety: nothing emitted is ever cut later.
        assert expected.startswith(emitted)
        if detok.stopped:
            break
    emitted += detok.flush()
    assert detok.stopped
    assert emitted == expected == detok.text
    assert (stop in emitted) is include
    assert detok.update(ids[:2]) == "" and detok.flush() == ""


def test_earliest_stop_wins(byte_level: Any) -> None:
    ids = _encode(byte_level, "héllo wörld 日本語 🙂")
    _, deltas = _stream(byte_level, [], ids, stop=("🙂", "wörld", "llo w"))
    assert "".join(deltas) == "hé"


def test_unfinished_stop_prefix_is_held_then_flushed(tokenizer: Any) -> None:
    text = "héllo wörld 日本"
    ids = _encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], stop=("日本語",))
    emitted = "".join(detok.update([t]) for t in ids)
    assert emitted == "héllo wörld "  # "日本" could still become the stop string
    assert detok.flush() == "日本"
    assert detok.text == text and not detok.stopped


def test_hold_back_only_what_could_start_a_stop(byte_level: Any) -> None:
    ids = _encode(byte_level, "hello world")
    detok = IncrementalDetokenizer(byte_level, [], stop=("xyz", "world!"))
    for i in range(len(ids)):
        detok.update([ids[i]])
        decoded = byte_level.decode(ids[:i + 1])
        held = "world"[:max(k for k in range(6) if decoded.endswith("world"[:k]))]
        assert detok.text == decoded[:len(decoded) - len(held)]


class _CountingTokenizer:
    """Records the longest id list decoded, to check the work per token stays bounded."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.longest = 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.longest = max(self.longest, len(ids))
        return self._tok.decode(ids, **kwargs)


def test_work_per_token_is_bounded(tokenizer: Any) -> None:
    ids = _encode(tokenizer, " ".join(TEXTS * 25))
    counting = _CountingTokenizer(tokenizer)
    _, deltas = _stream(counting, ids[:50], ids[50:], stop=("never appears",))
    assert "".join(deltas) == tokenizer.decode(ids)[len(tokenizer.decode(ids[:50])):]
    assert counting.longest <= 12


def test_invalid_bytes_do_not_grow_the_window(sentencepiece: Any) -> None:
    """A stream of bytes that never form UTF-8 still gets emitted, with a bounded decode window."""
    bad = sentencepiece.convert_tokens_to_ids("<0xFF>")
    ids = _encode(sentencepiece, "ok") + [bad] * 40 + _encode(sentencepiece, " 日本 fine")
    counting = _CountingTokenizer(sentencepiece)
    detok, deltas = _stream(counting, [], ids)
    assert "".join(deltas) == sentencepiece.decode(ids)
    assert counting.longest <= 12
    assert detok.text.endswith("日本 fine")


def _smollm2_dir() -> Path | None:
    """The converted SmolLM2 HF dir if some earlier run pulled it (the model cache is optional here)."""
    cache = Path(os.environ.get("CONVEYOR_CACHE_DIR") or Path.home() / ".cache" / "conveyor").expanduser()
    for name in ("SmolLM2-135M-Instruct", "smollm2"):
        if (cache / "models" / name / "tokenizer.json").exists():
            return cache / "models" / name
    return None


@pytest.mark.skipif(_smollm2_dir() is None, reason="SmolLM2 tokenizer not in the model cache")
def test_smollm2_round_trips() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(_smollm2_dir()))
    texts = ["Hello 🙂🚀 world", "日本語のテキストです。中文也可以", "mixed: café — naïve 👩‍👩‍👧 ok"]
    for text in texts:
        ids = _encode(tok, text)
        assert tok.decode(ids) == text
        _, deltas = _stream(tok, [], ids)
        assert "".join(deltas) == text
        assert all("\ufffd" not in d for d in deltas)
    # A chat-like prompt ahead of the output, and a stop string that starts mid-token.
    prompt = _encode(tok, "Say something: ")
    ids = _encode(tok, texts[1])
    detok, deltas = _stream(tok, prompt, ids, stop=("テキスト",))
    assert "".join(deltas) == "日本語の" and detok.stopped


def test_stop_strings_wait_for_min_tokens(byte_level: Any) -> None:
    """vLLM's min_tokens: a stop string in the text of the first min_tokens tokens does not stop the request;
    one after them does."""
    text = "hello world, hello world, hello again"
    ids = _encode(byte_level, text)
    first_world = len(_encode(byte_level, "hello world"))
    _, deltas = _stream(byte_level, [], ids, stop=("world",))
    assert "".join(deltas) == "hello "
    detok, deltas = _stream(byte_level, [], ids, stop=("world",), min_tokens=first_world)
    assert detok.stopped and "".join(deltas) == "hello world, hello "
