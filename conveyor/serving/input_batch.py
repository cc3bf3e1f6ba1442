"""The persistent batch: each running request keeps a row of block ids across steps (vLLM's InputBatch).

A step's inputs are then an update, not a rebuild: a decode adds a block id to its row once every block_size
tokens, and the step's positions, slot mapping and block table come from numpy over these rows instead of
Python lists of every request's whole table. Rows are released when a request finishes or is preempted (a
preempted request is recomputed into a new table, so it starts a new row). No torch here: the runner wraps the
arrays.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from conveyor.serving.outputs import ScheduledChunk


def chunk_token_ids(chunk: ScheduledChunk, last_sampled: dict[str, int]) -> list[int]:
    """The chunk's input token ids. Under async scheduling a decode may be scheduled before the token it feeds
    is appended to its request (the step before samples it while this one is scheduled): that one comes from
    last_sampled, the runner's record of the tokens it sampled last. It is the same id whichever is read."""
    request = chunk.request
    ids = request.token_slice(chunk.start, chunk.start + chunk.num_tokens)
    if len(ids) < chunk.num_tokens:
        ids.append(last_sampled[request.request_id])
    return ids


@dataclass
class StepArrays:
    """One step's flat inputs (numpy, host), in chunk order."""

    token_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    block_tables: np.ndarray  # int32 [num_chunks, max blocks among them]
    seq_lens: np.ndarray  # int32 [num_chunks]
    query_start_loc: np.ndarray  # int32 [num_chunks + 1]
    logits_indices: np.ndarray  # int64 [num sampling chunks]
    query_lens: list[int]
    seq_lens_list: list[int]


class InputBatch:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_table = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = [0] * max_num_seqs  # blocks held per row: a list, numpy scalars are slow to read
        self.rows: dict[str, int] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    def release(self, request_ids: list[str]) -> None:
        """Finished or preempted requests give their rows back."""
        for rid in request_ids:
            row = self.rows.pop(rid, None)
            if row is not None:
                self.num_blocks[row] = 0
                self._free_rows.append(row)

    def _row_for(self, chunk: ScheduledChunk) -> int:
        rid = chunk.request.request_id
        row = self.rows.get(rid)
        if row is None:
            if not self._free_rows:
                self._grow()
            row = self.rows[rid] = self._free_rows.pop()
        num_ids = len(chunk.block_ids)
        held = self.num_blocks[row]
        if num_ids != held:  # tables only grow while a request holds its row
            if num_ids > self.block_table.shape[1]:
                raise ValueError(f"request {rid} has {num_ids} blocks; rows hold {self.block_table.shape[1]}")
            self.block_table[row, held:num_ids] = chunk.block_ids[held:num_ids]
            self.num_blocks[row] = num_ids
        return row

    def _grow(self) -> None:
        """More live requests than rows (a scheduler that runs past max_num_seqs): double rather than fail."""
        old = self.block_table.shape[0]
        self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
        self.num_blocks += [0] * old
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    def prepare(self, chunks: list[ScheduledChunk], last_sampled: dict[str, int] | None = None) -> StepArrays:
        last_sampled = last_sampled or {}
        rows_of, held = self.rows, self.num_blocks
        rows, starts, query_lens, token_ids = [], [], [], []
        max_blocks = 0
        # One pass over the chunks with nothing but list appends in the common case (a decode whose row holds its
        # table): at batch 256 this loop is most of a step's input preparation.
        for chunk in chunks:
            request = chunk.request
            num_ids = len(chunk.block_ids)
            row = rows_of.get(request.request_id)
            if row is None or held[row] != num_ids:
                row = self._row_for(chunk)
            rows.append(row)
            if num_ids > max_blocks:
                max_blocks = num_ids
            start, num = chunk.start, chunk.num_tokens
            starts.append(start)
            query_lens.append(num)
            output_index = start - len(request.prompt_token_ids)
            if num == 1 and 0 <= output_index < len(request.output_token_ids):
                token_ids.append(request.output_token_ids[output_index])  # a decode whose input is appended
            else:
                token_ids.extend(chunk_token_ids(chunk, last_sampled))
        num_chunks, num_tokens = len(chunks), len(token_ids)
        rows_np = np.array(rows, dtype=np.int64)
        starts_np = np.array(starts, dtype=np.int64)
        query_lens_np = np.array(query_lens, dtype=np.int64)
        seq_lens = (starts_np + query_lens_np).astype(np.int32)
        query_start_loc = np.zeros(num_chunks + 1, dtype=np.int32)
        np.cumsum(query_lens_np, out=query_start_loc[1:])
        if num_tokens == num_chunks:  # all decodes (or 1-token chunks): one token per row
            positions, token_rows = starts_np, rows_np
        else:
            seq_index = np.repeat(np.arange(num_chunks), query_lens_np)
            positions = starts_np[seq_index] + (np.arange(num_tokens) - query_start_loc[:-1][seq_index])
            token_rows = rows_np[seq_index]
        block_of_token = self.block_table[token_rows, positions // self.block_size].astype(np.int64)
        sampling = [i for i, chunk in enumerate(chunks) if chunk.samples]
        last_rows = query_start_loc[1:].astype(np.int64) - 1
        return StepArrays(
            token_ids=np.array(token_ids, dtype=np.int64), positions=positions,
            slot_mapping=block_of_token * self.block_size + positions % self.block_size,
            block_tables=self.block_table[rows_np, :max_blocks], seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            logits_indices=last_rows if len(sampling) == num_chunks else last_rows[sampling],
            query_lens=query_lens, seq_lens_list=seq_lens.tolist())

    def check_invariants(self, block_ids_of: dict[str, list[int]], pending_release: set[str] = frozenset()) -> None:
        """Every row belongs to a request given here (or one that ended and is released with the next step) and
        holds exactly its block ids; no row is both held and free."""
        if stray := set(self.rows) - set(block_ids_of) - set(pending_release):
            raise AssertionError(f"rows held by requests not live: {sorted(stray)}")
        for rid, row in self.rows.items():
            if rid not in block_ids_of:
                continue
            ids = block_ids_of[rid]
            held = int(self.num_blocks[row])
            if self.block_table[row, :held].tolist() != ids[:held] or held > len(ids):
                raise AssertionError(f"row of {rid} holds {self.block_table[row, :held].tolist()}, table {ids}")
        if len(set(self.rows.values())) != len(self.rows) or set(self.rows.values()) & set(self._free_rows):
            raise AssertionError("a row is both held and free, or held twice")
