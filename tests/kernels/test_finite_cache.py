"""finite_cache=True: the torch backend may skip masking unused slots, and must still equal the reference
whenever those slots hold finite values (the engine zero-fills its cache)."""
from __future__ import annotations

import torch

from conveyor.kernels import ops, reference
from conveyor.serving.model_runner import zeroed_tensor


def test_finite_garbage_in_unused_slots_does_not_leak():
    torch.manual_seed(0)
    num_blocks, block_size, kv_heads, heads, dim = 32, 4, 2, 4, 16
    key_cache = torch.randn(num_blocks, block_size, kv_heads, dim)  # finite junk everywhere
    value_cache = torch.randn(num_blocks, block_size, kv_heads, dim) * 100
    seq_lens = [5, 13, 2]
    tables = torch.tensor([[3, 7, 0, 0], [9, 1, 4, 30], [12, 0, 0, 0]], dtype=torch.int32)
    query = torch.randn(3, heads, dim)
    args = (query, key_cache, value_cache, tables, torch.tensor(seq_lens, dtype=torch.int32),
            torch.arange(4, dtype=torch.int32), dim ** -0.5)
    expected = reference.paged_attention(*args)
    out = ops.paged_attention(*args, max_query_len=1, max_seq_len=13, finite_cache=True)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-3)


def test_zeroed_tensor_is_zero_for_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = zeroed_tensor((3, 5), dtype, torch.device("cpu"))
        assert t.dtype == dtype and t.shape == (3, 5) and not t.any()
