"""SchedulerOutput -> packed tensors -> model -> sampler. Owns the KV cache tensors."""
from __future__ import annotations

import numpy as np
import torch

from conveyor.serving.attention import AttentionMetadata
from conveyor.serving.outputs import ModelRunnerOutput, SchedulerOutput
from conveyor.serving.sampler import Sampler, make_generator


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros, so cache slots no sequence has written are finite (attention may then skip masking them).

    On CPU the memory comes from calloc via numpy: the kernel hands out zero pages lazily, so a large cache costs
    no RSS and no memset until blocks are actually written.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(shape, dtype={2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize])
    return torch.from_numpy(raw).view(dtype)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_layers: int, num_kv_heads: int, head_dim: int,
                 num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        kv = zeroed_tensor((num_layers, 2, *shape), dtype, device)
        self.kv_caches = [(kv[layer, 0], kv[layer, 1]) for layer in range(num_layers)]
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for rid in sched.finished_ids:
            self._generators.pop(rid, None)
        if sched.is_empty:
            return ModelRunnerOutput()
        input_ids, positions, meta, logits_indices = self._prepare_inputs(sched)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        sampling_chunks = [c for c in sched.chunks if c.samples]
        if not sampling_chunks:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[logits_indices])
        params = [c.request.sampling_params for c in sampling_chunks]
        generators = [self._generator_for(c.request.request_id, c.request.sampling_params.seed)
                      for c in sampling_chunks]
        sampled = self.sampler(logits, params, generators)
        return ModelRunnerOutput({c.request.request_id: s for c, s in zip(sampling_chunks, sampled, strict=True)})

    def _generator_for(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = make_generator(seed, self.device)
        return gen

    def _prepare_inputs(self, sched: SchedulerOutput
                        ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        chunks = sched.chunks
        token_ids: list[int] = []
        query_lens, seq_lens, starts, logits_indices = [], [], [], []
        for chunk in chunks:
            token_ids.extend(chunk.request.token_slice(chunk.start, chunk.end))
            query_lens.append(chunk.num_tokens)
            seq_lens.append(chunk.end)
            starts.append(chunk.start)
            if chunk.samples:
                logits_indices.append(len(token_ids) - 1)
        max_blocks = max(len(c.block_ids) for c in chunks)
        tables = [c.block_ids + [0] * (max_blocks - len(c.block_ids)) for c in chunks]
        block_tables = torch.tensor(tables, dtype=torch.int32)
        query_lens_t = torch.tensor(query_lens, dtype=torch.int64)
        seq_index = torch.repeat_interleave(torch.arange(len(chunks)), query_lens_t)
        query_start_loc = torch.zeros(len(chunks) + 1, dtype=torch.int32)
        torch.cumsum(query_lens_t, 0, out=query_start_loc[1:])
        # Position of each packed token: its chunk's start plus its offset inside the chunk.
        offsets = torch.arange(len(token_ids)) - query_start_loc[:-1].long()[seq_index]
        positions = torch.tensor(starts, dtype=torch.int64)[seq_index] + offsets
        block_of_token = block_tables.long()[seq_index, positions // self.block_size]
        slot_mapping = block_of_token * self.block_size + positions % self.block_size
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev), block_tables=block_tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev), query_start_loc=query_start_loc.to(dev),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            seq_lens_list=seq_lens, query_lens_list=query_lens, finite_cache=True)
        input_ids = torch.tensor(token_ids, dtype=torch.int64).to(dev)
        return input_ids, positions.to(dev), meta, torch.tensor(logits_indices, dtype=torch.int64).to(dev)
