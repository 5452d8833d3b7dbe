"""Check at construction that every rank built the same layer (a small fingerprint exchange).

Ranks that disagree on E, k, H, I, the group size or the dispatcher would otherwise meet
in collectives of different sizes and hang or compute garbage. Each rank encodes its
fields as FINGERPRINT_LEN int64 values (strings as CRC32), all-gathers them, and raises
ValueError naming every field that differs. The exchange is bounded: a rank that never
joins (it failed earlier, or runs other code) makes the others raise TimeoutError after
timeout_s instead of waiting forever.
"""

from __future__ import annotations

import time
import zlib
from typing import Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .ep_common import all_gather_single

__all__ = ["check_consistent", "FINGERPRINT_LEN"]

FINGERPRINT_LEN = 32
_POLL_S = 0.002


def _encode(name: str, value: Union[int, str, bool, None]) -> int:
    if value is None:
        return -1
    if isinstance(value, (bool, int)):
        return int(value)
    if isinstance(value, str):
        return zlib.crc32(value.encode())
    raise TypeError(f"fingerprint field {name} must be an int, str, bool or None, got {type(value).__name__}")


def check_consistent(
    fields: Sequence[Tuple[str, Union[int, str, bool, None]]],
    group,
    device: torch.device,
    timeout_s: float,
    what: str = "FusedMoE",
) -> None:
    """All-gather `fields` over `group` and raise if any rank differs.

    Args:
        fields: (name, value) pairs, the same names in the same order on every rank.
        group: the process group (None: the world group).
        device: where the exchange tensor lives (CUDA for NCCL groups).
        timeout_s: how long to wait for every rank to join.
    Raises:
        ValueError naming each differing field; TimeoutError when a rank does not join.
    """
    if len(fields) > FINGERPRINT_LEN:
        raise ValueError(f"at most {FINGERPRINT_LEN} fingerprint fields, got {len(fields)}")
    values = [_encode(n, v) for n, v in fields] + [0] * (FINGERPRINT_LEN - len(fields))
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)  # [F]
    every = torch.empty(P * FINGERPRINT_LEN, dtype=torch.int64, device=device)  # [P*F]
    work = all_gather_single(every, mine, group=group, async_op=True)
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{what}: rank {rank} waited {timeout_s:g} s for the {P} ranks of its group to exchange "
                "the layer configuration; some rank did not build this layer (it failed earlier or runs other code)"
            )
        time.sleep(_POLL_S)
    work.wait()
    table = every.view(P, FINGERPRINT_LEN).cpu().tolist()
    problems = []
    for i, (name, value) in enumerate(fields):
        column = [row[i] for row in table]
        if len(set(column)) > 1:
            if isinstance(value, str):
                problems.append(f"{name} differs (rank {rank} has {value!r})")
            else:
                problems.append(f"{name}: " + ", ".join(f"rank {r} = {v}" for r, v in enumerate(column)))
    if problems:
        raise ValueError(f"{what} configuration differs across the {P} ranks of its group: " + "; ".join(problems))
