"""CUDA graphs for pure-decode steps (vLLM style): one graph per batch size in a fixed ladder.

A decode step of B sequences (every chunk one query token) replays the graph captured for the smallest size >= B.
Everything the graph reads lives in static device buffers sized for the largest size; each step copies its
inputs into their first rows. The rows past B are padding: token 0 at position 0, writing its K/V into a scratch
block that the block manager never hands out (the runner allocates it past the last real block) and attending to
a 1-token context in that same block, so padding never reads or writes a real block. Padding rows of one step
all write the scratch slot: which row wins does not matter, every value written there is finite.

Nothing host-side may vary per step inside a graph: the metadata carries max_query_len = 1 and
max_seq_len = max_model_len (the bound that sizes the CUDA backend's split-K grid and FlashAttention's splits),
and no python lists. Prefill or mixed steps, and batches above the largest size, run eagerly.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from conveyor.serving.attention import AttentionMetadata
from conveyor.serving.input_batch import chunk_token_ids
from conveyor.serving.outputs import ScheduledChunk

logger = logging.getLogger(__name__)

# Largest captured batch: beyond it a decode step is large enough that launch overhead no longer dominates.
MAX_CAPTURE_SIZE = 512

# Why a backend cannot be captured. The others (triton, cuda, flash) are launch-only on the decode path: grids
# sized by host ints fixed at capture (num_seqs, max_query_len = 1, max_seq_len bound), lengths read on the
# device, negative / scratch slots handled in the write kernel, workspaces allocated inside the capture pool.
UNSAFE_BACKENDS = {
    "torch": "its decode path sizes tensors from host-side seq_lens lists (max(seq_lens_list)) and its cache write"
             " uses boolean-mask indexing (a device sync, data-dependent shapes)",
    "reference": "it loops over sequences in Python reading lengths with int() (a device sync per sequence)",
}


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """[1, 2, 4, 8, 16, 24, ...] (multiples of 8) up to max_num_seqs, which is always included when <= limit."""
    top = min(max_num_seqs, limit)
    sizes = {s for s in [1, 2, 4, *range(8, top + 1, 8)] if s <= top}
    sizes.add(top)
    return sorted(sizes)


def padded_size(sizes: Sequence[int], batch: int) -> int | None:
    """The smallest captured size >= batch, or None when batch is above them all (or empty)."""
    if batch < 1:
        return None
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


def is_pure_decode(chunks: Sequence[ScheduledChunk]) -> bool:
    return bool(chunks) and all(c.num_tokens == 1 for c in chunks)


def graph_unsafe_reason(device: torch.device, backend: str) -> str | None:
    """Why CUDA graphs cannot run here, or None when they can."""
    if device.type != "cuda":
        return f"device is {device.type}, not cuda"
    return UNSAFE_BACKENDS.get(backend)


class DecodeInputs:
    """Host arrays of one padded decode step: ids/positions/slots int64 [3, size], tables int32 [size, cols]."""

    def __init__(self, chunks: Sequence[ScheduledChunk], size: int, block_size: int, pad_block: int,
                 last_sampled: dict[str, int] | None = None) -> None:
        batch = len(chunks)
        if not 1 <= batch <= size:
            raise ValueError(f"batch of {batch} does not fit size {size}")
        self.batch, self.size = batch, size
        self.cols = max(len(c.block_ids) for c in chunks)
        self.longs = np.zeros((3, size), dtype=np.int64)  # token id 0 and position 0 for padding rows
        self.longs[2, :] = pad_block * block_size  # padding rows write the scratch block's first slot
        self.tables = np.full((size, self.cols), pad_block, dtype=np.int32)
        self.seq_lens = np.ones(size, dtype=np.int32)  # padding rows attend to their own 1-token context
        for i, chunk in enumerate(chunks):
            pos = chunk.start
            (token,) = chunk_token_ids(chunk, last_sampled or {})
            self.longs[0, i] = token
            self.longs[1, i] = pos
            self.longs[2, i] = chunk.block_ids[pos // block_size] * block_size + pos % block_size
            self.tables[i, :len(chunk.block_ids)] = chunk.block_ids
            self.seq_lens[i] = pos + 1


class DecodeGraphs:
    """Static buffers, one forward per captured size, and (capture=True, CUDA) one CUDA graph per size.

    With capture=False the same buffers and padding run eagerly: every step still goes through the fixed-size,
    padded, list-free path, which lets CPU tests check all of it except the capture itself.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], *,
                 sizes: Sequence[int], max_model_len: int, block_size: int, pad_block: int,
                 device: torch.device, capture: bool = True) -> None:
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"capture sizes must be ascending and positive, got {sizes}")
        self.model, self.kv_caches = model, kv_caches
        self.sizes = list(sizes)
        self.max_model_len, self.block_size, self.pad_block = max_model_len, block_size, pad_block
        self.max_blocks = -(-max_model_len // block_size)
        self.device, self.capture = device, capture
        top = self.sizes[-1]
        self.longs = torch.zeros((3, top), dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping = self.longs[0], self.longs[1], self.longs[2]
        self.block_tables = torch.full((top, self.max_blocks), pad_block, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)  # one token per row
        self._reset_padding()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0
        self.capture_seconds = 0.0

    def _reset_padding(self) -> None:
        """Every row a padding row: the state warm-up and capture run on (touches only the scratch block)."""
        self.longs[:2].zero_()
        self.slot_mapping.fill_(self.pad_block * self.block_size)
        self.block_tables.fill_(self.pad_block)
        self.seq_lens.fill_(1)

    def metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[:size + 1],
            max_query_len=1, max_seq_len=self.max_model_len, seq_lens_list=None, query_lens_list=None,
            finite_cache=True)

    def forward(self, size: int) -> torch.Tensor:
        """The model over the first `size` rows of the static buffers -> hidden states [size, hidden]."""
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self.metadata(size))

    @torch.inference_mode()
    def capture_all(self, warmup_runs: int = 2) -> None:
        """Warm up then capture every size, largest first, into one shared memory pool (smaller graphs reuse
        the largest one's activations). Call after the KV cache is allocated; touches only the scratch block."""
        if not self.capture:
            return
        start = time.perf_counter()
        self._reset_padding()
        torch.cuda.synchronize(self.device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            for _ in range(warmup_runs):  # compiles Triton variants, settles cuBLAS / allocator state
                self.forward(size)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(size)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d CUDA graphs for decode batch sizes %s in %.2fs", len(self.graphs), self.sizes,
                    self.capture_seconds)

    def prepare(self, chunks: Sequence[ScheduledChunk], last_sampled: dict[str, int] | None = None) -> int | None:
        """Copy a pure-decode step into the static buffers; its padded size, or None when it must run eagerly."""
        if not is_pure_decode(chunks):
            return None
        size = padded_size(self.sizes, len(chunks))
        if size is None:
            return None
        inputs = DecodeInputs(chunks, size, self.block_size, self.pad_block, last_sampled)
        if inputs.cols > self.max_blocks:  # cannot happen below max_model_len; run it eagerly rather than fail
            return None
        self.longs[:, :size].copy_(torch.from_numpy(inputs.longs))
        # Table columns past a row's last block are never read (the kernels stop at seq_len): copy only the
        # columns in use.
        self.block_tables[:size, :inputs.cols].copy_(torch.from_numpy(inputs.tables))
        self.seq_lens[:size].copy_(torch.from_numpy(inputs.seq_lens))
        return size

    def run(self, chunks: Sequence[ScheduledChunk], last_sampled: dict[str, int] | None = None
            ) -> torch.Tensor | None:
        """Hidden states [B, hidden] of a pure-decode step of B <= max size sequences, else None (run eager).
        last_sampled: as InputBatch.prepare's (async scheduling)."""
        size = self.prepare(chunks, last_sampled)
        if size is None:
            return None
        self.num_replays += 1
        if self.capture:
            graph, out = self.graphs[size]
            graph.replay()
        else:
            out = self.forward(size)
        return out[:len(chunks)]
