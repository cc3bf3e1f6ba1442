"""The token bitmask of a step's constrained rows, applied to their logits before sampling.

Only constrained rows are touched: the mask is filled for them alone (llguidance computes all of a step's
masks in its own threads, without the GIL) and applied to their logits alone (conveyor/kernels/token_bitmask.py), so an
unconstrained neighbour's logits and tokens are exactly what they would be without structured outputs in the batch.
"""
from __future__ import annotations

import time
from typing import Any

import llguidance
import torch

from conveyor.kernels.token_bitmask import BITS, apply_token_bitmask


class GrammarBitmask:
    def __init__(self, vocab_size: int, max_rows: int = 64) -> None:
        self._words = (vocab_size + BITS - 1) // BITS
        self._bitmask = torch.full((max_rows, self._words), -1, dtype=torch.int32)
        self._executor = llguidance.LLExecutor()
        self.num_rows_masked = 0
        self.total_s = 0.0  # filling and applying the masks
        self.fill_s = 0.0  # of which filling (the grammar library)

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
        """Set logits[rows[i], t] = -inf for every token t matchers[i] does not allow next (in place)."""
        start = time.perf_counter()
        if len(rows) > self._bitmask.shape[0]:
            self._bitmask = torch.full((len(rows), self._words), -1, dtype=torch.int32)
        bitmask = self._bitmask[:len(rows)]
        # What llguidance.torch.fill_next_token_bitmask_par does; that module is not imported because it applies
        # torch.compile at import, which loads TorchDynamo (~2 s, paid inside the first constrained step).
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                               self._words * 4, len(rows))
        self.fill_s += time.perf_counter() - start
        apply_token_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.int64))
        self.num_rows_masked += len(rows)
        self.total_s += time.perf_counter() - start
