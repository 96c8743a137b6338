"""The shared-memory collectives of tensor-parallel ranks against their twin, gloo: in two spawned ranks, every
all-reduce and all-gather (float32 and bfloat16, many shapes, back to back so both slots are reused) equals gloo's
bit for bit, and a tensor too large for a slot falls back to gloo."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import socket

import torch


def _rank(rank: int, port: int, out: mp.Queue) -> None:
    import torch.distributed as dist

    from pagellm.distributed import shm_comm
    from pagellm.distributed.groups import ParallelState

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
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
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(rank, port, out)) for rank in range(2)]
    for process in ranks:
        process.start()
    results = sorted(out.get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join(30)
    assert results == [(0, [], True), (1, [], True)]
