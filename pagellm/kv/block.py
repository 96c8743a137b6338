"""KV blocks and the free list.

``FreeBlockQueue`` is an intrusive doubly linked list of ``KVBlock``s: the links live in the blocks, so removing a
block from the middle (a cached block hit again while free) is O(1). Blocks leave from the head (least recently
freed, evicted first) and freed blocks join at the tail.
"""

from __future__ import annotations

from typing import Iterator, NewType

from pagellm.request import BlockHash

BlockId = NewType("BlockId", int)


class KVBlock:
    """One block of KV slots; ``block_hash`` is set while its full contents are registered in the prefix cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = BlockId(block_id)
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "-"
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, {cached})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks with sentinel head and tail."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        head = self._head
        block = head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free KV blocks left")
        nxt = block.next_free
        assert nxt is not None
        head.next_free, nxt.prev_free = nxt, head  # ``remove(block)``, inlined: a decoding request's every block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVBlock]:
        """Remove and return the first ``n`` blocks (``n`` <= ``num_free_blocks``), linking the list once."""
        assert n <= self.num_free_blocks, f"asked for {n} blocks, only {self.num_free_blocks} free"
        taken = []
        block = self._head.next_free
        for _ in range(n):
            assert block is not None
            taken.append(block)
            block.prev_free, block.next_free, block = None, None, block.next_free
        assert block is not None
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= n
        return taken

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free list"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} is already in the free list"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def extend(self, blocks: list[KVBlock]) -> None:
        """Append ``blocks`` at the tail in order, linking the list once."""
        last = self._tail.prev_free
        assert last is not None
        for block in blocks:
            assert block.prev_free is None and block.next_free is None, f"{block} is already in the free list"
            last.next_free = block
            block.prev_free = last
            last = block
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_free_blocks += len(blocks)

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks
