"""Model name -> local HF safetensors dir -> our model (models/registry.py picks the class) with weights, config and
tokenizer."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from conveyor.serving.models.base import CausalLM
from conveyor.serving.models.checkpoint import auto_dtype, iter_safetensors
from conveyor.serving.models.hub import SMOLLM2_ALIASES, convert_gguf, gguf_cache_dir, log, pull_model
from conveyor.serving.models.registry import architecture_of, model_class
from conveyor.serving.models.rotary import RotaryEmbedding, longrope_uses_long_factors, original_max_positions
from conveyor.serving.request import SAMPLING_DEFAULT_KEYS, SamplingParams

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _is_hf_dir(path: Path) -> bool:
    return (path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))
            and any((path / f).is_file() for f in _TOKENIZER_FILES))


def resolve_model_path(model: str) -> Path:
    """"smollm2" (alias) -> cached dir (pulled if missing); HF dir -> itself; .gguf file -> converted dir."""
    if model.lower() in SMOLLM2_ALIASES:
        return pull_model(model)
    path = Path(model).expanduser()
    if _is_hf_dir(path):
        return path
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path.resolve(), gguf_cache_dir(path))
    if path.is_dir():
        raise ValueError(f"{path} is not a usable model dir: it needs config.json, *.safetensors and "
                         f"tokenizer files ({', '.join(_TOKENIZER_FILES)})")
    raise ValueError(f"unknown model {model!r}: expected one of {SMOLLM2_ALIASES}, a local HF safetensors "
                     "dir, or a local .gguf file (hub ids are not supported: there is no hub access)")


def resolve_device_dtype(device: str, dtype: str, model: str | None = None) -> tuple[torch.device, torch.dtype]:
    """ModelConfig's device and dtype -> torch's; dtype auto reads the checkpoint of `model` (models/checkpoint.py:
    its dtype where the device computes it natively, float32 otherwise) and logs the choice."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       "cpu" if device == "auto" else device)
    if dtype == "auto":
        if model is None:
            return dev, torch.float32
        chosen, reason = auto_dtype(resolve_model_path(model), dev)
        log(f"dtype auto: {str(chosen).removeprefix('torch.')} ({reason})")
        return dev, chosen
    try:
        return dev, getattr(torch, dtype)
    except AttributeError:
        raise ValueError(f"unknown dtype {dtype!r}") from None


def generation_defaults(model_dir: Path) -> dict[str, float]:
    """The sampling settings a model's generation_config.json recommends (SAMPLING_DEFAULT_KEYS), for
    requests that leave them unset; values SamplingParams would refuse are ignored."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    defaults = {k: config[k] for k in SAMPLING_DEFAULT_KEYS if isinstance(config.get(k), int | float)}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError):
        return {}
    return defaults


def generation_eos_ids(model_dir: Path) -> tuple[int, ...]:
    """The ids generation_config.json ends generation at (`eos_token_id`: one id or a list)."""
    path = Path(model_dir) / "generation_config.json"
    try:
        ids = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    except (OSError, ValueError):
        return ()
    ids = [ids] if isinstance(ids, int) else ids if isinstance(ids, list) else []
    return tuple(dict.fromkeys(t for t in ids if isinstance(t, int) and not isinstance(t, bool) and t >= 0))


def build_model(config, dtype: torch.dtype, device: torch.device, attention_backend: str = "torch",
                max_model_len: int | None = None) -> CausalLM:
    """Allocate an uninitialized model directly in dtype on device (random init of 135M params is waste).
    max_model_len: the context the engine serves, which picks LongRoPE's short or long factors."""
    with torch.device("meta"):
        model = model_class(config)(config, attention_backend=attention_backend)
    _materialize(model, dtype, device)
    for module in model.modules():  # the rope buffers are uninitialized memory (a family may have two tables)
        if isinstance(module, RotaryEmbedding):
            module.reset_tables(max_model_len)
            if module.params["rope_type"] == "longrope":
                long = longrope_uses_long_factors(module.params, config)
                log(f"LongRoPE: {'long' if long else 'short'} factors for a context of "
                    f"{module.params.get('max_model_len') or config.max_position_embeddings} tokens "
                    f"(original {original_max_positions(module.params, config)})")
    return model


def _materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """What `model.to(dtype).to_empty(device)` does here (parameters in dtype, uninitialized), with torch.empty from
    each shape: to_empty runs torch's Python reference of empty_like on meta tensors, which imports sympy (~0.7 s
    of CPU in every engine start). Buffers keep their dtype: the only ones are the rope tables, which
    RotaryEmbedding keeps in float32 through `.to(dtype)`. A tensor shared by two modules stays shared."""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor, as_dtype: torch.dtype) -> torch.Tensor:
        if id(t) not in made:
            made[id(t)] = torch.empty(t.shape, dtype=as_dtype, device=device)
        return made[id(t)]

    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                as_dtype = dtype if param.is_floating_point() else param.dtype
                module._parameters[name] = torch.nn.Parameter(empty(param, as_dtype),
                                                              requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = empty(buffer, buffer.dtype)


def load_tokenizer(path: Path, config: PretrainedConfig | None = None) -> PreTrainedTokenizerBase:
    """The model's tokenizer, as AutoTokenizer picks it, without the model's config class: AutoTokenizer reads only
    `model_type`, `tokenizer_class` and the name of the config, and a plain PreTrainedConfig from config.json carries
    them, where AutoConfig imports the model's config module and with it torch.distributed.tensor and sympy (~2 s of CPU
    in a replica's start on 2 cores). The same class and the same ids result (SmolLM2, tiny Llama and Qwen2).
    config: the model's config where the caller has it already (not read again)."""
    from transformers import AutoTokenizer

    config_file = Path(path) / "config.json"
    if config is None and config_file.is_file():
        config = _plain_config(path, json.loads(config_file.read_text()))
    return AutoTokenizer.from_pretrained(path, config=config)


def _plain_config(path: Path, raw: dict) -> PretrainedConfig:
    """config.json as a plain PreTrainedConfig: no model config module imported, no class defaults added."""
    from transformers import PreTrainedConfig

    config = PreTrainedConfig.from_dict(raw)
    config._name_or_path = str(path)  # as AutoConfig sets it: AutoTokenizer matches a few model ids against it
    return config


# What the engine and the model read from a config, beyond what a plain PreTrainedConfig defines. Where config.json
# has them all (save_pretrained writes every model-specific key), the model's config class adds nothing we use.
_REQUIRED_KEYS = ("model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                  "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")


def read_config(path: Path) -> PretrainedConfig:
    """The model's config from config.json. A plain PreTrainedConfig where the file has every key we read (and the
    rope base): AutoConfig imports the model's config module, and with it torch.distributed.tensor (~1.2 s of CPU
    in every engine start). Otherwise AutoConfig, whose class defaults fill in what the file leaves out.
    A multimodal config (Gemma 3's, with a text_config): its language model's, naming the checkpoint's
    architectures (the registry serves the text part of those it lists)."""
    raw = json.loads((Path(path) / "config.json").read_text())
    if isinstance(raw.get("text_config"), dict):
        from transformers import AutoConfig

        text = AutoConfig.from_pretrained(path).get_text_config()
        text.architectures = raw.get("architectures")
        return text
    # A scaled rope in rope_scaling (configs written before transformers 5: Llama 3.1, Phi-3-128k, Qwen's YaRN)
    # goes to the model's class: a plain config standardizes it before it has max_position_embeddings, and fails.
    if (all(k in raw for k in _REQUIRED_KEYS) and ("rope_theta" in raw or "rope_parameters" in raw)
            and not raw.get("rope_scaling")):
        return _plain_config(path, raw)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def load_model(model: str, dtype: torch.dtype, device: torch.device, attention_backend: str = "torch",
               max_model_len: int | None = None) -> tuple[CausalLM, PretrainedConfig, PreTrainedTokenizerBase]:
    """Resolve, build, stream the weights in; the model is in eval mode with gradients off.
    max_model_len: the served context (--max-model-len; None: the model's own), as build_model takes it."""
    start = time.perf_counter()
    path = resolve_model_path(model)
    config = read_config(path)
    architecture_of(config)  # ValueError listing the supported architectures
    net = build_model(config, dtype, torch.device(device), attention_backend, max_model_len)
    net.load_weights(iter_safetensors(path, net.SKIPPED_PREFIXES))
    net.eval().requires_grad_(False)  # inference only: no autograd bookkeeping
    net.source_dir = path  # where optional extras (a GGUF's quantized blocks) are found
    tokenizer = load_tokenizer(path, config)
    log(f"loaded {path.name} ({config.model_type}, {dtype}, {device}) in {time.perf_counter() - start:.2f}s")
    return net, config, tokenizer
