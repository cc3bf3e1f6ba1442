"""Our paged Llama-family model vs transformers: same logits for prefill, chunked prefill, decode, packing.

The truth for every token is transformers' logits over the whole sequence so far (no cache): causal attention
makes row p depend on tokens 0..p only, so each of our paged steps must reproduce the matching rows.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from conveyor.serving.attention import AttentionMetadata
from conveyor.serving.models.llama import LlamaForCausalLM
from conveyor.serving.models.loader import load_model, resolve_model_path
from tests.cpu_ext_gate import require_cpu_ext

BLOCK_SIZE = 4  # small, so prefill chunks and decodes cross block boundaries
NUM_BLOCKS = 48
VOCAB = 256
ATOL = 1e-4

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=128,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
VARIANTS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama3-rope": ("LlamaConfig", dict(tie_word_embeddings=False, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, use_sliding_window=False)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True, use_sliding_window=False)),
}


def _save_tokenizer(path: Path) -> None:
    """A word-level tokenizer over t0..t255: load_model needs tokenizer files, and there is no hub access."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t2").save_pretrained(path)


def _randomize(model: torch.nn.Module) -> None:
    """transformers zero-inits biases and one-inits norms; random values make every weight matter."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1.0 + noise if "norm" in name else noise)


def build_variant(path: Path, config_cls: str, extra: dict) -> tuple:
    """(our model, transformers model, path): a tiny random checkpoint of transformers' config_cls (TINY + extra)
    saved as safetensors into path with the word-level test tokenizer, and our model loaded from it."""
    import transformers

    config = getattr(transformers, config_cls)(**TINY, **extra)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _randomize(hf)
    hf.eval()
    hf.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path)
    ours, _, tokenizer = load_model(str(path), torch.float32, torch.device("cpu"))
    assert tokenizer.eos_token == "t2"  # (a qwen2 config makes AutoTokenizer pick a BPE class: ids differ)
    return ours, hf, path


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    """(our model, transformers model, path) for one tiny random architecture saved as safetensors."""
    return build_variant(tmp_path_factory.mktemp(request.param), *VARIANTS[request.param])


@dataclass
class Seq:
    tokens: list[int]
    blocks: list[int]  # this sequence's block table, deliberately non-contiguous
    computed: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)


class Harness:
    """Builds the step tensors by hand (what the model runner will do) and runs our model."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = NUM_BLOCKS,
                 dtype: torch.dtype = torch.float32) -> None:
        cfg = model.config
        attn = model.model.layers[0].self_attn
        shape = (num_blocks, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)
        self.model = model
        self.kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                          for _ in range(cfg.num_hidden_layers)]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()

    def new_seq(self, tokens: list[int]) -> Seq:
        num_blocks = (len(tokens) + 8 + BLOCK_SIZE - 1) // BLOCK_SIZE  # room for a few decode tokens
        return Seq(list(tokens), [self.free.pop() for _ in range(num_blocks)])

    def step(self, work: list[tuple[Seq, int]]) -> list[torch.Tensor]:
        """Run one packed step: (seq, number of new tokens) each; returns each chunk's logits [n, vocab]."""
        ids, pos, slots, qlens, slens = [], [], [], [], []
        for seq, n in work:
            span = range(seq.computed, seq.computed + n)
            ids += [seq.tokens[p] for p in span]
            pos += list(span)
            slots += [seq.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in span]
            qlens.append(n)
            slens.append(seq.computed + n)
        width = max(len(seq.blocks) for seq, _ in work)
        tables = torch.zeros(len(work), width, dtype=torch.int32)
        for i, (seq, _) in enumerate(work):
            tables[i, :len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        starts = torch.tensor([0] + qlens).cumsum(0).to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=tables,
            seq_lens=torch.tensor(slens, dtype=torch.int32), query_start_loc=starts,
            max_query_len=max(qlens), max_seq_len=max(slens), seq_lens_list=slens, query_lens_list=qlens)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.kv_caches, meta)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (len(ids), self.model.config.vocab_size)
        for seq, n in work:
            seq.computed += n
        return list(logits.split(qlens))


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


def assert_rows_match(hf, seq: Seq, ours: torch.Tensor) -> None:
    """ours: logits of seq's last ours.shape[0] computed positions."""
    expected = hf_logits(hf, seq.tokens[:seq.computed])[-ours.shape[0]:]
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_full_prefill(tiny):
    ours, hf, _ = tiny
    h = Harness(ours)
    seq = h.new_seq(_prompt(11, 0))
    (logits,) = h.step([(seq, 11)])
    assert_rows_match(hf, seq, logits)


def test_chunked_prefill_then_decode(tiny):
    ours, hf, _ = tiny
    h = Harness(ours)
    seq = h.new_seq(_prompt(13, 1))
    for chunk in (6, 7):  # the second chunk attends to the 6 cached tokens (and crosses a block boundary)
        (logits,) = h.step([(seq, chunk)])
        assert_rows_match(hf, seq, logits)
    for _ in range(4):  # greedy decode, one token per step
        seq.tokens.append(int(logits[-1].argmax()))
        (logits,) = h.step([(seq, 1)])
        assert_rows_match(hf, seq, logits)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_packed_mixed_batch(tiny, backend):
    ours, hf, _ = tiny
    for layer in ours.model.layers:
        layer.self_attn.attn.backend = backend
    try:
        h = Harness(ours)
        a, b, c = h.new_seq(_prompt(9, 2)), h.new_seq(_prompt(5, 3)), h.new_seq(_prompt(7, 4))
        h.step([(b, 5), (c, 7)])  # b and c finish their prompts together
        b.tokens.append(5)
        c.tokens.append(6)
        # One step: decode, a fresh prefill chunk, decode; lengths 6, 8 and 9 in different blocks.
        out_b, out_a, out_c = h.step([(b, 1), (a, 9), (c, 1)])
        for seq, logits in ((a, out_a), (b, out_b), (c, out_c)):
            assert_rows_match(hf, seq, logits)
    finally:
        for layer in ours.model.layers:
            layer.self_attn.attn.backend = "torch"


def test_fused_weights_and_tying(tiny):
    ours, hf, _ = tiny
    attn = ours.model.layers[0].self_attn
    assert not hasattr(attn, "q_proj") and attn.qkv_proj.weight.shape[0] == 64 + 2 * 32
    assert (ours.lm_head is None) == ours.config.tie_word_embeddings
    assert (attn.qkv_proj.bias is not None) == (ours.config.model_type == "qwen2")
    torch.testing.assert_close(attn.qkv_proj.weight[64:96], hf.model.layers[0].self_attn.k_proj.weight)


def test_rejects_bad_inputs(tiny, tmp_path):
    ours, _, path = tiny
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model_path("no/such-model")
    with pytest.raises(ValueError, match="unexpected weight"):
        ours.load_weights([("model.layers.0.self_attn.z_proj.weight", torch.zeros(16))])
    with pytest.raises(ValueError, match="shape"):
        ours.load_weights([("model.norm.weight", torch.zeros(3))])
    other = tmp_path / "other"
    shutil.copytree(path, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "gpt2",
                                                   "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel.*supported: .*LlamaForCausalLM"):
        load_model(str(other), torch.float32, torch.device("cpu"))


def test_rejects_unsupported_rope():
    from transformers import LlamaConfig

    config = LlamaConfig(**TINY, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0))
    with pytest.raises(ValueError, match="unsupported rope type"), torch.device("meta"):
        LlamaForCausalLM(config)


@pytest.mark.slow
def test_smollm2_matches_transformers():
    from transformers import AutoModelForCausalLM

    from conveyor.serving.models.hub import ModelDownloadError

    try:
        path = resolve_model_path("smollm2")
    except ModelDownloadError as exc:
        pytest.skip(f"cannot download SmolLM2 (no network?): {exc}")
    ours, _, tokenizer = load_model("smollm2", torch.float32, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(getattr(prompt, "input_ids", prompt))
    h = Harness(ours, num_blocks=(len(prompt) + 16) // BLOCK_SIZE + 8)
    seq = h.new_seq(prompt)
    (logits,) = h.step([(seq, len(prompt))])
    expected = hf_logits(hf, prompt)[-1]
    assert int(logits[-1].argmax()) == int(expected.argmax())
    torch.testing.assert_close(logits[-1], expected, atol=2e-3, rtol=0)
    for _ in range(7):  # a few greedy steps through the paged decode path
        seq.tokens.append(int(logits[-1].argmax()))
        (logits,) = h.step([(seq, 1)])
    answer = tokenizer.decode(seq.tokens[len(prompt):])
    assert answer.startswith("The capital of France is Paris"), answer


def test_cpu_backend_matches_transformers(tiny):
    """The "cpu" backend: C++ decode attention plus the fused norm and rope ops, through prefill chunks,
    decodes and a packed mixed step."""

    require_cpu_ext()
    _, hf, path = tiny
    ours, _, _ = load_model(str(path), torch.float32, torch.device("cpu"), attention_backend="cpu")
    assert ours.model.fused
    h = Harness(ours)
    a, b, c = h.new_seq(_prompt(9, 2)), h.new_seq(_prompt(5, 3)), h.new_seq(_prompt(13, 1))
    for chunk in (6, 7):
        (logits,) = h.step([(c, chunk)])
        assert_rows_match(hf, c, logits)
    h.step([(b, 5)])
    for token in (5, 6):
        b.tokens.append(token)
        c.tokens.append(token + 1)
        out_b, out_c = h.step([(b, 1), (c, 1)])  # decode-only: the C++ kernel path
        assert_rows_match(hf, b, out_b)
        assert_rows_match(hf, c, out_c)
    b.tokens.append(7)
    out_b, out_a = h.step([(b, 1), (a, 9)])  # mixed: decode row to C++, prefill rows to SDPA
    assert_rows_match(hf, b, out_b)
    assert_rows_match(hf, a, out_a)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_bfloat16_on_cpu_matches_transformers(tiny, backend):
    """bfloat16 on CPU (with oneDNN-packed bf16 linears where the CPU multiplies bf16 natively): the rope tables
    stay float32 through model.to(bfloat16), and prefill, chunked prefill and decodes match transformers run in
    bfloat16 to within bf16 rounding (summation orders differ)."""
    from conveyor.serving.models.cpu_packing import packable_dtypes

    if backend == "cpu":
        require_cpu_ext()
    _, hf32, path = tiny
    ours, _, _ = load_model(str(path), torch.bfloat16, torch.device("cpu"), attention_backend=backend)
    assert ours.model.rotary_emb.cos.dtype == torch.float32
    if torch.bfloat16 in packable_dtypes():
        assert ours.pack_for_cpu() > 0
    hf = type(hf32)(hf32.config).eval()
    hf.load_state_dict(hf32.state_dict())
    hf = hf.to(torch.bfloat16)
    h = Harness(ours, dtype=torch.bfloat16)
    seq = h.new_seq(_prompt(13, 1))
    for chunk in (6, 7):
        (logits,) = h.step([(seq, chunk)])
        expected = hf_logits(hf, seq.tokens[:seq.computed])[-chunk:]
        torch.testing.assert_close(logits, expected, atol=0.05, rtol=0.05)
    for token in (5, 6, 7):
        seq.tokens.append(token)
        (logits,) = h.step([(seq, 1)])
        expected = hf_logits(hf, seq.tokens[:seq.computed])[-1:]
        torch.testing.assert_close(logits, expected, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_qwen_dir"])
def test_load_tokenizer_is_what_auto_tokenizer_loads(model: str, request) -> None:
    """The replica's tokenizer (no model config class imported) is AutoTokenizer's, class and ids alike."""
    from transformers import AutoTokenizer

    from conveyor.serving.models.loader import load_tokenizer

    path = request.getfixturevalue(model)
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(auto) and len(ours) == len(auto)
    assert (ours.eos_token_id, ours.bos_token_id, ours.all_special_ids) == \
        (auto.eos_token_id, auto.bos_token_id, auto.all_special_ids)
    for text in ("Hello, my name is", "<|im_start|>user\nhi<|im_end|>", "héllo wörld 日本語 🙂", "  a\tb\n\n"):
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
