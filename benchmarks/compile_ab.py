"""Does torch.compile of the decoder pay? Eager against Inductor on SmolLM2, decode steps at max batch 1 and 16.

The compiled variant is built here, around the engine, the way vLLM compiles: one graph over all layers with the
token dimension dynamic, attention as an opaque custom op that reads the KV cache and step metadata from a
forward context (so the graph has no metadata inputs and stays whole), oneDNN-packed and GGUF-block linears as
opaque ops, and norms and rope as plain torch code for Inductor to fuse. It checks that greedy tokens are the same
and prints the decode step time of each, with the compile time.

    .venv/bin/python benchmarks/compile_ab.py                  # ~3 min (two compiles of ~40 s)
    .venv/bin/python benchmarks/compile_ab.py --batch-sizes 1

Session 6 measured it (RESULTS.md): 4% faster at batch 1, none at 16, for ~40 s of compile at start-up, so the
engine does not compile. The fused C++ norm/rope ops and the GGUF-block linears had already taken the per-op
host work that a compiled graph removes.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import Tensor

from conveyor.kernels import cpu_ext
from conveyor.serving import LLM, SamplingParams
from conveyor.serving.models import cpu_packing
from conveyor.serving.models.llama import apply_rope

_CONTEXT: dict = {}


@torch.library.custom_op("conveyor_bench::paged_attention", mutates_args=())
def paged_attention(query: Tensor, key: Tensor, value: Tensor, layer: int) -> Tensor:
    """Writes the layer's K/V into the cache and attends, all from the forward context; hidden from the graph."""
    attn = _CONTEXT["attention"][layer]
    return attn(query, key, value, _CONTEXT["kv_caches"][layer], _CONTEXT["meta"]).clone()


@paged_attention.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, layer: int) -> Tensor:
    return torch.empty_like(query)


@torch.library.custom_op("conveyor_bench::packed_linear", mutates_args=())
def packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """Inductor lowers mkldnn's packed linear only for frozen (constant) weights; opaque here."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@packed_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return x.new_empty((x.shape[0], out_features))


def _packed_forward(self: cpu_packing.PackedLinear, x: Tensor) -> Tensor:
    flat = x.reshape(-1, self.in_features).contiguous()
    out = torch.ops.conveyor_bench.packed_linear(flat, self.packed_weight, self.bias, self.out_features)
    return out.view(*x.shape[:-1], self.out_features)


def _attention_forward(attn_module):  # noqa: ANN001, ANN202 - a llama.Attention
    a = attn_module

    def forward(rope, x, kv_cache, meta):  # noqa: ANN001, ANN202 - llama.Attention.forward's signature
        q, k, v = a.qkv_proj(x).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q = apply_rope(q.view(-1, a.num_heads, a.head_dim), rope).reshape(-1, a.q_size)
        k = apply_rope(k.view(-1, a.num_kv_heads, a.head_dim), rope).reshape(-1, a.kv_size)
        return a.o_proj(torch.ops.conveyor_bench.paged_attention(q, k, v, a.layer_index))
    return forward


def compile_engine_model(llm: LLM) -> None:
    """Swap the engine's model forward for a compiled one (in place)."""
    cpu_ext.load()

    @torch.library.register_fake("conveyor_cpu::gguf_linear")
    def _(x: Tensor, q: Tensor, scales: Tensor, ggml_type: int, out_features: int) -> Tensor:
        return x.new_empty((x.shape[0], out_features))

    model = llm.engine.model
    cpu_packing.PackedLinear.forward = _packed_forward
    model.model.fused = False
    model.model.norm.fused = False
    for i, layer in enumerate(model.model.layers):
        layer.input_layernorm.fused = layer.post_attention_layernorm.fused = False
        layer.self_attn.fused = False
        layer.self_attn.layer_index = i
        layer.self_attn.forward = _attention_forward(layer.self_attn)
    _CONTEXT["attention"] = [layer.self_attn.attn for layer in model.model.layers]
    eager_forward = model.forward
    num_layers = len(model.model.layers)

    def tokens_forward(input_ids: Tensor, positions: Tensor) -> Tensor:
        return eager_forward(input_ids, positions, [None] * num_layers, None)

    compiled = torch.compile(tokens_forward, dynamic=True, fullgraph=True)

    def forward(input_ids: Tensor, positions: Tensor, kv_caches: list, meta) -> Tensor:  # noqa: ANN001
        _CONTEXT["kv_caches"], _CONTEXT["meta"] = kv_caches, meta
        return compiled(input_ids, positions)

    model.forward = forward


def decode_steps(llm: LLM, batch_size: int, prompt_len: int = 64, num_tokens: int = 40) -> tuple[float, float]:
    """(seconds to the first decode step, median decode step time) for batch_size greedy requests."""
    engine = llm.engine
    for i in range(batch_size):
        prompt = [1000 + (i * 37 + j) % 40_000 for j in range(prompt_len)]
        engine.add_request(engine.make_request(prompt, SamplingParams(max_tokens=num_tokens, temperature=0.0,
                                                                      ignore_eos=True)))
    start, first, times = time.perf_counter(), None, []
    while engine.has_unfinished():
        _, stats = engine.step()
        if stats.num_prefill_tokens == 0:
            first = first or time.perf_counter() - start
            times.append(stats.step_time_s)
    return first, statistics.median(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,16")
    args = parser.parse_args()
    probe = [[1, 2, 3, 4, 5], list(range(100, 140))]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = {}
    for mode in ("eager", "compiled"):
        llm = LLM("smollm2", max_num_seqs=16, num_kv_blocks=512)
        if mode == "compiled":
            compile_engine_model(llm)
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            first, step = decode_steps(llm, batch_size)
            print(f"{mode:>8} batch {batch_size:>2}: decode step {step * 1e3:6.2f} ms "
                  f"(first decode step after {first:.1f} s: compiles happen there)", flush=True)
        results[mode] = [r.token_ids for r in llm.generate(probe, greedy)]
    print("greedy tokens equal:", results["eager"] == results["compiled"])


if __name__ == "__main__":
    main()
