"""A checkpoint folder's safetensors files (sharded ones through their index) and the dtype it is stored in.

`dtype: auto` takes the stored dtype where the device multiplies it natively and float32 otherwise: CUDA computes
bf16/fp16 as stored, a CPU only bf16 and only with AVX512-BF16 or AMX (emulated bf16 is far slower than fp32,
docs/cpu_tuning.md). A model converted from a GGUF keeps what it ran before: float32 on CPU (the quantized-row
kernels take fp32 activations), bfloat16 on CUDA (its weights were 4-8 bit blocks, not fp32 ones).
"""
from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from conveyor.serving.models.hub import COMPLETE_MARKER

INDEX_FILE = "model.safetensors.index.json"
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_NAMED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def safetensors_files(model_dir: Path) -> list[Path]:
    """The shards model.safetensors.index.json names (only those: a stray *.safetensors is not the model's),
    else every *.safetensors in the folder. ValueError where the index names a shard that is not there."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if not index.is_file():
        return sorted(model_dir.glob("*.safetensors"))
    weight_map = json.loads(index.read_text()).get("weight_map") or {}
    shards = [model_dir / name for name in sorted(set(weight_map.values()))]
    if missing := [p.name for p in shards if not p.is_file()]:
        raise ValueError(f"{index} names shards that are missing: {missing[:4]}")
    return shards


def iter_safetensors(model_dir: Path, skip_prefixes: tuple[str, ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) from every shard, one tensor at a time, so peak memory stays ~one model.
    skip_prefixes: names not read at all (a multimodal checkpoint's vision tower, when only its text part runs)."""
    for shard in safetensors_files(model_dir):
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                if not name.startswith(skip_prefixes):
                    yield name, f.get_tensor(name)


def stored_dtype(model_dir: Path) -> torch.dtype | None:
    """config.json's `dtype` (transformers 5) or `torch_dtype`, else the first shard's first floating tensor's;
    None where neither says."""
    config_file = Path(model_dir) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    for key in ("dtype", "torch_dtype"):
        if config.get(key) in _NAMED_DTYPES:
            return _NAMED_DTYPES[config[key]]
    files = safetensors_files(model_dir)
    if not files:
        return None
    with open(files[0], "rb") as fh:  # the header alone: no tensor is read
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    return next((_SAFETENSORS_DTYPES[t["dtype"]] for k, t in header.items()
                 if k != "__metadata__" and t["dtype"] in _SAFETENSORS_DTYPES), None)


def native_cpu_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), not by emulation."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private, hence getattr: absent -> False
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def choose_dtype(stored: torch.dtype | None, device: torch.device, *, from_gguf: bool = False,
                 cuda_bf16: bool = True, cpu_bf16: bool = False) -> tuple[torch.dtype, str]:
    """`dtype: auto` -> (the dtype, why). cuda_bf16 / cpu_bf16: whether the device computes bf16 natively."""
    if from_gguf:
        if device.type == "cuda" and cuda_bf16:
            return torch.bfloat16, "converted from a GGUF (quantized weights): bfloat16 on CUDA"
        return torch.float32, "converted from a GGUF: the quantized-row kernels take fp32"
    name = str(stored).removeprefix("torch.") if stored is not None else "unknown"
    if stored is None or stored == torch.float32:
        return torch.float32, f"the checkpoint is {name}"
    if device.type == "cuda":
        if stored == torch.bfloat16 and not cuda_bf16:
            return torch.float32, "the checkpoint is bfloat16 but this GPU has no native bfloat16"
        return stored, f"the checkpoint is {name}, native on CUDA"
    if stored == torch.bfloat16 and cpu_bf16:
        return stored, "the checkpoint is bfloat16 and the CPU has AVX512-BF16 or AMX"
    why = "has no AVX512-BF16 or AMX (emulated bf16 is slower than fp32)" if stored == torch.bfloat16 else \
        "runs float16 only emulated"
    return torch.float32, f"the checkpoint is {name} but this CPU {why}"


def auto_dtype(model_dir: Path, device: torch.device) -> tuple[torch.dtype, str]:
    """choose_dtype for a checkpoint folder on this machine's device."""
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return choose_dtype(stored_dtype(model_dir), device, from_gguf=(Path(model_dir) / COMPLETE_MARKER).is_file(),
                        cuda_bf16=cuda_bf16, cpu_bf16=device.type == "cpu" and native_cpu_bf16())
