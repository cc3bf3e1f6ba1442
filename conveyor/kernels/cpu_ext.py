"""JIT build and Python wrappers of the CPU kernels in csrc/cpu/ (paged decode attention, KV-cache write;
the fused norm and rope ops of cpu_fused.py, the GGUF-block linear of gguf.py, the grammar bitmask of
token_bitmask.py, the sampler's sample_rows and the MoE experts of models/moe.py register from the same library).

Built with torch.utils.cpp_extension.load into a per-machine cache dir (-march=native is safe there), the first
time a process asks for it; later processes reuse the build unless the sources or flags change. Needs a C++
compiler and ninja: the `ninja` PyPI package provides one when the system has none.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import sys
import sysconfig
from collections.abc import Iterator
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_CSRC = pathlib.Path(__file__).parent / "csrc" / "cpu"
SOURCES = [_CSRC / "paged_attention_cpu.cpp", _CSRC / "prefill_attention_cpu.cpp", _CSRC / "fused_ops_cpu.cpp",
           _CSRC / "gguf_linear_cpu.cpp", _CSRC / "gguf_rows_cpu.cpp", _CSRC / "gguf_bf16_cpu.cpp",
           _CSRC / "gguf_int8_cpu.cpp", _CSRC / "gguf_int8_avx2_cpu.cpp",
           _CSRC / "token_bitmask_cpu.cpp", _CSRC / "sampling_cpu.cpp",
           _CSRC / "decode_stack_cpu.cpp", _CSRC / "moe_experts_cpu.cpp"]
# torch's SIMD levels the kernels are compiled with vectors for (at::vec::Vectorized, see _flags); below them
# the portable loops run.
VEC_CAPABILITIES = ("AVX512", "AVX2")


def build_dir() -> pathlib.Path:
    """CONVEYOR_CPU_BUILD_DIR, else ~/.cache/conveyor/cpu_ext/<digest>: one folder per content of the sources,
    headers and flags and per torch install (version and path), so every checkout with the same sources and venv
    shares one build (~2 min on 2 cores otherwise). The torch path counts because build.ninja holds its include
    folders: two venvs sharing one folder rebuilt each other's build at every switch. The sources are compiled from
    copies in the folder (_stage_sources): torch rebuilds when the source paths differ, so two clones compiling their
    own files would rebuild each other's."""
    default = pathlib.Path.home() / ".cache" / "conveyor" / "cpu_ext" / _digest()
    return pathlib.Path(os.environ.get("CONVEYOR_CPU_BUILD_DIR", default))


def _inputs() -> list[pathlib.Path]:
    return sorted({*SOURCES, *_CSRC.glob("*.h")})


def _torch_dir() -> str:
    return os.path.dirname(torch.__file__)


def _digest() -> str:
    digest = hashlib.sha1(torch.__version__.encode() + b"\0" + _torch_dir().encode())
    for path in _inputs():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update("\0".join(_flags()).encode())
    return digest.hexdigest()[:12]


def _stage_sources(directory: pathlib.Path) -> list[pathlib.Path]:
    """Copy the sources and headers into directory/src (a file already there with the same bytes stays untouched,
    so its mtime does not make ninja rebuild); returns the sources' copies, in SOURCES order. Compiler messages
    name these copies: edit the checkout's files, the next build stages them again."""
    staged = directory / "src"
    staged.mkdir(parents=True, exist_ok=True)
    for path in _inputs():
        target = staged / path.name
        data = path.read_bytes()
        if not target.exists() or target.read_bytes() != data:
            target.write_bytes(data)
    return [staged / s.name for s in SOURCES]


def _ninja_on_path() -> bool:
    """Make a pip-installed ninja visible to cpp_extension (its script sits next to python, which an
    un-activated venv does not put on PATH)."""
    if shutil.which("ninja"):
        return True
    try:
        import ninja

        candidates = [ninja.BIN_DIR]
    except ImportError:
        candidates = []
    candidates += [os.path.dirname(sys.executable), sysconfig.get_path("scripts")]
    for directory in candidates:
        if shutil.which("ninja", path=directory):
            os.environ["PATH"] = directory + os.pathsep + os.environ.get("PATH", "")
            return True
    return False


def unavailable_reason() -> str | None:
    """Why the extension cannot be built here, or None when it may be (the build itself can still fail)."""
    if os.environ.get("CONVEYOR_DISABLE_CPU_EXT") == "1":
        return "disabled by CONVEYOR_DISABLE_CPU_EXT=1"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not on PATH)"
    if not _ninja_on_path():
        return "ninja not found (pip install ninja)"
    return None


def _flags() -> list[str]:
    flags = ["-O3", "-fopenmp"]  # the C++ standard is left to cpp_extension (what torch's headers need)
    if sys.platform == "linux" and os.uname().machine in ("x86_64", "AMD64"):
        flags.append("-march=native")
    # ATen's Vectorized picks its SIMD width from CPU_CAPABILITY macros that only ATen's own build sets; match
    # torch's runtime choice so the kernel gets real AVX-512/AVX2 vectors rather than the portable fallback.
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in VEC_CAPABILITIES:
        flags += [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    # torch rebuilds when the sources or flags change, not when a header they include does: fold the headers in.
    headers = hashlib.sha1(b"".join(h.read_bytes() for h in sorted(_CSRC.glob("*.h")))).hexdigest()[:12]
    flags.append(f"-DCONVEYOR_CPU_HEADERS={headers}")
    return flags


@contextlib.contextmanager
def build_lock(directory: pathlib.Path) -> Iterator[None]:
    """Held around torch's build and load. torch's own lock (cpp_extension's FileBaton, `lock` in the build
    folder) is a file that only its holder deletes: a build killed midway (Ctrl-C while the first replica
    compiles, a replica replaced during its start) leaves it behind, and every later process then waits on it
    forever, even for a finished build. This lock is an flock, which the kernel releases when its holder dies,
    and every process that builds here takes it first: so a baton its holder finds is stale, and goes."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's lock alone, as before
        yield
        return
    with open(directory / "build.flock", "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        baton = directory / "lock"
        if baton.exists():
            logger.warning("removing %s, left by a build that was killed midway", baton)
            baton.unlink(missing_ok=True)
        yield


@functools.cache
def _build() -> ModuleType | str:
    """The built module, or why it could not be built (cached too: a failed build is not retried per call)."""
    reason = unavailable_reason()
    if reason is not None:
        return reason
    from torch.utils import cpp_extension

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        # -fopenmp makes at::parallel_for's OpenMP region real; the loader resolves libgomp to the copy torch
        # already loaded, so the kernel runs on torch's own thread pool.
        with build_lock(directory):
            return cpp_extension.load(
                name="conveyor_cpu_kernels",
                sources=[str(s) for s in _stage_sources(directory)],
                extra_cflags=_flags(),
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                verbose=os.environ.get("CONVEYOR_CPU_VERBOSE") == "1",
            )
    except (RuntimeError, OSError, ImportError) as exc:  # compiler errors surface as RuntimeError
        return f"Error building extension: {exc}"


def load() -> ModuleType:
    """Build (first call, cached on disk) and import the extension; RuntimeError where that is impossible."""
    built = _build()
    if isinstance(built, str):
        raise RuntimeError(f"conveyor CPU kernels unavailable: {built}")
    return built


def is_available() -> bool:
    """Whether the extension builds and loads here (builds it on first call)."""
    try:
        load()
    except RuntimeError:
        return False
    return True


def has_op(name: str) -> bool:
    """Whether the extension builds and loads here and registers torch.ops.conveyor_cpu.<name>."""
    return is_available() and hasattr(torch.ops.conveyor_cpu, name)


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 out: torch.Tensor | None = None, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> torch.Tensor:
    """Decode attention, one query token per sequence: query [B, H, D] -> [B, H, D] in query's dtype.

    Table entries past a sequence's last block, or before the block of its window's first position, are never
    read. Tables and lengths are cast to contiguous int32 (free when they already are). Options as
    reference.paged_attention's.
    """
    query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)
    load().paged_decode(out, query, key_cache, value_cache, block_tables.to(torch.int32).contiguous(),
                        seq_lens.to(torch.int32).contiguous(), float(scale), sliding_window or 0,
                        float(logits_soft_cap or 0.0))
    return out


def paged_prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, query_starts: torch.Tensor,
                  query_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                  sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
    """Causal attention of packed prefill chunks: chunk i is query rows [query_starts[i], + query_lens[i]),
    ending at position seq_lens[i] - 1 of its sequence; K/V come from the paged caches. query [T, H, D] ->
    [T, H, D]; rows outside every chunk are left as they are in `out`.
    """
    query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)
    load()
    as_int = [t.to(torch.int32).contiguous() for t in (block_tables, seq_lens, query_starts, query_lens)]
    torch.ops.conveyor_cpu.paged_prefill(out, query, key_cache, value_cache, *as_int, float(scale),
                                         sliding_window or 0, float(logits_soft_cap or 0.0))
    return out


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of float32 logits [N, V]: temperature (> 0), min_p, top-k (V: none), then top-p on the
    top-k renormalized distribution, drawn by inverse CDF at uniforms[i] in [0, 1). int64 [N]."""
    load()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return torch.ops.conveyor_cpu.sample_rows(logits, temperature.float().contiguous(), top_k.long().contiguous(),
                                              top_p.float().contiguous(), min_p.float().contiguous(),
                                              uniforms.float().contiguous())


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache[slot // block_size, slot % block_size] = key/value rows [T, KVH, D]; slot < 0 skips the token.

    Rows may be strided (views of a fused qkv projection); anything else is copied to that layout first.
    """
    key, value = _row_layout(key), _row_layout(value)
    load().write_kv_cache(key, value, key_cache, value_cache, slot_mapping.to(torch.long).contiguous())


def _row_layout(t: torch.Tensor) -> torch.Tensor:
    """t [T, KVH, D] with each token's [KVH, D] contiguous, the layout the kernel copies rows from."""
    if t.dim() == 3 and t.stride(2) == 1 and (t.stride(1) == t.shape[2] or t.shape[1] == 1):
        return t
    return t.contiguous()


def main() -> int:
    """`python -m conveyor.kernels.cpu_ext`: build now (set-up does this, so the first request doesn't wait for
    the compiler). Exit 0 either way: without the extension the engine runs the torch backend."""
    reason = unavailable_reason()
    if reason is None:
        built = _build()
        reason = built if isinstance(built, str) else None
    if reason is None:
        print(f"conveyor CPU kernels ready in {build_dir()}")
    else:
        print(f"conveyor CPU kernels unavailable ({reason}); the engine will use the torch backend")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
