"""Per-physical-expert load recorder: tokens per slot per step, over a sliding window of steps.

Letters: T tokens, k experts per token, L layers, R physical slots, W window steps.

`record` runs inside the forward pass. It uses tensor ops only, with shapes fixed by the
call's shapes, so it never synchronises the host and can be captured in a CUDA graph:
padding rows are excluded by comparing row numbers with `num_real_tokens`, a device tensor
the caller sets before each padded step (its address never changes; `end_step` resets it to
"every row", so a value never carries over into the next step). The step's counts go
into a fixed buffer; `end_step`, called between steps outside any graph, moves them into
the window. A dummy step (a warm-up or padding-only batch that every rank must still run)
records nothing: its counts are discarded and the window does not advance.
"""

from __future__ import annotations

from typing import List, Optional

import torch

__all__ = ["LoadRecorder"]

# num_real_tokens before the caller sets it: every row is real.
ALL_ROWS = 2 ** 62


class LoadRecorder:
    """Token counts per physical slot of L layers.

    Args:
        num_layers: L.  num_physical: R.  window_size: W steps kept.
        device: where the counters live (the experts' device).
    Attributes:
        num_real_tokens: [1] int64 device tensor; rows >= its value are padding.
        current: [L, R] int64 counts of the running step.
        window: [L, W, R] int64 counts of the last W real steps.
    """

    def __init__(self, num_layers: int, num_physical: int, window_size: int, device=None) -> None:
        for name, v in (("num_layers", num_layers), ("num_physical", num_physical), ("window_size", window_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.num_layers, self.num_physical, self.window_size = num_layers, num_physical, window_size
        self.num_real_tokens = torch.full((1,), ALL_ROWS, dtype=torch.int64, device=device)
        self.current = torch.zeros(num_layers, num_physical, dtype=torch.int64, device=device)
        self.window = torch.zeros(num_layers, window_size, num_physical, dtype=torch.int64, device=device)
        self._rows_seen: List[int] = [0] * num_layers  # rows already recorded this step, per layer
        self._slot = 0  # window row the next real step goes to

    def set_num_tokens(self, num_tokens) -> None:
        """Rows >= num_tokens of the coming step are padding. An int, or a [1] int tensor (no host sync)."""
        if isinstance(num_tokens, torch.Tensor):
            if num_tokens.numel() != 1 or num_tokens.is_floating_point() or num_tokens.dtype == torch.bool:
                raise ValueError(f"num_tokens as a tensor must be a [1] integer tensor, got "
                                 f"{num_tokens.dtype} {tuple(num_tokens.shape)}")
            self.num_real_tokens.copy_(num_tokens.reshape(1))
        elif isinstance(num_tokens, int) and not isinstance(num_tokens, bool) and num_tokens >= 0:
            self.num_real_tokens.fill_(num_tokens)
        else:
            raise ValueError(f"num_tokens must be an int >= 0 or a [1] integer tensor, got {num_tokens!r}")

    def record(self, layer: int, physical_ids: torch.Tensor) -> None:
        """Count one call's assignments per slot, skipping padding rows.

        Rows are numbered across the calls of one step in call order (a chunked batch is
        several calls), so `num_real_tokens` refers to the whole step's batch.

        Args:
            layer: index in [0, L).
            physical_ids: [T, k] int physical slot ids in [0, R).
        """
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        if physical_ids.dim() != 2:
            raise ValueError(f"physical_ids must be [T, k], got shape {tuple(physical_ids.shape)}")
        T, k = physical_ids.shape
        start = self._rows_seen[layer]
        rows = torch.arange(start, start + T, device=physical_ids.device)  # [T]
        real = (rows < self.num_real_tokens).to(torch.int64)  # [T]
        self.current[layer].scatter_add_(0, physical_ids.reshape(-1).long(), real.unsqueeze(1).expand(T, k).reshape(-1))
        self._rows_seen[layer] = start + T

    def end_step(self, dummy: bool = False) -> None:
        """Close a step: keep its counts in the window (unless dummy), clear the step buffer and
        forget the step's num_tokens (the next step counts every row unless set again)."""
        if not dummy:
            self.window[:, self._slot].copy_(self.current)
            self._slot = (self._slot + 1) % self.window_size
        self.current.zero_()
        self.num_real_tokens.fill_(ALL_ROWS)
        self._rows_seen = [0] * self.num_layers

    def window_load(self) -> torch.Tensor:
        """Tokens per slot over the window: [L, R] int64."""
        return self.window.sum(1)

    def clear(self, layer: Optional[int] = None) -> None:
        """Forget the window of one layer (its slots changed meaning), or of all layers (None)."""
        if layer is None:
            self.window.zero_()
        else:
            self.window[layer].zero_()
