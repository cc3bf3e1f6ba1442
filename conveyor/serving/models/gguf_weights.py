"""A GGUF's quantized linear weights kept in the file's own blocks, for small-batch CPU steps.

The fp32 model a GGUF converts to is exactly the dequantized blocks. For a step of a few tokens the engine reads
the blocks instead (conveyor/kernels/gguf.py): the same weights in ~5 bits (Q4_1) or 8.5 (Q8_0) rather than 32, so a
batch-1 decode step, whose time is the bytes it reads, gets several times cheaper and computes the same thing up to
summation order. Larger steps are compute-bound and keep the fp32 (oneDNN-packed) path, or a bf16 one
(`cpu_prefill_dtype`, multiply_prefills_in_bfloat16).

Conversion writes the blocks next to the fp32 checkpoint (`gguf/blocks.safetensors`: uint8 [N, K/32 * block
bytes] under the HF parameter name, the ggml type in the metadata), with llama.cpp's q/k row permutation undone
as transformers undoes it for the fp32 tensors.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from torch import Tensor, nn

from conveyor.kernels import gguf
from conveyor.serving.config import EngineConfig
from conveyor.serving.models.cpu_packing import Bfloat16PackedLinear

logger = logging.getLogger(__name__)

BLOCKS_FILE = Path("gguf") / "blocks.safetensors"
# Steps with more rows than this use the fp32 weights. The default for callers that pass no max_rows, and the
# portable kernel's crossover: there, from ~8 rows, a Q4_1 GEMM is compute-bound on expanding blocks and oneDNN's
# packed fp32 GEMM is faster. The engine passes kernels.gguf.default_max_rows() (64 with AVX2 or AVX-512).
DEFAULT_MAX_ROWS = 8

# With cpu_prefill_dtype bfloat16 oneDNN's packed bf16 GEMM overtakes the fp32 blocks kernels between 8 and 16 rows
# (SmolLM2's 120 linears, 2-core Zen 4: 11.6 / 14.8 ms at 8 rows, 21.0 / 18.3 at 16, 74.2 / 43.1 at 64), and
# decode-only steps of 16 rows run as fast either way (32 rows: 604 / 508 output tok/s in bf16 / blocks). Where the
# blocks have a bf16 kernel too (AVX512-BF16, kernels/gguf.py), that one stays ahead up to 64 rows.
BFLOAT16_PREFILL_MAX_ROWS = 12
BFLOAT16_BLOCKS_MAX_ROWS = 64
# With cpu_prefill_dtype int8 every step reads the blocks: the int8 kernel runs SmolLM2's layer linears at ~1.5x
# oneDNN's packed bf16 GEMM at 64-512 rows, so no step needs the packed weights (freed: multiply_in_int8).
INT8_MAX_ROWS = 1 << 30

_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str | None:
    """llama.cpp tensor name -> transformers' Llama parameter name (None: not a weight we keep in blocks)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"
    return None


def _unpermute_rows(rows: Tensor, num_heads: int) -> Tensor:
    """Undo llama.cpp's interleaving of q/k rows (transformers' reverse_permute_weights, on whole rows)."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def extract_blocks(gguf_path: Path, config) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The Q4_1/Q8_0 linear weights of a llama-family GGUF, HF-named, as raw blocks; plus name -> ggml type.
    llama.cpp interleaves the q/k rows of its `llama` architecture (Llama, Mistral, SmolLM2) only: a Qwen2/Qwen3
    file keeps them in Hugging Face's order, as transformers' reader assumes too."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    field = reader.fields.get("general.architecture")
    permuted = field is not None and field.contents() == "llama"
    tensors, types = {}, {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        ggml_type = int(tensor.tensor_type)
        if name is None or ggml_type not in gguf.BLOCK_BYTES:
            continue
        rows = torch.from_numpy(tensor.data.copy())
        if permuted and ".q_proj." in name:
            rows = _unpermute_rows(rows, config.num_attention_heads)
        elif permuted and ".k_proj." in name:
            rows = _unpermute_rows(rows, config.num_key_value_heads)
        tensors[name] = rows.contiguous()
        types[name] = gguf.TYPE_NAMES[ggml_type]
    return tensors, types


def save_blocks(model_dir: Path, tensors: dict[str, Tensor], types: dict[str, str]) -> None:
    from safetensors.torch import save_file

    path = model_dir / BLOCKS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"ggml_types": json.dumps(types)})
    path.chmod(0o644)


def load_blocks(model_dir: Path) -> dict[str, tuple[Tensor, int]] | None:
    """name -> (uint8 blocks, ggml type), or None when the model did not come from a GGUF."""
    from safetensors import safe_open

    path = model_dir / BLOCKS_FILE
    if not path.is_file():
        return None
    ids = {v: k for k, v in gguf.TYPE_NAMES.items()}
    with safe_open(str(path), framework="pt") as f:
        types = json.loads(f.metadata()["ggml_types"])
        return {name: (f.get_tensor(name), ids[types[name]]) for name in f.keys()}  # noqa: SIM118


class GGUFLinear(nn.Module):
    """Steps of at most max_rows rows multiply by the GGUF blocks; larger ones call `dense` (the packed fp32 layer, or
    a Bfloat16PackedLinear)."""

    def __init__(self, blocks: Tensor, ggml_type: int, dense: nn.Module, bias: Tensor | None, max_rows: int) -> None:
        super().__init__()
        in_features = blocks.shape[1] // gguf.BLOCK_BYTES[ggml_type] * gguf.BLOCK
        self.weight = gguf.prepare(blocks, ggml_type, in_features)  # both kernels' layouts
        self.dense = dense
        self.bias = bias
        self.max_rows = max_rows
        self.bf16_min_rows: int | None = None  # steps from this many rows multiply the blocks in bf16 (gguf.py)
        self.int8_weight: gguf.Int8Weight | None = None  # cpu_prefill_dtype int8 (multiply_in_int8)

    @property
    def ggml_type(self) -> int:
        return self.weight.ggml_type

    @property
    def out_features(self) -> int:
        return self.weight.out_features

    def forward(self, x: Tensor) -> Tensor:
        if x.numel() // x.shape[-1] > self.max_rows:
            return self.dense(x)
        out = gguf.gguf_linear(x, self.weight, self.bf16_min_rows, self.int8_weight)
        return out if self.bias is None else out + self.bias


def default_gguf_max_rows(config: EngineConfig) -> int:
    """gguf_max_rows when unset: the blocks kernels' crossover against the packed weights the larger steps use."""
    if config.cpu_prefill_dtype == "int8":
        return INT8_MAX_ROWS
    if config.cpu_prefill_dtype == "bfloat16":
        return BFLOAT16_BLOCKS_MAX_ROWS if gguf.has_bf16_kernel() else BFLOAT16_PREFILL_MAX_ROWS
    return gguf.default_max_rows()


def multiply_prefills_in_bfloat16(model: nn.Module) -> int:
    """Give every GGUFLinear of the decoder layers a bf16 path for its large steps in place of the fp32 one (whose
    packed weights are then freed), built from the blocks: they dequantize to the fp32 weights exactly. Where the
    blocks kernel has a bf16 variant, every GGUFLinear (the LM head's too) also takes it from gguf.BF16_MIN_ROWS
    rows; smaller steps stay fp32. The LM head's large steps stay fp32: its rows are a step's sequences, rarely
    past max_rows. Returns how many layer linears have a bf16 path."""
    count = 0
    bf16_min_rows = gguf.BF16_MIN_ROWS if gguf.has_bf16_kernel() else None
    for layer in model.model.layers:
        for module in layer.modules():
            if isinstance(module, GGUFLinear):
                module.dense = Bfloat16PackedLinear(module.weight.dequantize(), module.bias)
                module.bf16_min_rows = bf16_min_rows
                count += 1
    head = model.packed_logits if getattr(model, "packed_logits", None) is not None else model.lm_head
    if isinstance(head, GGUFLinear) and bf16_min_rows is not None:
        head.bf16_min_rows = bf16_min_rows
    return count


def multiply_in_int8(model: nn.Module) -> int:
    """Give every GGUFLinear (the LM head's too) the int8 kernel for its steps past the rows kernel
    (kernels/gguf.py gguf_linear_int8: each block of 32 activations rounded to int8, products with the quants summed
    exactly); one that no step sends past max_rows frees its packed weights. Returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, GGUFLinear):
            module.int8_weight = gguf.prepare_int8(module.weight)
            if module.max_rows >= INT8_MAX_ROWS:
                module.dense = None
            count += 1
    return count


def _fused_blocks(blocks: dict[str, tuple[Tensor, int]], names: list[str]) -> tuple[Tensor, int] | None:
    """Row-concatenate the parts of a fused projection (q|k|v, gate|up); None unless all share one type."""
    parts = [blocks.get(n) for n in names]
    if any(p is None for p in parts) or len({p[1] for p in parts}) != 1:
        return None
    return torch.cat([p[0] for p in parts]), parts[0][1]


def attach_gguf_weights(model: nn.Module, blocks: dict[str, tuple[Tensor, int]],
                        max_rows: int = DEFAULT_MAX_ROWS) -> int:
    """Wrap every linear of a LlamaForCausalLM whose weights exist as blocks in a GGUFLinear; returns how many.
    The blocks must dequantize to the model's weights (conversion guarantees it; tests check it)."""
    if not type(model).GGUF_BLOCKS:
        logger.info("GGUF blocks not used, all steps read fp32 weights: %s's llama.cpp layout is not mapped",
                    type(model).__name__)
        return 0
    count = 0
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        plan = [(attn, "qkv_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
                (attn, "o_proj", ["self_attn.o_proj"]),
                (mlp, "gate_up_proj", ["mlp.gate_proj", "mlp.up_proj"]),
                (mlp, "down_proj", ["mlp.down_proj"])]
        for parent, attr, parts in plan:
            found = _fused_blocks(blocks, [f"{prefix}{p}.weight" for p in parts])
            if found is not None:
                count += _wrap(parent, attr, *found, max_rows)
    if model.lm_head is not None:
        count += _attach_logits(model, blocks.get("lm_head.weight"), max_rows)
    else:
        count += _attach_logits(model, blocks.get("model.embed_tokens.weight"), max_rows)
    return count


def _wrap(parent: nn.Module, attr: str, rows: Tensor, ggml_type: int, max_rows: int) -> int:
    dense = getattr(parent, attr)
    out_features = dense.out_features
    if rows.shape[0] != out_features:
        raise ValueError(f"{attr}: GGUF blocks have {rows.shape[0]} rows, the layer {out_features}")
    setattr(parent, attr, GGUFLinear(rows, ggml_type, dense, dense.bias, max_rows))
    return 1


def _attach_logits(model: nn.Module, found: tuple[Tensor, int] | None, max_rows: int) -> int:
    """The LM head: an untied lm_head, or the tied embedding (whose plain table the lookup keeps using)."""
    if found is None:
        return 0
    rows, ggml_type = found
    if model.lm_head is not None:
        return _wrap(model, "lm_head", rows, ggml_type, max_rows)
    dense = model.packed_logits or _TiedLogits(model.model.embed_tokens.weight)
    model.packed_logits = GGUFLinear(rows, ggml_type, dense, None, max_rows)
    return 1


class _TiedLogits(nn.Module):
    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.linear(x, self.weight)


def gguf_weights_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return f"the GGUF-block kernel is CPU-only (device {device})"
    if dtype != torch.float32:
        return f"the GGUF-block kernel takes float32 activations (dtype {dtype})"
    if not gguf.is_available():
        return "the CPU extension did not build"
    return None
