"""The mixture-of-experts block (Qwen3-MoE, Mixtral): a top-k router and experts run as grouped matrix multiplies.

Each token goes to its top_k experts by router softmax probability (renormalized over the chosen k where the
family does so); the T * top_k (token, expert) rows are sorted by expert, so each expert's rows are one contiguous
group, and gate_up then down run as one grouped matmul each over all groups (torch's grouped_mm where this
device and dtype have it, else one matmul per expert that has rows, as also on the CPU for steps with fewer rows
than experts; never a loop over tokens). The rows go back to token order and each token sums its k weighted results.
On the CPU with weight packing, the experts are re-laid out instead (Experts.pack_for_cpu says how and why).

Expert weights are stacked as transformers 5 holds them in memory: gate_up_proj [E, 2 * I, H] (gate rows first),
down_proj [E, H, I]. Checkpoints store one tensor per expert and projection (`experts.{e}.gate_proj.weight`, or
Mixtral's `experts.{e}.w1.weight`); MoECausalLM maps each onto its slice of the stacked parameter.
"""
from __future__ import annotations

import functools
import itertools
import logging
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from conveyor.kernels import cpu_ext, cpu_fused
from conveyor.serving.models.base import CausalLM
from conveyor.serving.models.cpu_packing import pack_weight, packed_linear

logger = logging.getLogger(__name__)

# checkpoint projection name -> (our stacked parameter, shard: 0 gate / 1 up rows of gate_up_proj, None whole)
EXPERT_SHARDS: dict[str, tuple[str, int | None]] = {
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None),
    "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None),  # Mixtral
}
_EXPERT_NAME = re.compile(r"(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight")
_STACKED = (".experts.gate_up_proj", ".experts.down_proj")  # transformers 5's in-memory names, and ours
EXPERT_ACTIVATIONS = ("silu",)  # every MoE family served (Qwen3-MoE, Mixtral)
PANEL = 16  # outputs per weight panel of conveyor_cpu.moe_experts (kPanel in csrc/cpu/moe_experts_cpu.cpp)


def num_experts(config) -> int:
    """Qwen3-MoE checkpoints name it num_experts; Mixtral's, and transformers 5's for both, num_local_experts."""
    count = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not count:
        raise ValueError("a mixture-of-experts config needs num_experts or num_local_experts")
    return int(count)


def route(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """[T, E] logits -> (weights [T, top_k] in the logits' dtype, expert ids int64 [T, top_k]); the softmax runs
    in float32, as transformers does, so both pick the same experts."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


@functools.cache
def grouped_mm_supported(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int) -> bool:
    """Whether F.grouped_mm runs here for these sizes (CPU: any dtype with 16-byte aligned rows; CUDA: bf16 on
    recent GPUs): one tiny probe per (device, dtype, sizes), outside any CUDA graph capture."""
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        offs = torch.tensor([1, 2], dtype=torch.int32, device=device)
        for k, n in ((hidden, 2 * intermediate), (intermediate, hidden)):
            weight = torch.zeros(2, n, k, dtype=dtype, device=device).transpose(1, 2)  # stored [E, out, in]
            F.grouped_mm(torch.zeros(2, k, dtype=dtype, device=device), weight, offs=offs)
    except (RuntimeError, NotImplementedError):
        return False
    return True


class Router(nn.Module):
    """The gate: a plain [E, H] weight, kept out of oneDNN packing (pack_linears packs nn.Linear only) so the
    routing logits, and with them the experts chosen at near-ties, are computed exactly as transformers does."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


class Experts(nn.Module):
    """num_experts SiLU-gated MLPs, weights stacked (re-laid out on the CPU: pack_for_cpu); forward runs the routed
    rows grouped by expert."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, fused: bool = False) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate = num_experts, hidden_size, intermediate_size
        self.fused = fused  # SiLU-and-mul in one C++ pass (conveyor/kernels/cpu_fused.py)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # Set by pack_for_cpu, at most one: (gate_up, down) in the C++ kernel's panels, or oneDNN-packed per expert.
        self.panels: tuple[Tensor, Tensor] | None = None
        self.packed: list[tuple[Tensor, Tensor]] | None = None

    def _kernel_fits(self) -> bool:
        return (self.gate_up_proj.dtype == torch.float32 and cpu_ext.has_op("moe_experts")
                and self.intermediate % PANEL == 0 and self.hidden_size % PANEL == 0)

    def pack_for_cpu(self) -> None:
        """Re-lay the experts out for the CPU, in place of the stacked parameters: the CPU paths never read those,
        so they are dropped and the experts' memory stays one copy. A decode step gives each expert few rows, so
        each expert's matmul is short and the weights come cold from memory. float32 with the CPU extension:
        panels for conveyor_cpu.moe_experts, which streams every expert with rows in one parallel region per
        projection (hidden 512, intermediate 256, 8 experts top-2, Zen 4: 2.5x faster than oneDNN packing at 1-16
        tokens, 1.15-1.35x at 256-512). Otherwise each expert's gate_up and down packed for oneDNN: MKL repacks a
        cold weight at every call, and packed an expert's two matmuls take about half the time (1-16 rows: 85-118
        against 164-255 us; CPU grouped_mm as slow as MKL)."""
        if self._kernel_fits():
            self.panels = tuple(w.detach().unflatten(1, (-1, PANEL)).transpose(2, 3).contiguous()
                                for w in (self.gate_up_proj, self.down_proj))  # [E, N, K] -> [E, N / PANEL, K, PANEL]
        else:
            self.packed = [(pack_weight(self.gate_up_proj[e]), pack_weight(self.down_proj[e]))
                           for e in range(self.num_experts)]
        del self.gate_up_proj, self.down_proj

    def forward(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """x [T, H], experts int64 [T, k], weights [T, k] -> [T, H]: sum over k of weight * expert(x)."""
        num_tokens, top_k = experts.shape
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # row r of the grouped input is (token, slot) order[r] of the flat list
        tokens, scales = order // top_k, weights.flatten()[order, None]
        rows = x[tokens]
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.panels is not None or self.packed is not None:
            # One host read of the group sizes per layer; each token's results add up in expert order, as
            # transformers adds them.
            return torch.zeros_like(x).index_add_(0, tokens, self._cpu_experts(rows, counts.tolist()) * scales)
        hidden = self._silu_and_mul(self._grouped(rows, self.gate_up_proj, counts))
        out = self._grouped(hidden, self.down_proj, counts) * scales
        unsorted = torch.empty_like(out)
        unsorted[order] = out
        return unsorted.view(num_tokens, top_k, -1).sum(dim=1)

    def _silu_and_mul(self, gate_up: Tensor) -> Tensor:
        if self.fused:
            return cpu_fused.silu_and_mul(gate_up)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return F.silu(gate) * up

    def _cpu_experts(self, rows: Tensor, sizes: list[int]) -> Tensor:
        """rows sorted by expert, sizes[e] of them for expert e -> each row's expert output, in the same order."""
        if self.panels is not None:
            return torch.ops.conveyor_cpu.moe_experts(rows, *self.panels, sizes)
        # oneDNN: only the two matmuls run per expert with rows, the SiLU-and-mul once over all rows.
        active = [(packed, size) for packed, size in zip(self.packed, sizes, strict=True) if size]
        lengths = [size for _, size in active]
        gate_up = torch.cat([packed_linear(group, packed[0])
                             for (packed, _), group in zip(active, rows.split(lengths), strict=True)])
        hidden = self._silu_and_mul(gate_up)
        return torch.cat([packed_linear(group, packed[1])
                          for (packed, _), group in zip(active, hidden.split(lengths), strict=True)])

    def _grouped(self, rows: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
        """rows sorted by expert, counts[e] of them for expert e -> rows @ weight[e].T for each group."""
        # On the CPU, grouped_mm runs a matmul for every expert, rows or none: with fewer rows than experts (small
        # decode steps) most groups are empty, and the loop below, over the non-empty ones only, does less.
        few_rows = rows.device.type == "cpu" and rows.shape[0] < self.num_experts
        if not few_rows and grouped_mm_supported(rows.device, rows.dtype, self.hidden_size, self.intermediate):
            offs = counts.cumsum(0).to(torch.int32)  # on the device: no host sync, CUDA-graph safe
            return F.grouped_mm(rows, weight.transpose(1, 2), offs=offs)
        # Reads the group sizes on the host: never inside a CUDA graph (cuda_graph_unsafe_reason keeps them off).
        out = rows.new_empty(rows.shape[0], weight.shape[1])
        start = 0
        for expert, count in enumerate(counts.tolist()):  # a loop over experts, each a matmul over its group
            if count:
                torch.matmul(rows[start:start + count], weight[expert].t(), out=out[start:start + count])
            start += count
        return out


class MoEBlock(nn.Module):
    """Router + experts; a drop-in for a decoder layer's MLP ([T, H] -> [T, H])."""

    def __init__(self, config, fused: bool = False, *, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", None) or "silu"
        if act not in EXPERT_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r} for experts; supported: {EXPERT_ACTIVATIONS}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Router(config.hidden_size, num_experts)
        self.experts = Experts(num_experts, config.hidden_size, intermediate_size, fused)

    def forward(self, x: Tensor) -> Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)
        return self.experts(x, experts, weights)


def numbered_layers(make_layer: Callable[[object, str, bool, int], nn.Module]) -> Callable[..., nn.Module]:
    """A layer_cls for LlamaModel, which calls it once per layer in order, that passes make_layer the layer's
    index too (Qwen3-MoE picks dense or sparse MLPs by index)."""
    index = itertools.count()
    return lambda config, backend, fused: make_layer(config, backend, fused, next(index))


class MoECausalLM(CausalLM):
    """Loads per-expert checkpoint tensors into the stacked expert parameters; stacked checkpoint tensors (named
    as ours, `...experts.gate_up_proj`) load whole."""

    # A GGUF converts to fp32 safetensors and runs from them: no GGUF-block kernel runs grouped experts, and
    # llama.cpp leaves Qwen's q/k rows unpermuted where gguf_weights.extract_blocks undoes Llama's permutation.
    GGUF_BLOCKS = False

    def pack_for_cpu(self) -> int:
        """Attention, dense MLPs and the LM head as CausalLM packs them, and each expert's two projections in
        place of the stacked ones (Experts.pack_for_cpu)."""
        count = super().pack_for_cpu()
        blocks = [m for m in self.modules() if isinstance(m, Experts)]
        for experts in blocks:
            experts.pack_for_cpu()
        experts_count = sum(2 * experts.num_experts for experts in blocks)
        layout = "C++ kernel panels" if blocks and blocks[0].panels is not None else "oneDNN"
        logger.info("oneDNN packing: %d linears packed, and %d expert projections in place of the stacked ones (%s)",
                    count, experts_count, layout)
        return count + experts_count

    def cuda_graph_unsafe_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why decode steps cannot be captured in CUDA graphs (the model runner asks), or None."""
        experts = next(m for m in self.modules() if isinstance(m, Experts))
        if grouped_mm_supported(device, dtype, experts.hidden_size, experts.intermediate):
            return None
        return f"mixture-of-experts layers without F.grouped_mm for {dtype} here read group sizes on the host"

    def _expert_slot(self, name: str) -> tuple[str, int, int | None] | None:
        """'...experts.3.up_proj.weight' -> ('...experts.gate_up_proj', 3, 1); None for other names."""
        match = _EXPERT_NAME.fullmatch(name)
        if match is None or match["proj"] not in EXPERT_SHARDS:
            return None
        param, shard = EXPERT_SHARDS[match["proj"]]
        return f"{match['prefix']}.{param}", int(match["expert"]), shard

    def _fused_name(self, name: str) -> str:
        slot = self._expert_slot(name)
        return super()._fused_name(name) if slot is None else slot[0]

    def _target(self, name: str, params: dict[str, Tensor]) -> tuple[Tensor, tuple | slice]:
        slot = self._expert_slot(name)
        if slot is None:
            if name.endswith(_STACKED):
                self._expert_slices.add((name, None, None))
            return super()._target(name, params)
        ours, expert, shard = slot
        if ours not in params:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        experts = self.get_submodule(ours.rsplit(".", 1)[0])
        if expert >= experts.num_experts:
            raise ValueError(f"{name}: expert {expert} of a block with {experts.num_experts}")
        self._expert_slices.add((ours, expert, shard))
        size = experts.intermediate
        return params[ours], (expert, slice(None) if shard is None else slice(shard * size, (shard + 1) * size))

    def load_weights(self, weights) -> None:
        """As CausalLM's, and every expert's every projection must arrive (a missing one would stay garbage)."""
        self._expert_slices: set[tuple[str, int | None, int | None]] = set()
        super().load_weights(weights)
        for name, module in self.named_modules():
            if isinstance(module, Experts):
                for param, shards in (("gate_up_proj", (0, 1)), ("down_proj", (None,))):
                    ours = f"{name}.{param}"
                    want = {(ours, e, s) for e in range(module.num_experts) for s in shards}
                    if (ours, None, None) not in self._expert_slices and not want <= self._expert_slices:
                        raise ValueError(f"checkpoint lacks some experts' weights for {ours}")
