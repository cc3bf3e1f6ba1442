"""SchedulerOutput -> packed tensors -> model -> sampler. Owns the KV cache tensors."""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from conveyor.serving.attention import AttentionMetadata
from conveyor.serving.cuda_graphs import DecodeGraphs, capture_sizes, graph_unsafe_reason
from conveyor.serving.input_batch import InputBatch
from conveyor.serving.kv_cache_manager import cdiv
from conveyor.serving.logits_processors import edit_logits
from conveyor.serving.outputs import ModelRunnerOutput, SampledToken, ScheduledChunk, SchedulerOutput, StepTimings
from conveyor.serving.request import Request, SamplingParams
from conveyor.serving.sampler import Sampler, argmax, make_generator

logger = logging.getLogger(__name__)


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros, so cache slots no sequence has written are finite (attention may then skip masking them).

    On CPU the memory comes from calloc via numpy: the kernel hands out zero pages lazily, so a large cache costs
    no RSS and no memset until blocks are actually written. Without numpy's MADV_HUGEPAGE on it: where the kernel
    compacts memory for such regions on a fault (THP defrag "madvise", Debian's and Ubuntu's default), the first
    write to each 2 MB cost ~19 ms here, so every prefill into untouched blocks stalled (125 ms of a 256-token
    prefill's 556 ms); 4 KB faults cost ~2 us.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    with _no_numpy_hugepages():
        raw = np.zeros(shape, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize])
    return torch.from_numpy(raw).view(dtype)


@contextmanager
def _no_numpy_hugepages() -> Iterator[None]:
    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed it; its private toggle lives there
    toggle = getattr(core.multiarray, "_set_madvise_hugepage", None)
    if toggle is None:
        yield
        return
    previous = toggle(False)
    try:
        yield
    finally:
        toggle(previous)


class ModelRunner:
    """cuda_graphs: "off"; "capture" (CUDA graphs for pure-decode steps where the device is CUDA and the attention
    backend is graph-safe; otherwise logged and off); "static" (the graph path's padded static buffers run
    eagerly, on any device and backend that reads lengths on the device: for tests and debugging)."""

    def __init__(self, model: torch.nn.Module, num_layers: int, num_kv_heads: int, head_dim: int,
                 num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype, *,
                 attention_backend: str = "torch", max_model_len: int | None = None, max_num_seqs: int = 64,
                 cuda_graphs: str = "off", kv_cache_dtype: torch.dtype | None = None,
                 split_mixed_steps: bool = True) -> None:
        """dtype: the model's; kv_cache_dtype: the KV cache's (None: dtype). The attention backend converts each
        written row to the cache's dtype and reads it back in the query's."""
        if cuda_graphs not in ("off", "capture", "static"):
            raise ValueError(f"cuda_graphs must be 'off', 'capture' or 'static', got {cuda_graphs!r}")
        self.model = model
        self.device = device
        # Mixed steps as two forwards where the model has a C++ decode loop (_forward_split).
        self.split_mixed_steps = split_mixed_steps
        self.block_size = block_size
        self.num_blocks = num_blocks
        if cuda_graphs == "capture":
            reason = graph_unsafe_reason(device, attention_backend)
            if reason is None and max_model_len is None:
                reason = "max_model_len is unknown"
            if reason is None and hasattr(model, "cuda_graph_unsafe_reason"):  # e.g. models/moe.py's
                reason = model.cuda_graph_unsafe_reason(device, dtype)
            if reason is not None:
                logger.info("CUDA graphs off: %s (attention backend %s)", reason, attention_backend)
                cuda_graphs = "off"
        elif cuda_graphs == "static" and max_model_len is None:
            raise ValueError("cuda_graphs='static' needs max_model_len")
        # The graph path's padding rows write and read one scratch block past the last real one: the block
        # manager only knows blocks [0, num_blocks), so no request ever owns it.
        total_blocks = num_blocks + (cuda_graphs != "off")
        shape = (total_blocks, block_size, num_kv_heads, head_dim)
        kv = zeroed_tensor((num_layers, 2, *shape), dtype if kv_cache_dtype is None else kv_cache_dtype, device)
        self.kv_caches = [(kv[layer, 0], kv[layer, 1]) for layer in range(num_layers)]
        self.sampler = Sampler()
        # A row never needs more blocks than the context holds, nor than the cache has.
        max_blocks = min(cdiv(max_model_len, block_size) if max_model_len else num_blocks, num_blocks)
        self.input_batch = InputBatch(max_num_seqs, max_blocks, block_size)
        self._generators: dict[str, torch.Generator] = {}
        # Each live request's last sampled token: under async scheduling the next step may be scheduled, and
        # prepared, before the engine appends it to the request (input_batch.chunk_token_ids).
        self.last_sampled: dict[str, int] = {}
        self.grammar_bitmask = None  # serving.grammar_bitmask.GrammarBitmask, at the first constrained row
        self.decode_graphs: DecodeGraphs | None = None
        if cuda_graphs != "off":
            assert max_model_len is not None
            self.decode_graphs = DecodeGraphs(
                model, self.kv_caches, sizes=capture_sizes(max_num_seqs), max_model_len=max_model_len,
                block_size=block_size, pad_block=num_blocks, device=device, capture=cuda_graphs == "capture")
            self.decode_graphs.capture_all()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        last_sampled = self.last_sampled
        for rid in sched.finished_ids:
            self._generators.pop(rid, None)
            last_sampled.pop(rid, None)
        for rid in sched.preempted_ids:  # recomputed from its request's tokens, which by then hold the last one
            last_sampled.pop(rid, None)
        # Released on every step, graph replays included, so no ended request keeps a row.
        self.input_batch.release(sched.finished_ids)
        self.input_batch.release(sched.preempted_ids)
        if sched.is_empty:
            return ModelRunnerOutput()
        timings = StepTimings()
        start = time.perf_counter()
        requests = [c.request for c in sched.chunks if c.samples]  # the rows that sample, in order
        hidden = self.decode_graphs.run(sched.chunks, last_sampled) if self.decode_graphs is not None else None
        if hidden is not None:  # one row per chunk, in order (graph replay: preparing and running are one)
            logits_indices = (slice(None) if len(requests) == len(sched.chunks) else torch.tensor(
                [i for i, c in enumerate(sched.chunks) if c.samples], dtype=torch.int64).to(self.device))
        elif self.split_mixed_steps and (split := self._split(sched.chunks)) is not None:
            hidden, logits_indices = self._forward_split(sched.chunks, *split, timings), slice(None)
        else:
            input_ids, positions, meta, logits_indices = self._prepare_inputs(sched.chunks)
            timings.prepare_s = time.perf_counter() - start
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if requests:
            logits = self.model.compute_logits(hidden[logits_indices])
        forward_end = time.perf_counter()
        timings.forward_s = forward_end - start - timings.prepare_s
        if not requests:
            return ModelRunnerOutput(timings=timings)
        request_ids = [r.request_id for r in requests]
        if all([r.argmax_only for r in requests]):
            token_ids, with_logprobs = argmax(logits.float()).tolist(), {}
        else:
            token_ids, with_logprobs = self._sample(logits, requests)
        if min(token_ids) < 0:  # NO_TOKEN: a row without a finite logit; the scheduler ends its request
            # A step scheduled meanwhile (async scheduling) may feed it as the next input: give it a real id.
            last_sampled.update((rid, max(t, 0)) for rid, t in zip(request_ids, token_ids, strict=True))
        else:
            last_sampled.update(zip(request_ids, token_ids, strict=True))
        timings.sample_s = time.perf_counter() - forward_end
        return ModelRunnerOutput(dict(zip(request_ids, token_ids, strict=True)),
                                 {request_ids[row]: s for row, s in with_logprobs.items()}, timings)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], dict[int, SampledToken]]:
        """Grammars' masks, logits edits, then the sampler, for a step where some row asks for more than argmax."""
        self._apply_grammars(logits, requests)
        params = [r.sampling_params for r in requests]
        logits, raw_logits = edit_logits(logits, params, [r.prompt_token_ids for r in requests],
                                         [r.output_token_ids for r in requests], [r.eos_token_id for r in requests])
        generators = [None if (seed := r.sampling_params.seed) is None else self._generator_for(r.request_id, seed)
                      for r in requests]
        return self.sampler.sample(logits, params, generators, raw_logits)

    def _apply_grammars(self, logits: torch.Tensor, requests: list[Request]) -> None:
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return
        if self.grammar_bitmask is None:
            from conveyor.serving.grammar_bitmask import GrammarBitmask  # llguidance: only once a grammar runs

            self.grammar_bitmask = GrammarBitmask(logits.shape[-1])
        self.grammar_bitmask.apply(logits, rows, [requests[i].grammar.matcher for i in rows])

    def _generator_for(self, request_id: str, seed: int) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = make_generator(seed, self.device)
        return gen

    def _split(self, chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], list[ScheduledChunk]] | None:
        """(1-token chunks, the rest) of a mixed step whose 1-token rows the C++ decode loop can run; else None."""
        stack = getattr(self.model, "decode_stack", None)
        if stack is None:
            return None
        decodes = [c for c in chunks if c.num_tokens == 1]
        if not decodes or len(decodes) == len(chunks) or len(decodes) > stack.max_rows:
            return None
        return decodes, [c for c in chunks if c.num_tokens != 1]

    def _forward_split(self, chunks: list[ScheduledChunk], decodes: list[ScheduledChunk],
                       prefills: list[ScheduledChunk], timings: StepTimings) -> torch.Tensor:
        """A mixed step as two forwards: its decodes through the C++ decode loop (and the quantized rows), its
        prefill chunks through the module path, where a mixed batch would send every row down the module path
        (RESULTS.md, "Step cost"). Each chunk's attention reads only its own sequence, so the order is free.
        Returns the sampled rows' hidden states in the step's chunk order."""
        parts, sampled = [], []
        for group in (decodes, prefills):
            start = time.perf_counter()
            input_ids, positions, meta, logits_indices = self._prepare_inputs(group)
            timings.prepare_s += time.perf_counter() - start
            parts.append(self.model(input_ids, positions, self.kv_caches, meta)[logits_indices])
            sampled += [c for c in group if c.samples]
        hidden = torch.cat(parts)
        position = {id(c): i for i, c in enumerate(sampled)}
        order = [position[id(c)] for c in chunks if c.samples]
        return hidden if order == sorted(order) else hidden[torch.tensor(order, device=hidden.device)]

    def _prepare_inputs(self, chunks: list[ScheduledChunk]
                        ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        arrays = self.input_batch.prepare(chunks, self.last_sampled)
        dev = self.device

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(dev)

        meta = AttentionMetadata(
            slot_mapping=tensor(arrays.slot_mapping), block_tables=tensor(arrays.block_tables),
            seq_lens=tensor(arrays.seq_lens), query_start_loc=tensor(arrays.query_start_loc),
            max_query_len=max(arrays.query_lens), max_seq_len=max(arrays.seq_lens_list),
            seq_lens_list=arrays.seq_lens_list, query_lens_list=arrays.query_lens, finite_cache=True)
        return (tensor(arrays.token_ids), tensor(arrays.positions), meta, tensor(arrays.logits_indices))


@torch.inference_mode()
def profile_step(model: torch.nn.Module, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, *, num_tokens: int, num_seqs: int,
                 max_model_len: int, kv_cache_dtype: torch.dtype | None = None) -> None:
    """One max-size step (num_tokens tokens over num_seqs sequences, logits and top-p sampling for each) on a
    throwaway cache just big enough, so the caller can measure peak activation memory before sizing the KV cache.
    Sequence 0 carries the bulk as prefill chunks of at most max_model_len; the others are 1-token prompts.
    The throwaway cache has the real one's dtype, kv_cache_dtype (None: dtype, the model's)."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    bulk = num_tokens - (num_seqs - 1)
    lens = [min(max_model_len, bulk - s) for s in range(0, bulk, max_model_len)] + [1] * (num_seqs - 1)
    blocks = [-(-n // block_size) for n in lens]
    kv = torch.zeros((num_layers, 2, sum(blocks), block_size, num_kv_heads, head_dim),
                     dtype=dtype if kv_cache_dtype is None else kv_cache_dtype, device=device)
    kv_caches = [(kv[layer, 0], kv[layer, 1]) for layer in range(num_layers)]
    tables = torch.zeros((len(lens), max(blocks)), dtype=torch.int32)
    first = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    lens_t = torch.tensor(lens, dtype=torch.int64)
    seq_index = torch.repeat_interleave(torch.arange(len(lens)), lens_t)
    query_start_loc = torch.zeros(len(lens) + 1, dtype=torch.int32)
    torch.cumsum(lens_t, 0, out=query_start_loc[1:])
    positions = torch.arange(sum(lens)) - query_start_loc[:-1].long()[seq_index]
    slots = tables.long()[seq_index, positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(
        slot_mapping=slots.to(device), block_tables=tables.to(device), seq_lens=lens_t.int().to(device),
        query_start_loc=query_start_loc.to(device), max_query_len=max(lens), max_seq_len=max(lens),
        seq_lens_list=lens, query_lens_list=lens, finite_cache=True)
    input_ids = torch.zeros(sum(lens), dtype=torch.int64, device=device)
    hidden = model(input_ids, positions.to(device), kv_caches, meta)
    logits = model.compute_logits(hidden[query_start_loc[1:].long().to(device) - 1])
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * len(lens)
    Sampler(seed=0)(logits, params, [None] * len(lens))
