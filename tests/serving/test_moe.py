"""The mixture-of-experts block against a naive per-token reference, and Qwen3-MoE / Mixtral logits against
transformers' (to ATOL, float32) through prefill, chunked prefill, decode and a packed mixed step. Greedy tokens
through the engine: tests/serving/test_model_families.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.serving.models import moe
from conveyor.serving.models.moe import MoEBlock
from tests.serving.test_model import Harness, _prompt, assert_rows_match, build_variant

HIDDEN, INTERMEDIATE = 64, 32


class _Config:
    hidden_size = HIDDEN
    hidden_act = "silu"


def _block(num_experts: int, top_k: int, renormalize: bool, seed: int = 0) -> MoEBlock:
    block = MoEBlock(_Config(), num_experts=num_experts, top_k=top_k, intermediate_size=INTERMEDIATE,
                     renormalize=renormalize)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return block


def naive(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    """One token at a time, one chosen expert at a time: the definition the grouped version must match."""
    experts = block.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t].float() @ block.gate.weight.float().t(), dim=-1)
        weights, chosen = probs.topk(block.top_k)
        if block.renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), chosen.tolist(), strict=True):
            gate, up = (experts.gate_up_proj[e].float() @ x[t].float()).split(experts.intermediate)
            out[t] += (w * (experts.down_proj[e].float() @ (F.silu(gate) * up))).to(x.dtype)
    return out


@pytest.fixture(params=["grouped_mm", "expert-loop"])
def path(request, monkeypatch):
    """Both ways of running the groups: torch's grouped_mm (where this torch has a CPU one) and a matmul per
    expert."""
    if request.param == "grouped_mm":
        if not moe.grouped_mm_supported(torch.device("cpu"), torch.float32, HIDDEN, INTERMEDIATE):
            pytest.skip("this torch has no CPU grouped_mm")
    else:
        monkeypatch.setattr(moe, "grouped_mm_supported", lambda *args: False)
    return request.param


@pytest.mark.parametrize("num_experts, top_k, renormalize", [(8, 2, False), (8, 2, True), (4, 1, True),
                                                             (4, 4, False)])
@pytest.mark.parametrize("num_tokens", [1, 5, 37])
def test_block_matches_naive_reference(path, num_experts, top_k, renormalize, num_tokens):
    block = _block(num_experts, top_k, renormalize, seed=num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(block(x), naive(block, x), atol=1e-4, rtol=1e-4)


def test_experts_with_no_tokens_and_uneven_groups(path):
    experts = _block(6, 2, False).experts
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(2))
    # Experts 0 and 3 get nothing, 5 gets every token, 1 one token: groups of 0, 1, 0, ... rows.
    chosen = torch.tensor([[5, 1], [5, 2], [4, 5], [5, 2], [2, 5], [5, 4], [4, 5]])
    weights = torch.rand(7, 2, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = experts(x, chosen, weights)
        expected = torch.stack([
            sum(w * F.linear(F.silu(g) * u, experts.down_proj[e])
                for w, e, (g, u) in ((w, e, F.linear(x[t], experts.gate_up_proj[e]).split(INTERMEDIATE))
                                     for w, e in zip(weights[t].tolist(), chosen[t].tolist(), strict=True)))
            for t in range(7)])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_router_ties(path):
    """Experts 1, 2 and 3 identical (router row and weights): their probabilities tie exactly, and whichever two
    of them topk keeps, the output must equal the reference's."""
    block = _block(4, 2, True)
    with torch.no_grad():
        for p in (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj):
            p[3] = p[2]
            p[1] = p[2]
        x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(4))
        _, chosen = moe.route(block.gate(x), 2, True)
        assert (chosen > 0).all(dim=1).any()  # some token's two experts are both among the tied ones
        torch.testing.assert_close(block(x), naive(block, x), atol=1e-4, rtol=1e-4)


def test_bfloat16_close_to_float32(path):
    block = _block(8, 2, True)
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = block(x)
        got = block.to(torch.bfloat16)(x.bfloat16()).float()
    assert got.dtype == torch.float32 and (got - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("layout", ["panels", "onednn", "onednn-fused"])
@pytest.mark.parametrize("num_experts, top_k, num_tokens", [(8, 2, 1), (8, 2, 3), (8, 2, 37), (4, 1, 5), (4, 4, 9),
                                                            (8, 2, 300)])
def test_packed_experts_match_the_reference(layout, num_experts, top_k, num_tokens, monkeypatch):
    """The CPU paths with weight packing (the C++ kernel's float32 panels, else oneDNN per expert; either in place
    of the stacked parameters) against the naive reference, over steps leaving experts without rows (1 and 3
    tokens of 8 experts), steps giving every expert some, and groups past the kernel's 8 rows per pass."""
    from conveyor.serving.models.cpu_packing import packable_dtypes
    from tests.cpu_ext_gate import require_cpu_ext

    if layout == "panels":
        require_cpu_ext("moe_experts")
    else:
        monkeypatch.setattr(moe.Experts, "_kernel_fits", lambda self: False)
        if not packable_dtypes():
            pytest.skip("no oneDNN packing in this torch")
        if layout == "onednn-fused":
            require_cpu_ext("silu_and_mul")
    block = _block(num_experts, top_k, True, seed=num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = naive(block, x)
        block.experts.fused = layout == "onednn-fused"
        block.experts.pack_for_cpu()
        assert (block.experts.panels is not None) == (layout == "panels") and not list(block.experts.parameters())
        torch.testing.assert_close(block(x), expected, atol=1e-4, rtol=1e-4)


def test_rejects_bad_configs():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoEBlock(_Config(), num_experts=4, top_k=5, intermediate_size=8, renormalize=True)
    config = _Config()
    config.hidden_act = "gelu_pytorch_tanh"
    with pytest.raises(ValueError, match="hidden_act"):
        MoEBlock(config, num_experts=4, top_k=2, intermediate_size=8, renormalize=True)


# ---- whole models against transformers -------------------------------------------------------------------
VARIANTS = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
                                         use_sliding_window=False, tie_word_embeddings=False)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True)),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    """(our model, transformers model, path) for one tiny random checkpoint."""
    return build_variant(tmp_path_factory.mktemp(request.param), *VARIANTS[request.param])


def test_layers_are_sparse_where_transformers_has_them(tiny):
    ours, hf, _ = tiny
    kinds = [isinstance(layer.mlp, MoEBlock) for layer in ours.model.layers]
    assert kinds == [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert any(kinds)


def test_prefill_chunks_decode_and_mixed_steps(tiny):
    ours, hf, _ = tiny
    h = Harness(ours)
    a, b = h.new_seq(_prompt(13, 1)), h.new_seq(_prompt(7, 2))
    for chunk in (6, 7):  # the second chunk attends to the 6 cached tokens
        (logits,) = h.step([(a, chunk)])
        assert_rows_match(hf, a, logits)
    for _ in range(3):  # decodes of a packed with b's prefill, then with b's decodes
        a.tokens.append(int(logits[-1].argmax()))
        out_a, out_b = h.step([(a, 1), (b, len(b.tokens) - b.computed)])
        assert_rows_match(hf, a, out_a)
        assert_rows_match(hf, b, out_b)
        b.tokens.append(int(out_b[-1].argmax()))
        logits = out_a


def test_stacked_and_per_expert_checkpoints_load_alike(tiny):
    """transformers 5's in-memory names (stacked experts, Mixtral's block as `mlp`) load as save_pretrained's
    per-expert tensors do; a checkpoint missing one expert's projection is refused."""
    ours, hf, _ = tiny
    state = hf.state_dict()
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    again = type(ours)(ours.config)
    again.load_weights(state.items())
    for (name, p), q in zip(ours.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q), name
    per_expert = [(n, t) for n, t in ours.named_parameters() if not n.endswith("gate_up_proj")]
    per_expert += [(n.replace("gate_up_proj", f"{e}.gate_proj.weight"), t[e, :t.shape[1] // 2])
                   for n, t in ours.named_parameters() if n.endswith("gate_up_proj") for e in range(t.shape[0])]
    with pytest.raises(ValueError, match="lacks some experts"):
        again.load_weights(per_expert)


def test_cuda_graphs_only_with_grouped_mm(tiny, monkeypatch):
    """Without grouped_mm the experts read their group sizes on the host, which a CUDA graph cannot hold: the model
    says so, and the model runner leaves graphs off."""
    ours, _, _ = tiny
    cpu = torch.device("cpu")
    experts = next(m for m in ours.modules() if isinstance(m, moe.Experts))
    supported = moe.grouped_mm_supported(cpu, torch.float32, experts.hidden_size, experts.intermediate)
    assert (ours.cuda_graph_unsafe_reason(cpu, torch.float32) is None) == supported
    monkeypatch.setattr(moe, "grouped_mm_supported", lambda *args: False)
    assert "grouped_mm" in ours.cuda_graph_unsafe_reason(cpu, torch.float32)


def test_gguf_blocks_are_skipped_with_a_reason(tmp_path, caplog):
    """A MoE converted from a GGUF runs from its fp32 weights (models/moe.py MoECausalLM.GGUF_BLOCKS says why),
    its experts packed by oneDNN one by one; the engine says so and serves."""
    from conveyor.serving import LLM, SamplingParams
    from conveyor.serving.models.cpu_packing import packable_dtypes
    from tests.cpu_ext_gate import require_cpu_ext
    from tests.tiny_model import build_tiny_model, quantize_copy

    require_cpu_ext()
    quantized = quantize_copy(build_tiny_model(tmp_path / "fp32", "qwen3_moe"), tmp_path / "gguf")
    with caplog.at_level("INFO", logger="conveyor.serving.models"):
        llm = LLM(str(quantized), num_kv_blocks=32, block_size=4)
    assert llm.engine.num_gguf_linears == 0 and llm.engine.model.decode_stack is None
    assert "Qwen3MoeForCausalLM's llama.cpp layout is not mapped" in caplog.text
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    if llm.engine.config.cpu_weight_packing and packable_dtypes():
        assert "16 expert projections in place of the stacked ones" in caplog.text
