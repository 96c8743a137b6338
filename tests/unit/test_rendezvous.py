"""Where tensor-parallel ranks meet: rank 0's rendezvous store listens on its port from the moment it is chosen,
so no other process (another engine, a Ray worker, another test) can bind that port before the ranks arrive."""

from __future__ import annotations

import errno
import socket

import pytest
import torch.distributed as dist

from pagellm.executor.ranks import open_store, store_address


def test_the_rendezvous_port_is_held_before_any_rank_hears_of_it() -> None:
    store = open_store(2)
    host, port = store_address(store).rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    with socket.socket() as sock, pytest.raises(OSError) as taken:
        sock.bind((host, int(port)))
    assert taken.value.errno == errno.EADDRINUSE
    store.set("seen", "by rank 0")
    rank_1 = dist.TCPStore(host, int(port), world_size=2, is_master=False)  # as join_group reaches it
    assert rank_1.get("seen") == b"by rank 0"
