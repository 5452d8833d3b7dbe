"""FusedMoE: the nn.Module a model uses. A thin coordinator over router, experts and runner."""

from __future__ import annotations

import itertools
from typing import Optional

import torch
import torch.nn as nn

from .activations import check_activation, is_gated
from .checks import check_float_tensor, copy_biases
from .config import ActivationParams, RoutingConfig, SharedExpertsConfig, _int_field
from .experts.base import ExpertWeights, held_weights, version_of
from .graphs import EagerGraphs
from .parallel.config import ParallelConfig
from .runner import MoERunner
from .shared_experts import SharedMLP, fused_shared_weights

__all__ = ["FusedMoE", "RoutedExperts"]

_layer_ids = itertools.count()
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class RoutedExperts(nn.Module):
    """Holds the routed experts' weights in the canonical layout.

    Parameters: w13 [E, 2I, H] (or [E, I, H] non-gated), w2 [E, H, I], optional b13, b2.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str,
                 bias: bool, dtype: Optional[torch.dtype], device) -> None:
        super().__init__()
        E, H, I = num_experts, hidden_size, intermediate_size
        rows = 2 * I if is_gated(activation) else I
        kw = dict(dtype=dtype, device=device)
        self.w13 = nn.Parameter(torch.empty(E, rows, H, **kw))
        self.w2 = nn.Parameter(torch.empty(E, H, I, **kw))
        self.b13 = nn.Parameter(torch.zeros(E, rows, **kw)) if bias else None
        self.b2 = nn.Parameter(torch.zeros(E, H, **kw)) if bias else None
        nn.init.normal_(self.w13, std=H ** -0.5)
        nn.init.normal_(self.w2, std=I ** -0.5)

    def expert_weights(self) -> ExpertWeights:
        """The held tensors as an ExpertWeights (no copy; one object while the tensors are the same)."""
        tensors = (self.w13, self.w2, self.b13, self.b2)
        return held_weights(self, tensors, lambda: ExpertWeights(*tensors))

    @torch.no_grad()
    def load_weights(self, w13, w2, b13=None, b2=None) -> None:
        """Copy canonical-layout tensors in (shapes checked, dtype converted)."""
        check_float_tensor("w13", w13, self.w13.shape)
        check_float_tensor("w2", w2, self.w2.shape)
        copy_biases(self, b13, b2)
        self.w13.copy_(w13)
        self.w2.copy_(w2)


class FusedMoE(nn.Module):
    """A Mixture-of-Experts layer: router -> routed experts (+ shared experts) -> [.., H].

    Args:
        num_experts: E routed experts.  hidden_size: H.  intermediate_size: I per expert.
        routing: RoutingConfig (validated against E here, not in forward).
        activation: see moekit.activations.ACTIVATIONS.
        bias: experts carry biases b13 [E, 2I] and b2 [E, H] (gpt-oss).
        shared_experts: SharedExpertsConfig or None.
        dtype, device: of the parameters.
        backend: "auto" (the oracle picks per call) or a backend name.
        quant: quantization scheme name or moekit.quant.QuantScheme (see moekit.quant), or None.
            Weights are stored quantized; load_weights quantizes a float checkpoint,
            load_quantized takes a pre-quantized one.
        activation_params: ActivationParams for swigluoai, swiglu_limit and swiglustep.
        gate: own a router gate Linear(H, E) used when forward gets no router_logits.
        gate_bias: the gate has a bias (gpt-oss).
        router_dtype: dtype the gate runs in (None: x's dtype; DeepSeek-V3 uses float32).
        correction_bias: own an e_score_correction_bias [E] fp32 buffer (DeepSeek-V3; it stays fp32
            through .half() or .to(dtype)).
        name: its layer_name, used in logs; defaults to "moe<N>".
        parallel: ParallelConfig splitting the layer over a process group (expert or tensor
            parallelism); the layer then holds only this rank's experts (or I-slices), keeps
            `expert_map` [E] int32, and every rank checks at construction that all ranks built
            the same layer. Shared experts run once per token on the token's own rank; mode
            "fused" is refused (its extra experts would need a place in the expert placement).
        eager_graphs: eager CUDA calls of up to this many token counts replay CUDA graphs of
            the routed step (moekit.graphs: no autograd, and a dispatcher without host syncs);
            0 (default) launches the kernels on every call.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        routing: RoutingConfig,
        *,
        activation: str = "silu",
        bias: bool = False,
        shared_experts: Optional[SharedExpertsConfig] = None,
        dtype: Optional[torch.dtype] = None,
        device=None,
        backend: str = "auto",
        quant=None,
        activation_params: Optional[ActivationParams] = None,
        gate: bool = False,
        gate_bias: bool = False,
        router_dtype: Optional[torch.dtype] = None,
        correction_bias: bool = False,
        name: Optional[str] = None,
        parallel: Optional[ParallelConfig] = None,
        eager_graphs: int = 0,
    ) -> None:
        super().__init__()
        num_experts, hidden_size, intermediate_size = (  # Python or numpy integers, as RoutingConfig takes them
            _int_field(arg, v) for arg, v in (("num_experts", num_experts), ("hidden_size", hidden_size),
                                              ("intermediate_size", intermediate_size)))
        if not isinstance(routing, RoutingConfig):
            raise TypeError(f"routing must be a RoutingConfig, got {type(routing).__name__}")
        routing.validate_for(num_experts)
        check_activation(activation)
        for arg, v in (("bias", bias), ("gate", gate), ("gate_bias", gate_bias), ("correction_bias", correction_bias)):
            if not isinstance(v, bool):
                raise TypeError(f"{arg} must be a bool, got {v!r}")
        if gate_bias and not gate:
            raise ValueError("gate_bias=True needs gate=True (the bias belongs to the layer's own gate)")
        for arg, v in (("dtype", dtype), ("router_dtype", router_dtype)):
            if v is not None and v not in _FLOAT_DTYPES:
                raise TypeError(f"{arg} must be None or one of {[str(d) for d in _FLOAT_DTYPES]}, got {v!r}")
        if activation_params is not None and not isinstance(activation_params, ActivationParams):
            raise TypeError(f"activation_params must be an ActivationParams or None, got {type(activation_params).__name__}")
        if shared_experts is not None and not isinstance(shared_experts, SharedExpertsConfig):
            raise TypeError(f"shared_experts must be a SharedExpertsConfig or None, got {type(shared_experts).__name__}")
        if shared_experts is not None and shared_experts.mode == "fused" and routing.apply_router_weight_on_input:
            raise ValueError("shared_experts mode 'fused' cannot be combined with routing.apply_router_weight_on_input "
                             "(a weight on the input allows one expert per token; the fused shared experts would add more); "
                             "use mode 'separate' or 'overlap'")
        if backend != "auto":
            from .experts.base import get_backend  # noqa: PLC0415

            get_backend(backend)  # unknown names fail here, not in forward
        if quant is not None:
            from .quant import get_scheme  # noqa: PLC0415

            quant = get_scheme(quant)  # unknown names fail here; a QuantScheme carries group size / zero points
            if shared_experts is not None and shared_experts.mode == "fused":
                raise ValueError(f"shared_experts mode 'fused' cannot ride in quantized experts (quant={quant.name!r}): "
                                 "the shared MLP stays float; use mode 'separate' or 'overlap'")
        if correction_bias and (routing.order != "score_then_topk" or routing.custom is not None):
            raise ValueError("correction_bias needs routing.order='score_then_topk' without a custom router")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.routing = routing
        self.activation = activation
        self.quant = None if quant is None else quant.name
        self.router_dtype = router_dtype
        self.layer_name = name or f"moe{next(_layer_ids)}"
        self.shard = None
        self._split_dtype = None  # split over ranks: the activation dtype every rank sends (checked per call)
        dispatcher = None
        if parallel is not None:
            self.shard, dispatcher = self._split(parallel, routing, activation, bias, shared_experts, dtype, device,
                                                 quant, activation_params)
            if parallel.size > 1:
                self._split_dtype = dtype or torch.get_default_dtype()
        E_l, I_l = (num_experts, intermediate_size) if self.shard is None else (
            self.shard.local_experts, self.shard.local_intermediate)
        if quant is None:
            self.experts = RoutedExperts(E_l, hidden_size, I_l, activation, bias, dtype, device)
        else:  # quantized storage, quantized on load_weights (moekit.quant.module)
            from .quant.module import QuantizedRoutedExperts  # noqa: PLC0415

            self.experts = QuantizedRoutedExperts(E_l, hidden_size, I_l, activation, bias, quant, dtype, device)
        emap = None if self.shard is None or self.shard.expert_map is None else self.shard.expert_map.to(device)
        self.register_buffer("expert_map", emap, persistent=False)
        self.shared = None
        if shared_experts is not None:
            self.shared = SharedMLP(hidden_size, shared_experts, activation, dtype=dtype, device=device,
                                    activation_params=activation_params)
            if shared_experts.mode == "fused":
                if (self.shared.activation != activation) or shared_experts.intermediate_size % intermediate_size:
                    raise ValueError(
                        "shared_experts mode 'fused' needs the routed activation and a shared intermediate_size "
                        f"that is a multiple of {intermediate_size}, got activation={self.shared.activation!r}, "
                        f"intermediate_size={shared_experts.intermediate_size}"
                    )
        self.gate = nn.Linear(hidden_size, num_experts, bias=gate_bias, dtype=dtype, device=device) if gate else None
        if correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32, device=device))
        else:
            self.e_score_correction_bias = None
        self.runner = MoERunner(
            routing, activation=activation, activation_params=activation_params, backend=backend,
            shared_mode=None if shared_experts is None else shared_experts.mode, name=self.layer_name,
            dispatcher=dispatcher,
        )
        self._fused_cache = None
        self._side_stream = None
        self._graphs = EagerGraphs(eager_graphs)
        if backend != "auto":
            self._check_backend(backend, activation, bias, dtype or torch.get_default_dtype())

    def _check_backend(self, backend: str, activation: str, bias: bool, dtype: torch.dtype) -> None:
        """Refuse an explicit backend that no device or dtype would let serve this layer."""
        from .experts.base import ExpertsProblem, get_backend  # noqa: PLC0415
        from .oracle import refusal_anywhere  # noqa: PLC0415

        w13 = self.experts.w13
        problem = ExpertsProblem(
            w13.device.type, dtype, w13.dtype, activation, bias, self.expert_map is not None,
            self.routing.apply_router_weight_on_input, w13.shape[0], self.hidden_size, self.experts.w2.shape[-1],
            self.routing.top_k, quant=self.quant)
        reason = refusal_anywhere(get_backend(backend), problem)
        if reason is not None:
            what = problem.describe().split(" ", 2)[2]  # without device and dtype: every one was tried
            raise ValueError(f"backend={backend!r} can never run this layer ({what}) on any device or dtype: {reason}")

    def _routed(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self.runner.forward(self, x, router_logits)

    def _graph_storage(self) -> tuple:
        """What a captured step reads besides its inputs: tensors' addresses, dispatcher, backend, EPLB hook."""
        r = self.runner
        # Mode "fused" reads a concatenated copy of the weights: in-place writes must drop the graphs.
        fused = self._fused_key() if r.shared_mode == "fused" and self.shared is not None else None
        return (tuple(t.data_ptr() for t in self.parameters()), tuple(t.data_ptr() for t in self.buffers()),
                id(r.dispatcher), r.backend, id(r.eplb), r.shared_mode, fused)

    def _split(self, parallel, routing, activation, bias, shared_experts, dtype, device, quant, activation_params):
        """Check the parallel config (on every rank, against every rank) -> (Shard, Dispatcher)."""
        from .parallel.consistency import check_consistent  # noqa: PLC0415
        from .parallel.registry import build_dispatcher  # noqa: PLC0415
        from .parallel.shard import fingerprint_fields, make_shard  # noqa: PLC0415

        if not isinstance(parallel, ParallelConfig):
            raise TypeError(f"parallel must be a ParallelConfig or None, got {type(parallel).__name__}")
        if parallel.size > 1:
            fields = fingerprint_fields(
                parallel, num_experts=self.num_experts, hidden_size=self.hidden_size,
                intermediate_size=self.intermediate_size, routing=routing, activation=activation, bias=bias,
                dtype=dtype, shared=shared_experts, quant=quant, activation_params=activation_params)
            check_consistent(fields, parallel.group, torch.device(device or "cpu"), parallel.timeout_s)
            parallel.check_group()
            if shared_experts is not None and shared_experts.mode == "fused":
                raise ValueError(
                    "shared_experts mode 'fused' cannot be split over ranks (parallel.size > 1); "
                    "use mode 'separate' or 'overlap' (computed once per token on its own rank)"
                )
        shard = make_shard(parallel, self.num_experts, self.intermediate_size)
        return shard, build_dispatcher(parallel, self.num_experts, routing.top_k)

    # -- weights -------------------------------------------------------------------------
    def load_weights(self, w13, w2, b13=None, b2=None) -> None:
        """Load canonical-layout expert weights: w13 [E, 2I, H], w2 [E, H, I], b13 [E, 2I], b2 [E, H].

        With `parallel`, either the full tensors (this rank's experts or I-slice are cut out)
        or this rank's part (w13 [E_local, 2I, H], ... or [E, 2I_r, H], ...).
        With EPLB (moekit.eplb.enable_eplb), the full logical tensors [E, ...]: every physical
        slot is filled from its expert under the current placement (replicas are copies).
        """
        if self.runner.eplb is not None:
            self.experts.load_weights(*self.runner.eplb.select(w13, w2, b13, b2))
            return
        if self.shard is not None:
            w13, w2, b13, b2 = self.shard.select(w13, w2, b13, b2, gated=is_gated(self.activation))
        self.experts.load_weights(w13, w2, b13, b2)

    def load_quantized(self, weights: ExpertWeights) -> None:
        """Load pre-quantized expert weights of this layer's scheme (e.g. moekit.quant.load_quantized).

        Only for layers without `parallel` or EPLB: those load a float checkpoint through
        load_weights, which quantizes on load.
        """
        if self.quant is None:
            raise ValueError("load_quantized needs a layer built with quant=...; this layer is unquantized")
        if self.shard is not None or self.runner.eplb is not None:
            raise ValueError("load_quantized does not split or place experts (parallel / EPLB layer); "
                             "load the float weights with load_weights, which quantizes on load")
        self.experts.load_quantized(weights)

    def correction_bias_or_none(self) -> Optional[torch.Tensor]:
        """The e_score_correction_bias [E] fp32 buffer, or None for a layer built without one."""
        return self.e_score_correction_bias

    def _fused_sources(self) -> list:
        """The tensors fused_expert_weights concatenates."""
        params = [self.experts.w13, self.experts.w2, self.shared.gate_up, self.shared.down]
        return params + [b for b in (self.experts.b13, self.experts.b2) if b is not None]

    def _fused_key(self) -> tuple:
        """Where the fused copy's sources lie and their versions (an in-place write changes it)."""
        return tuple((p.data_ptr(), version_of(p), p.dtype, p.device) for p in self._fused_sources())

    def fused_expert_weights(self) -> ExpertWeights:
        """Routed experts followed by the shared MLP's I-slices; rebuilt only when a weight changes."""
        params = self._fused_sources()
        key = self._fused_key()
        # Under autograd the concatenation is rebuilt per call so gradients reach the routed
        # and shared weights; the (detached) cache serves calls without autograd only.
        track = torch.is_grad_enabled() and any(p.requires_grad for p in params)
        if track or self._fused_cache is None or self._fused_cache[0] != key:
            w = self.experts.expert_weights()
            w13_s, w2_s = fused_shared_weights(self.shared, self.intermediate_size)
            n = w13_s.shape[0]
            b13 = None if w.b13 is None else torch.cat((w.b13, w.b13.new_zeros((n,) + w.b13.shape[1:])))
            b2 = None if w.b2 is None else torch.cat((w.b2, w.b2.new_zeros((n,) + w.b2.shape[1:])))
            tensors = (torch.cat((w.w13, w13_s.to(w.w13.dtype))), torch.cat((w.w2, w2_s.to(w.w2.dtype))), b13, b2)
            if track:
                return ExpertWeights(*tensors)
            fused = ExpertWeights(*(None if t is None else t.detach() for t in tensors))
            self._fused_cache = (key, fused)
        return self._fused_cache[1]

    def _apply(self, fn, recurse=True):
        """nn.Module's .to() / .half() / ... with the correction bias in fp32 whatever dtype fn casts
        to: a selection-only bias rounded to 16 bits picks other experts, and small updates
        (moekit.balance.update_correction_bias) vanish in it. It takes only fn's device then.
        A layer split over ranks then takes x in the new dtype (every rank must cast alike)."""
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        if self._split_dtype is not None:  # the rows every rank sends follow the layer's cast (on every rank)
            self._split_dtype = fn(torch.empty(0, dtype=self._split_dtype)).dtype
        if bias is not None:
            probe = fn(bias.new_empty(0))
            if probe.dtype != bias.dtype:
                self.e_score_correction_bias = bias.to(probe.device, torch.float32)
        return self

    def side_stream(self):
        """The CUDA stream the "overlap" shared experts run on (made on first use)."""
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        return self._side_stream

    # -- forward -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, router_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [.., H] (and router_logits [.., E], unless the layer owns a gate) -> [.., H]."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be [.., H={self.hidden_size}], got shape {tuple(x.shape)}")
        if x.device != self.experts.w13.device:
            raise ValueError(f"x is on {x.device}, expected {self.experts.w13.device} (the layer's device)")
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
        if self._split_dtype is not None and x.dtype != self._split_dtype:
            raise TypeError(f"x must be {self._split_dtype} (the layer's dtype) when the layer is split over ranks: "
                            f"every rank exchanges rows in it, got {x.dtype}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.hidden_size)  # [T, H]
        if router_logits is None:
            if self.gate is None:
                raise ValueError("router_logits is required: this layer was built without a gate (gate=False)")
            dt = self.router_dtype or x2.dtype
            gate_w, gate_b = self.gate.weight, self.gate.bias
            router_logits = nn.functional.linear(
                x2 if x2.dtype == dt else x2.to(dt), gate_w if gate_w.dtype == dt else gate_w.to(dt),
                None if gate_b is None else gate_b.to(dt))
        else:
            if not isinstance(router_logits, torch.Tensor):
                raise TypeError(f"router_logits must be a torch.Tensor, got {type(router_logits).__name__}")
            if router_logits.device != x.device:
                raise ValueError(f"router_logits is on {router_logits.device}, expected {x.device} (the device of x)")
            if tuple(router_logits.shape) not in (tuple(lead) + (self.num_experts,), (x2.shape[0], self.num_experts)):
                raise ValueError(
                    f"router_logits must be [.., E={self.num_experts}] with the leading shape of x "
                    f"{tuple(lead)} (or [T={x2.shape[0]}, E]), got {tuple(router_logits.shape)}"
                )
            router_logits = router_logits.reshape(-1, self.num_experts)
        if self._graphs.usable((x2, router_logits)) and self.runner.dispatcher.graph_safe:
            out = self._graphs.run(self._routed, self._graph_storage(), x2, router_logits)
        else:
            out = self.runner.forward(self, x2, router_logits)
        return out.reshape(*lead, self.hidden_size)

    def extra_repr(self) -> str:
        return (f"name={self.layer_name}, E={self.num_experts}, H={self.hidden_size}, I={self.intermediate_size}, "
                f"k={self.routing.top_k}, activation={self.activation}, backend={self.runner.backend}")
