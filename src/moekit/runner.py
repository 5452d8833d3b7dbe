"""MoERunner: route -> (EPLB map) -> dispatch -> experts -> combine -> shared experts -> scale.

The runner owns the order of the steps, the shared-expert policy, the output scaling and
chunking; the layer (FusedMoE) owns the parameters.

Chunking: tokens are processed MOEKIT_CHUNK_SIZE (default 16384) at a time, so the
backends' workspace is bounded by about chunk * k * (3I + 2H) * 4 bytes (sorted inputs,
GEMM1 output, activation, per-assignment outputs in fp32), independent of T.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .config import ActivationParams, RoutingConfig, settings
from .experts.api import experts_forward
from .experts.base import ExpertWeights
from .parallel.base import Dispatcher, LocalDispatcher
from .routing import TopK, route

__all__ = ["MoERunner"]


class MoERunner:
    """Runs one MoE layer's steps in order (see module docstring)."""

    def __init__(
        self,
        routing: RoutingConfig,
        *,
        activation: str,
        activation_params: Optional[ActivationParams],
        backend: str,
        shared_mode: Optional[str],
        name: str,
        dispatcher: Optional[Dispatcher] = None,
        chunk_size: Optional[int] = None,
    ) -> None:
        self.routing = routing
        self.activation = activation
        self.activation_params = activation_params
        self.backend = backend
        self.shared_mode = shared_mode
        self.name = name
        self.dispatcher = dispatcher or LocalDispatcher()
        self.chunk_size = chunk_size or settings.chunk_size
        self.eplb = None  # EPLB hook: map_ids(ids [T, k]) -> physical ids (moekit.eplb.EplbLayerHook)
        self.last_topk: Optional[TopK] = None  # the last chunk's routing (for inspection)

    def output_scale(self) -> float:
        r = self.routing
        return r.routed_scaling_factor if r.scale_on == "output" else 1.0

    def forward(self, layer, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], router_logits [T, E] -> [T, H] in x's dtype."""
        # Under expert parallelism every rank must make the same number of rounds (each is a
        # collective), so the dispatcher decides, up front or round by round (Dispatcher);
        # ranks with fewer tokens run empty chunks.
        c = self.chunk_size
        if self.dispatcher.rounds_in_dispatch:
            outs, lo, again = [], 0, True
            while again:
                out, again = self._forward_chunk(layer, x[lo:lo + c], router_logits[lo:lo + c],
                                                 more=lo + c < x.shape[0])
                outs.append(out)
                lo += c
            return outs[0] if len(outs) == 1 else torch.cat(outs)
        n = self.dispatcher.num_chunks(x, c)
        if n == 1:
            return self._forward_chunk(layer, x, router_logits)[0]
        return torch.cat([self._forward_chunk(layer, x[i * c:(i + 1) * c], router_logits[i * c:(i + 1) * c])[0]
                          for i in range(n)])

    def _forward_chunk(self, layer, x: torch.Tensor, router_logits: torch.Tensor,
                       more: Optional[bool] = None) -> Tuple[torch.Tensor, bool]:
        """One round: (output [T, H] in x's dtype, whether any rank has another round).
        more: this rank has tokens after these (dispatchers with rounds_in_dispatch only)."""
        try:
            topk = route(router_logits, self.routing, layer.correction_bias_or_none(), hidden_states=x)
            weights_Tk, ids_Tk = topk
            if self.eplb is not None:
                ids_Tk = self.eplb.map_ids(ids_Tk)
        except Exception:
            self.dispatcher.refuse(x)  # under expert parallelism: the other ranks raise too, none waits
            raise
        self.last_topk = topk
        shared = layer.shared
        shared_out = None
        stream = None
        if shared is not None and self.shared_mode == "separate":
            shared_out = shared(x)  # [T, H] fp32
        elif shared is not None and self.shared_mode == "overlap":
            if x.device.type == "cuda":
                stream = layer.side_stream()
                stream.wait_stream(torch.cuda.current_stream(x.device))
                with torch.cuda.stream(stream):
                    shared_out = shared(x)
                # Used on the main stream below: keep the allocator from recycling it early.
                shared_out.record_stream(torch.cuda.current_stream(x.device))
            else:
                shared_out = shared(x)
        expert_weights = layer.experts.expert_weights()
        if shared is not None and self.shared_mode == "fused":
            expert_weights, weights_Tk, ids_Tk = self._append_fused_shared(layer, x, expert_weights, weights_Tk, ids_Tk)
        d = (self.dispatcher.dispatch(x, weights_Tk, ids_Tk) if more is None else
             self.dispatcher.dispatch(x, weights_Tk, ids_Tk, more=more))
        s = self.output_scale()
        # Nothing is added to the routed output here: let the backend write x's dtype directly.
        direct_out = shared_out is None and s == 1.0 and isinstance(self.dispatcher, LocalDispatcher)
        y = experts_forward(
            d.x, expert_weights, d.topk_weights, d.topk_ids, activation=self.activation,
            activation_params=self.activation_params,
            apply_router_weight_on_input=self.routing.apply_router_weight_on_input,
            expert_map=d.expert_map, backend=self.backend, owner=self.name,
            out_dtype=x.dtype if direct_out else torch.float32,
        )
        routed = self.dispatcher.combine(y, d)  # [T, H] fp32 (x's dtype when direct_out)
        if s != 1.0:
            routed = routed * s
        if stream is not None:
            torch.cuda.current_stream(x.device).wait_stream(stream)
        out = routed if shared_out is None else routed + shared_out  # fp32: no fp16 overflow
        return out.to(x.dtype), d.more_rounds

    def _append_fused_shared(self, layer, x, weights: ExpertWeights, w_Tk, ids_Tk):
        """Add the shared MLP as n always-selected experts E..E+n-1 to the routing."""
        if self.routing.apply_router_weight_on_input:
            raise ValueError("shared_experts mode 'fused' cannot be combined with apply_router_weight_on_input")
        fused = layer.fused_expert_weights()  # cached: routed experts then n shared slices
        E = weights.num_experts
        n = fused.num_experts - E
        T = x.shape[0]
        # The shared output must come out of the final scale s unchanged: weight 1/s.
        w_shared = x.new_full((T, n), 1.0 / self.output_scale(), dtype=torch.float32)
        g = layer.shared.gate_values(x)  # [T, 1] or None
        if g is not None:
            w_shared = w_shared * g
        ids_shared = torch.arange(E, E + n, device=x.device, dtype=torch.int32).expand(T, n)
        return fused, torch.cat((w_Tk, w_shared), 1), torch.cat((ids_Tk, ids_shared), 1)
