"""Generation groups: a failed rendezvous must not shift this process's group naming.

Regression: torch names a default group after a per-process counter that only
destroy_process_group() resets. A join that failed half-way (a peer died during the
rendezvous) advanced the counter, so every later generation this process joined waited on
rendezvous keys that no other member wrote, and recovery failed generation after generation.
"""

import socket

import pytest
import torch.distributed as dist

from moekit.elastic.groups import join_generation, leave_generation


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_failed_join_leaves_the_group_counter_at_zero():
    store = dist.TCPStore("127.0.0.1", _free_port(), is_master=True, wait_for_workers=False)
    with pytest.raises(Exception):
        # rank 0 of 2: the peer never comes, so the rendezvous times out
        join_generation(store, generation=0, rank=0, world_size=2, timeout_s=0.5)
    assert not dist.is_initialized()
    assert dist.distributed_c10d._world.group_count == 0
    # a later generation of one member still forms, under the name every member uses
    join_generation(store, generation=1, rank=0, world_size=1, timeout_s=5)
    try:
        assert dist.get_world_size() == 1
    finally:
        leave_generation()
