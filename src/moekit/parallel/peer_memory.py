"""Peer-mapped GPU memory for the p2p dispatcher: one window per rank that every rank of the host writes.

A window is a zeroed uint8 buffer on this rank's GPU plus, on the device, the distance in
16-byte units from it to every rank's window as mapped in this process (`regions` gives
its layout, p2p_kernels.py how kernels use it). Two ways to map the peers, tried in this
order by "auto" (every rank takes the same one: they agree through a collective):

    "symmetric"  torch.distributed._symmetric_memory (empty + rendezvous), which maps the
                 peers' memory into this GPU's address space;
    "ipc"        CUDA IPC handles of a caching-allocator block, opened on this rank's GPU.

Both need every rank of the group on one host, with every GPU of the group visible to
every rank (leave CUDA_VISIBLE_DEVICES alone per rank) and peer access between them
(NVLink or PCIe). Windows are cached per (group, device, size): layers of one model with
the same shapes share one, which is safe because their dispatch + combine pairs do not
interleave (PeerWindow.in_flight guards that). They live until the process exits.

`simulated_windows` builds P windows over tensors of one process, for tests of the kernels
(CPU under TRITON_INTERPRET=1 or one GPU).
"""

from __future__ import annotations

import socket
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["PEER_MEMORY", "MAX_RANKS", "PeerWindow", "regions", "open_window", "strategies_in_use",
           "simulated_windows"]

from .config import PEER_MEMORY

_ALIGN = 16
# Window layout (bytes): flags [P] int32 at 0, counts [P] int32 at 256, then recv and back.
FLAGS_OFFSET, COUNTS_OFFSET, DATA_OFFSET = 0, 256, 512
MAX_RANKS = 64  # P int32 flags (counts) fit the 256 bytes before the next region


def regions(num_ranks: int, capacity: int, layout) -> Tuple[int, int, int]:
    """(recv offset, back offset, window bytes) for P ranks, C rows a block and rows of `layout`
    (recv: [P*C, row_bytes] rows; back: [P*C, H] fp32 partials; block q of each for source q)."""
    n = num_ranks * capacity
    back = DATA_OFFSET + n * layout.row_bytes  # row_bytes is a multiple of 16
    return DATA_OFFSET, back, back + n * layout.hidden_size * 4


@dataclass
class PeerWindow:
    """This rank's window and where the others' are (see the module docstring).

    Fields:
        words: [nbytes / 4] int32 view of this rank's window.
        deltas: [P] int64 on the window's device: (window of r - this window) / 16 bytes.
        epoch, status: [1] int32 on the device (barrier epoch; 1 after a barrier timed out).
        rank, size: this rank and P.
        strategy: how the peers were mapped ("symmetric", "ipc" or "simulated").
        timeout_s: how long a barrier waits for a peer (GPU); spin_limit: polls (interpreter).
        in_flight: a dispatch has written peers' windows and its combine has not run yet.
    """

    words: torch.Tensor
    deltas: torch.Tensor
    epoch: torch.Tensor
    status: torch.Tensor
    rank: int
    size: int
    strategy: str
    timeout_s: float = 60.0
    spin_limit: int = 10_000
    in_flight: bool = False
    keepalive: List[object] = field(default_factory=list, repr=False)

    @property
    def nbytes(self) -> int:
        return self.words.numel() * 4

    def bytes(self) -> torch.Tensor:
        """The window as [nbytes] uint8."""
        return self.words.view(torch.uint8)

    def check_health(self) -> None:
        """Raise if a barrier gave up waiting for a peer (reads one int from the device)."""
        if int(self.status.item()):
            raise RuntimeError(
                f"p2p_all_to_all: rank {self.rank} waited more than timeout_s={self.timeout_s} s for a peer in a "
                "barrier; the ranks no longer run the same dispatch/combine sequence, so the results since are "
                "invalid")


def _window(buf: torch.Tensor, ptrs: List[int], rank: int, strategy: str, keepalive, timeout_s: float) -> PeerWindow:
    me = ptrs[rank]
    if any((p - me) % _ALIGN for p in ptrs):
        raise RuntimeError(f"peer windows are not {_ALIGN}-byte aligned: {[hex(p) for p in ptrs]}")
    device = buf.device
    deltas = torch.tensor([(p - me) // _ALIGN for p in ptrs], dtype=torch.int64, device=device)
    return PeerWindow(buf.view(torch.int32), deltas, torch.zeros(1, dtype=torch.int32, device=device),
                      torch.zeros(1, dtype=torch.int32, device=device), rank, len(ptrs), strategy,
                      timeout_s=timeout_s, keepalive=keepalive)


def _allocate(strategy: str, nbytes: int, device: torch.device):
    """Step 1 (local): a zeroed buffer, and what step 2 needs."""
    if strategy == "symmetric":
        import torch.distributed._symmetric_memory as symm_mem  # noqa: PLC0415

        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        buf.zero_()
        return buf, None
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    share = list(buf.untyped_storage()._share_cuda_())
    share[7] = False  # no IPC event to wait on: the buffer is zeroed and synchronised before anyone maps it
    return buf, share


def _map(strategy: str, buf: torch.Tensor, share, group, rank: int, size: int) -> Tuple[List[int], list]:
    """Step 2 (collective): every rank's window as an address in this process."""
    if strategy == "symmetric":
        import torch.distributed._symmetric_memory as symm_mem  # noqa: PLC0415

        group = group if group is not None else dist.group.WORLD
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        with warnings.catch_warnings():  # needed before torch 2.8, deprecated (a no-op) after
            warnings.simplefilter("ignore")
            if enable is not None and not symm_mem.is_symm_mem_enabled_for_group(group.group_name):
                enable(group.group_name)
        handle = symm_mem.rendezvous(buf, group)
        return [int(p) for p in handle.buffer_ptrs], [handle]
    shares: List[Optional[list]] = [None] * size
    dist.all_gather_object(shares, share, group=group)
    ptrs, keep = [], []
    for r, s in enumerate(shares):
        if r == rank:
            ptrs.append(buf.data_ptr())
            continue
        # open the peer's block on THIS rank's GPU: the mapping lands in its address space, with peer access
        storage = torch.UntypedStorage._new_shared_cuda(buf.device.index, *s[1:])
        keep.append(storage)
        ptrs.append(storage.data_ptr())
    return ptrs, keep


def _agree(ok: bool, why: str, group, size: int) -> str:
    """Every rank's verdict on one step: "" when all succeeded, else the reasons of those that failed."""
    verdicts: List[Optional[tuple]] = [None] * size
    dist.all_gather_object(verdicts, (ok, why), group=group)
    return "; ".join(f"rank {r}: {v[1]}" for r, v in enumerate(verdicts) if not v[0])


def _try(step, *args):
    try:
        return step(*args), ""
    except Exception as exc:  # noqa: BLE001 (reported on every rank through _agree)
        return None, f"{type(exc).__name__}: {exc}"[:300]


# (id of the group, rank, size, device, bytes, strategy) -> (weak reference to the group, window):
# a group destroyed and replaced can leave its id to the new one, whose window is its own.
_WINDOWS: Dict[tuple, Tuple[weakref.ref, PeerWindow]] = {}


def open_window(nbytes: int, group, rank: int, size: int, device: torch.device, strategy: str = "auto",
                timeout_s: float = 60.0) -> PeerWindow:
    """This rank's window of `nbytes` bytes over `group` (a collective: every rank calls it alike).

    Raises ValueError, the same on every rank, when the ranks are not on one host or not on
    CUDA, and RuntimeError when no strategy could map the peers (with each one's reason).
    """
    if strategy not in PEER_MEMORY:
        raise ValueError(f"peer_memory must be one of {list(PEER_MEMORY)}, got {strategy!r}")
    # the default group is a new object each time the process group is re-initialised
    g = group if group is not None else dist.group.WORLD
    key = (id(g), rank, size, str(device), nbytes, strategy)
    hit = _WINDOWS.get(key)
    if hit is not None and hit[0]() is g:
        return hit[1]
    if device.type != "cuda":
        raise ValueError(f"p2p_all_to_all maps peers' GPU memory, so it needs CUDA tensors, got {device}")
    here = (socket.gethostname(), torch.cuda.device_count())
    hosts: List[Optional[tuple]] = [None] * size
    dist.all_gather_object(hosts, here, group=group)
    if len({h[0] for h in hosts}) != 1:
        raise ValueError(f"p2p_all_to_all needs every rank on one host, got hosts {[h[0] for h in hosts]}; "
                         "use the 'all_to_all' or 'static_all_to_all' dispatcher across hosts")
    nbytes = -(-nbytes // _ALIGN) * _ALIGN
    errors = {}
    for name in (("symmetric", "ipc") if strategy == "auto" else (strategy,)):
        made, why = _try(_allocate, name, nbytes, device)
        if made is not None:
            torch.cuda.synchronize(device)
        failed = _agree(made is not None, why, group, size)
        if not failed:
            mapped, why = _try(_map, name, made[0], made[1], group, rank, size)
            failed = _agree(mapped is not None, why, group, size)
        if not failed:
            dist.barrier(group=group)  # every window is zeroed before any rank writes one
            win = _window(made[0], mapped[0], rank, name, mapped[1], timeout_s)
            _WINDOWS[key] = (weakref.ref(g), win)
            return win
        errors[name] = failed
    raise RuntimeError("p2p_all_to_all could not map the peers' memory: "
                       + " | ".join(f"{k}: {v}" for k, v in errors.items()))


def strategies_in_use() -> List[str]:
    """How the windows this process opened map their peers ("symmetric", "ipc")."""
    return sorted({w.strategy for _, w in _WINDOWS.values()})


def simulated_windows(num_ranks: int, nbytes: int, device="cpu", spin_limit: int = 10_000) -> List[PeerWindow]:
    """num_ranks windows in this process, each seeing the others as peers (kernel tests)."""
    nbytes = -(-nbytes // _ALIGN) * _ALIGN
    bufs = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(num_ranks)]
    ptrs = [b.data_ptr() for b in bufs]
    wins = [_window(b, ptrs, r, "simulated", [bufs], 60.0) for r, b in enumerate(bufs)]
    for w in wins:
        w.spin_limit = spin_limit
    return wins
