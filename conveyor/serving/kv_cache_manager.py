"""Per-request block tables on top of the block pool. No torch here.

Sliding window: where every layer of the model attends only the last `sliding_window` positions, a running
request's blocks wholly before (num_computed_tokens - sliding_window) go back to the pool as its next tokens are
allocated; the attention kernels never read a block before the window. Its table keeps FREED in their place (and its
id list the old ids, which no kernel reads), so positions still index the table. A freed block keeps its prefix-cache
hash until the pool hands it out again: a later request hits a prefix only while every block of it is still
cached, as for any freed block.
"""
from __future__ import annotations

from conveyor.serving.block_pool import ROOT_HASH, BlockPool, KVBlock, hash_block
from conveyor.serving.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# The table entry of a block freed for having left the window: no block of the pool.
FREED = KVBlock(-1)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
        self.block_size = block_size
        # The window every layer shares (None: some layer attends the whole context, so no block is ever freed).
        self.sliding_window = sliding_window
        self._num_freed: dict[str, int] = {}  # leading table entries freed for having left the window
        self.num_window_freed_blocks = 0
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[KVBlock]] = {}
        # The same tables as block ids, kept in step with block_tables: a decode step hands its request's list
        # to the runner without rebuilding it.
        self._block_ids: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}
        # Chained hashes of each live request's full blocks; tokens never change, so they survive preemption.
        self._hashes: dict[str, list[int]] = {}
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def max_tokens_ever(self) -> int:
        return self.pool.num_blocks * self.block_size

    def block_ids(self, request_id: str) -> list[int]:
        return list(self._block_ids.get(request_id, ()))

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        hashes = self._hashes.setdefault(request.request_id, [])
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            tokens = tuple(request.token_slice(i * self.block_size, (i + 1) * self.block_size))
            hashes.append(hash_block(hashes[-1] if hashes else ROOT_HASH, tokens))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of full blocks, leaving at least one token to compute (for its logits)."""
        hits = self._cached_prefix(request)
        self.num_prefix_queries += request.num_tokens
        self.num_prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def _cached_prefix(self, request: Request) -> list[KVBlock]:
        if not self.enable_prefix_caching:
            return []
        num_full = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, num_full)
        hits: list[KVBlock] = []
        parent = ROOT_HASH
        for i, block_hash in enumerate(hashes[:num_full]):
            tokens = tuple(request.token_slice(i * self.block_size, (i + 1) * self.block_size))
            block = self.pool.lookup(block_hash, parent, tokens)
            if block is None:
                break
            hits.append(block)
            parent = block_hash
        return hits

    def _num_blocks_short(self, request: Request, num_new_tokens: int, computed: list[KVBlock]) -> int:
        held = self.block_tables.get(request.request_id, [])
        num_tokens = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(held) - len(computed)
        # Cached blocks found by a prefix hit that sit in the free queue leave it when we take them.
        num_taken_from_free = sum(1 for b in computed if b.ref_count == 0)
        return num_new_blocks - (self.pool.num_free_blocks - num_taken_from_free)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None) -> list[int] | None:
        """Check, then commit: room for num_new_tokens more tokens, or None with nothing changed. Returns the
        request's block ids: a live list that later allocations extend (read it within the step). With a sliding
        window, first frees the request's blocks that have left it."""
        if self.sliding_window is not None:
            self._free_out_of_window(request)
        if not new_computed_blocks:  # a decode within its last block (block_size - 1 steps in block_size)
            ids = self._block_ids.get(request.request_id)
            if ids is not None and request.num_computed_tokens + num_new_tokens <= len(ids) * self.block_size:
                return ids
        computed = new_computed_blocks or []
        if self._num_blocks_short(request, num_new_tokens, computed) > 0:
            return None
        table = self.block_tables.setdefault(request.request_id, [])
        ids = self._block_ids.setdefault(request.request_id, [])
        if computed:
            self.pool.touch(computed)
            self._extend(table, ids, computed)
            self._num_registered[request.request_id] = len(table)
        num_tokens = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(table)
        if num_new_blocks > 0:
            self._extend(table, ids, self.pool.allocate(num_new_blocks))
        return ids

    def _free_out_of_window(self, request: Request) -> None:
        """Return the blocks wholly before (num_computed_tokens - sliding_window) to the pool. The next token sits
        at num_computed_tokens and sees positions from num_computed_tokens - sliding_window + 1 on."""
        table = self.block_tables.get(request.request_id)
        if not table:
            return
        num_dead = min(len(table), (request.num_computed_tokens - self.sliding_window) // self.block_size)
        start = self._num_freed.get(request.request_id, 0)
        if num_dead <= start:
            return
        dead = table[start:num_dead]
        table[start:num_dead] = [FREED] * (num_dead - start)
        self.pool.free(reversed(dead))  # tail-first, as free(): a prefix's first blocks stay cached longest
        self._num_freed[request.request_id] = num_dead
        self.num_window_freed_blocks += num_dead - start

    @staticmethod
    def _extend(table: list[KVBlock], ids: list[int], blocks: list[KVBlock]) -> None:
        table.extend(blocks)
        ids.extend(b.block_id for b in blocks)

    def cache_full_blocks(self, request: Request) -> None:
        """Register the blocks that became full with computed tokens, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        start = self._num_registered.get(request.request_id, 0)
        # Async scheduling counts the tokens of a step in flight as computed before their ids are known.
        num_known = min(request.num_computed_tokens, request.num_tokens)
        if num_known // self.block_size <= start:  # no block filled up since the last call
            return
        table = self.block_tables.get(request.request_id)
        if not table:
            return
        num_full = min(num_known // self.block_size, len(table))
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            if table[i] is FREED:  # left the window before its tokens were known (async scheduling)
                continue
            parent = hashes[i - 1] if i else ROOT_HASH
            tokens = tuple(request.token_slice(i * self.block_size, (i + 1) * self.block_size))
            self.pool.register(table[i], hashes[i], parent, tokens)
        self._num_registered[request.request_id] = num_full

    def free(self, request: Request, forget_hashes: bool = True) -> None:
        table = self.block_tables.pop(request.request_id, [])
        self._block_ids.pop(request.request_id, None)
        start = self._num_freed.pop(request.request_id, 0)
        self.pool.free(reversed(table[start:]))
        self._num_registered.pop(request.request_id, None)
        if forget_hashes:
            self._hashes.pop(request.request_id, None)

    def check_invariants(self, live_request_ids: set[str]) -> None:
        """Every block free xor owned; ref counts equal the number of tables holding the block; a cached block
        holds a whole block of token ids."""
        owners: dict[int, int] = {}
        for rid, table in self.block_tables.items():
            if rid not in live_request_ids:
                raise AssertionError(f"request {rid} holds blocks but is not live")
            num_freed = self._num_freed.get(rid, 0)
            if any(b is FREED for b in table[num_freed:]) or any(b is not FREED for b in table[:num_freed]):
                raise AssertionError(f"request {rid}: freed entries are not exactly the first {num_freed}")
            for block in table[num_freed:]:
                owners[block.block_id] = owners.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            expected = owners.get(block.block_id, 0)
            if block.ref_count != expected:
                raise AssertionError(f"block {block.block_id}: ref_count {block.ref_count} != owners {expected}")
            if (expected == 0) != self.pool.is_free(block):
                raise AssertionError(f"block {block.block_id}: free={self.pool.is_free(block)} owners={expected}")
            if block.token_ids is not None and len(block.token_ids) != self.block_size:
                raise AssertionError(f"block {block.block_id} is cached with {len(block.token_ids)} token ids")
