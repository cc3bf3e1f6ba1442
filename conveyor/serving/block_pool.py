"""KV block ids, reference counts, an LRU free queue and the prefix-cache index. No torch here."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

# Parent hash of a request's first block; any fixed value works since all chains start from it.
ROOT_HASH = 0x5EED


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Chained hash: a block is identified by its tokens and everything before it."""
    return hash((parent_hash, token_ids))


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    # Set once the block is full and registered in the prefix cache; kept after the block is freed, so a
    # later request with the same prefix can reuse it until the block is handed out again.
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Oldest-freed first: evicting cached blocks in LRU order keeps the hottest prefixes alive.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks with {len(self._free)} free: check first")
        out = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks found by a prefix hit (they may be sitting in the free queue)."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; pass blocks tail-first so a prefix's last blocks are evicted first."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block

    def lookup(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self._cached.get(block_hash)
        # Verify on a hit: a hash collision must never serve another prompt's KV.
        if block is None or block.parent_hash != parent_hash or block.token_ids != token_ids:
            return None
        return block

    def register(self, block: KVBlock, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> None:
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already cached; this copy stays private to its request
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self._cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = block.parent_hash = block.token_ids = None

    def is_free(self, block: KVBlock) -> bool:
        return block.block_id in self._free
