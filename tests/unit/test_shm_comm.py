"""The shared-memory collectives of tensor-parallel ranks against their twin, gloo: in two spawned ranks, every
all-reduce and all-gather (float32 and bfloat16, many shapes, back to back so both slots are reused) equals gloo's
bit for bit, and a tensor too large for a slot falls back to gloo; a rank that dies makes the other's next
collective raise instead of spinning forever."""

from __future__ import annotations

import multiprocessing as mp

import torch

from pagellm.executor.ranks import open_store, store_address


def _rank(rank: int, address: str, out: mp.Queue) -> None:
    import torch.distributed as dist

    from pagellm.distributed import shm_comm
    from pagellm.distributed.groups import ParallelState
    from pagellm.executor.ranks import join_group

    join_group(rank, 2, address)  # both through the store the test holds
    comm = shm_comm.ShmComm.create(rank, 2)
    fast, plain = ParallelState(rank, 2, comm), ParallelState(rank, 2)
    gen = torch.Generator().manual_seed(rank)
    mismatches = []
    for step in range(40):
        dtype = torch.bfloat16 if step % 2 else torch.float32
        shape = (1 + step % 5, 16 + 8 * step)
        x = torch.randn(shape, generator=gen).to(dtype)
        if not torch.equal(fast.all_reduce(x.clone()), plain.all_reduce(x.clone())):
            mismatches.append(f"all_reduce {step}")
        if not torch.equal(fast.all_gather_last_dim(x), plain.all_gather_last_dim(x)):
            mismatches.append(f"all_gather {step}")
    big = torch.ones(shm_comm.SLOT_BYTES // 4 + 1)  # one float32 more than a slot holds
    fell_back = comm.all_reduce(big.clone()) is None and torch.equal(fast.all_reduce(big.clone()), big * 2)
    comm.close()
    dist.destroy_process_group()
    out.put((rank, mismatches, fell_back))


def test_shared_memory_collectives_equal_gloos() -> None:
    store = open_store(2)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(rank, store_address(store), out)) for rank in range(2)]
    for process in ranks:
        process.start()
    results = sorted(out.get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join(30)
    assert results == [(0, [], True), (1, [], True)]


def _rank_that_dies(rank: int, address: str, out: mp.Queue) -> None:
    import os

    from pagellm.distributed import shm_comm
    from pagellm.executor.ranks import join_group

    join_group(rank, 2, address)  # both through the store the test holds
    comm = shm_comm.ShmComm.create(rank, 2)
    comm.all_reduce(torch.ones(8))  # one collective that completes
    if rank == 1:
        os._exit(3)  # dies between steps, as a killed rank does
    try:
        comm.all_reduce(torch.ones(8))
        out.put("completed")
    except RuntimeError as exc:
        out.put(str(exc))


def test_a_dead_peer_makes_the_collective_raise() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = open_store(2)
    ranks = [ctx.Process(target=_rank_that_dies, args=(rank, store_address(store), out)) for rank in range(2)]
    for process in ranks:
        process.start()
    message = out.get(timeout=120)  # rank 1 is not reaped meanwhile: the check must see a zombie's death too
    for process in ranks:
        process.join(30)
    assert ranks[1].exitcode == 3
    assert message.startswith(f"tensor-parallel rank 1 (pid {ranks[1].pid}) is gone"), message
