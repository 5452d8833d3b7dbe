"""Gradients through `route` and `fused_experts` on every differentiable backend.

fused_experts takes fp32/bf16/fp16 only and every backend computes in fp32, so a float64
gradcheck cannot run through them. Instead:
- `loop_experts`, a per-token loop that reads as the math, passes a float64 gradcheck;
- each backend's fp32 gradients match that loop's float64 gradients (GRAD_TOL) and pass
  an fp32 gradcheck (central differences with eps=1e-3, loose tolerances);
- bf16 gradients of every backend match the loop's float64 gradients (bf16 tolerance).
A float64 call to fused_experts is refused (TypeError naming hidden_states).
"""

import pytest
import torch
import torch.nn.functional as F

import moekit.experts.cpu as cpu_module
from moekit import FusedMoE, RoutingConfig, SharedExpertsConfig, fused_experts, route
from moekit.experts.api import problem_of
from moekit.experts.base import BACKENDS, ExpertsBackend, ExpertWeights
from moekit.experts.reference import reference_experts
from moekit.oracle import PRIORITIES, choose_backend

from conftest import TOL, rel_err

DIFFERENTIABLE = ["reference", "grouped_mm", "cpu"]
# fp32 gradients against float64 ones. Looser than the forward's 1e-5: a gradient such as
# dtopk_weights[t, j] = <upstream, y> is a dot product with cancellation, and with T=1 it
# is a single number (about 1 case in 100 lands between 1e-5 and 2e-5).
GRAD_TOL = 1e-4


def act(h, activation):
    if activation == "silu":
        g, u = h.chunk(2, dim=-1)
        return g * torch.sigmoid(g) * u
    if activation == "relu2_no_mul":
        return torch.where(h > 0, h * h, torch.zeros_like(h))
    raise AssertionError(activation)


def loop_experts(x, w13, w2, b13, b2, w, ids, activation="silu", on_input=False, expert_map=None):
    """out[t] = sum_j w[t,j] * W2_e act(W13_e x[t] + b13_e) + b2_e, token by token."""
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=x.dtype)
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) if expert_map is None else int(expert_map[int(ids[t, j])])
            if e < 0:
                continue  # expert held by another rank
            xin = x[t] * w[t, j] if on_input else x[t]
            h = w13[e] @ xin + (0 if b13 is None else b13[e])
            y = w2[e] @ act(h, activation) + (0 if b2 is None else b2[e])
            acc = acc + (y if on_input else w[t, j] * y)
        rows.append(acc)
    return torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])


def make(T, E, H, I, k, gen, *, activation="silu", bias=False, dtype=torch.float32, starve=True):
    """Leaf inputs requiring grad: (x, w13, w2, b13, b2, topk_weights) and ids [T, k]."""
    rows = 2 * I if activation == "silu" else I
    logits = torch.randn(T, E, generator=gen)
    if starve and k < E:
        logits[:, E - 1] = float("-inf")  # expert E-1 receives no token
    w, ids = route(logits, RoutingConfig(top_k=k))
    tensors = [
        torch.randn(T, H, generator=gen),
        torch.randn(E, rows, H, generator=gen) * H ** -0.5,
        torch.randn(E, H, I, generator=gen) * I ** -0.5,
        torch.randn(E, rows, generator=gen) * 0.1 if bias else None,
        torch.randn(E, H, generator=gen) * 0.1 if bias else None,
    ]
    tensors = [None if t is None else t.to(dtype).requires_grad_() for t in tensors]
    return tensors + [w.requires_grad_()], ids


def grads(fn, tensors, upstream):
    out = fn(*tensors)
    live = [t for t in tensors if t is not None and t.requires_grad]
    g = torch.autograd.grad((out.float() * upstream).sum(), live)
    it = iter(g)
    return out, [next(it) if t is not None and t.requires_grad else None for t in tensors]


def run_backend(backend, activation="silu", on_input=False, expert_map=None):
    def fn(x, w13, w2, b13, b2, w, ids):
        return fused_experts(x, w13, w2, w, ids, b13=b13, b2=b2, activation=activation,
                             apply_router_weight_on_input=on_input, expert_map=expert_map, backend=backend)
    return fn


def test_loop_oracle_passes_fp64_gradcheck(gen):
    inputs, ids = make(3, 3, 4, 3, 2, gen, bias=True, dtype=torch.float64)
    inputs[5] = inputs[5].detach().double().requires_grad_()
    assert torch.autograd.gradcheck(lambda *a: loop_experts(*a, ids), tuple(inputs))


CASES = {
    # name: (T, E, k, kwargs)
    "T1-k1": (1, 4, 1, {}),
    "k2-starved-expert": (9, 5, 2, {}),
    "k=E": (6, 3, 3, {}),
    "biases": (7, 4, 2, {"bias": True}),
    "non-gated": (5, 4, 2, {"activation": "relu2_no_mul"}),
    "weights-on-input": (6, 4, 1, {"on_input": True}),
    "expert-map": (8, 4, 2, {"expert_map": True}),
    # regression: grouped_mm leaves non-local rows unwritten in its backward too; they
    # leaked into dx and, through the bias gather at expert 0, into db13
    "expert-map-biases": (8, 4, 2, {"expert_map": True, "bias": True}),
    "expert-map-on-input": (7, 4, 1, {"expert_map": True, "on_input": True, "bias": True}),
}


@pytest.mark.parametrize("backend", DIFFERENTIABLE)
@pytest.mark.parametrize("case", list(CASES))
def test_fp32_gradients_match_fp64_loop(backend, case, gen):
    T, E, k, kw = CASES[case]
    # grouped_mm needs 16-byte rows; the cpu backend gets odd sizes so it runs its own
    # per-expert path (aligned fp32 sizes hand the call to grouped_mm).
    H, I = (13, 7) if backend == "cpu" else (12, 8)
    activation = kw.get("activation", "silu")
    on_input = kw.get("on_input", False)
    emap = None
    if kw.get("expert_map"):
        emap = torch.tensor([1, -1, 0, -1, 2, 3], dtype=torch.int32)  # 6 global experts, 4 local
        E = 6
    inputs, ids = make(T, E if emap is None else 4, H, I, k, gen, activation=activation, bias=kw.get("bias", False))
    if emap is not None:
        ids = torch.randint(0, E, (T, k), generator=gen, dtype=torch.int32)
    G = torch.randn(T, H, generator=gen)
    out, got = grads(run_backend(backend, activation, on_input, emap), inputs + [ids], G)
    inputs64 = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    ref_out, want = grads(lambda *a: loop_experts(*a, activation=activation, on_input=on_input, expert_map=emap),
                          inputs64 + [ids], G.double())
    assert rel_err(out, ref_out) <= TOL[torch.float32]
    names = ["x", "w13", "w2", "b13", "b2", "topk_weights"]
    for name, g, r in zip(names, got, want):
        if r is None:
            continue
        assert g is not None and g.shape == r.shape, name
        assert rel_err(g, r) <= GRAD_TOL, f"{backend} {case}: d{name} rel err {rel_err(g, r):.3g}"
    if case == "k2-starved-expert":
        assert (got[1][E - 1] == 0).all() and (got[2][E - 1] == 0).all()  # zeros, not missing


@pytest.mark.parametrize("backend", DIFFERENTIABLE)
@pytest.mark.filterwarnings("ignore:Input #")  # gradcheck warns that the inputs are fp32
def test_fp32_gradcheck(backend, gen):
    H, I = (5, 3) if backend == "cpu" else (8, 4)
    inputs, ids = make(4, 3, H, I, 2, gen, bias=True)
    fn = run_backend(backend)
    assert torch.autograd.gradcheck(lambda *a: fn(*a, ids), tuple(inputs), eps=1e-3, atol=2e-3, rtol=1e-2)


def test_cpu_blocked_fp32_path_gradients(monkeypatch, gen):
    # Force the blocked path (weights converted one I-block at a time, as for bf16 weights on
    # CPUs without native bf16) with three blocks of I=40: 16 + 16 + 8.
    monkeypatch.setattr(cpu_module, "native_dtypes", lambda: frozenset())
    monkeypatch.setattr(cpu_module, "BLOCK_BYTES", 1)
    sizes = []
    real = cpu_module._block_size
    monkeypatch.setattr(cpu_module, "_block_size", lambda *a: sizes.append(real(*a)) or sizes[-1])
    inputs, ids = make(9, 3, 16, 40, 2, gen, bias=True)  # 18 assignments: past the decode path's 16
    G = torch.randn(9, 16, generator=gen)
    _, got = grads(run_backend("cpu"), inputs + [ids], G)
    assert sizes == [16]
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    _, want = grads(loop_experts, inputs64 + [ids], G.double())
    for g, r in zip(got[:6], want[:6]):
        assert rel_err(g, r) <= GRAD_TOL


@pytest.mark.parametrize("backend", ["reference", "grouped_mm", "cpu", "cpu-blocked"])
def test_bf16_gradients(backend, monkeypatch, gen):
    # bf16 inputs, gradients against the float64 loop. The fast backends run the backward
    # GEMMs in bf16 and store bf16 gradients: twice the roundings of the forward, so 2e-2
    # (seen up to 9e-3 over 60 seeds; a missing or wrong gradient is off by about 1).
    # "cpu-blocked" forces the fp32-from-bf16 blocked path of CPUs without native bf16.
    if backend == "cpu-blocked":
        monkeypatch.setattr(cpu_module, "native_dtypes", lambda: frozenset({torch.float32}))
    inputs, ids = make(24, 6, 32, 16, 2, gen, bias=True, dtype=torch.bfloat16)
    G = torch.randn(24, 32, generator=gen)
    _, got = grads(run_backend(backend.replace("-blocked", "")), inputs + [ids], G)
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    _, want = grads(loop_experts, inputs64 + [ids], G.double())
    tol = TOL[torch.bfloat16] if backend in ("reference", "cpu-blocked") else 2 * TOL[torch.bfloat16]
    for name, g, r, t in zip(["x", "w13", "w2", "b13", "b2", "topk_weights"], got, want, inputs):
        assert g.dtype == t.dtype
        assert rel_err(g, r) <= tol, f"{backend}: d{name} rel err {rel_err(g, r):.3g}"


# -- route ---------------------------------------------------------------------------------

ROUTES = {
    # name: (config, uses correction bias, independent fp64 weights from logits z and ids)
    "softmax-renorm": (RoutingConfig(top_k=2), False,
                       lambda z, ids: (lambda p: p / p.sum(-1, keepdim=True))(torch.softmax(z, -1).gather(1, ids))),
    "softmax-k1-no-renorm": (RoutingConfig(top_k=1, renormalize=False), False,
                             lambda z, ids: torch.softmax(z, -1).gather(1, ids)),
    "sigmoid-groups-bias-scaled": (
        RoutingConfig(top_k=3, scoring="sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=2.5), True,
        lambda z, ids: (lambda p: 2.5 * p / (p.sum(-1, keepdim=True) + 1e-20))(torch.sigmoid(z).gather(1, ids))),
    "sqrtsoftplus": (RoutingConfig(top_k=2, scoring="sqrtsoftplus"), False,
                     lambda z, ids: (lambda p: p / p.sum(-1, keepdim=True).clamp_min(1e-20))(
                         torch.sqrt(F.softplus(z)).gather(1, ids))),
    "topk-then-softmax": (RoutingConfig(top_k=3, order="topk_then_softmax"), False,
                          lambda z, ids: torch.softmax(z.gather(1, ids), -1)),
    "topk-then-sigmoid": (RoutingConfig(top_k=1, order="topk_then_sigmoid", renormalize=False), False,
                          lambda z, ids: torch.sigmoid(z.gather(1, ids))),
}


@pytest.mark.parametrize("variant", list(ROUTES))
def test_route_weight_gradients_match_fp64_formula(variant, gen):
    cfg, with_bias, formula = ROUTES[variant]
    z = (torch.randn(11, 8, generator=gen) * 2).requires_grad_()
    bias = torch.randn(8, generator=gen) * 0.3 if with_bias else None
    w, ids = route(z, cfg, bias)
    G = torch.randn_like(w)
    g, = torch.autograd.grad((w * G).sum(), z)
    z64 = z.detach().double().requires_grad_()
    w64 = formula(z64, ids.long())
    g64, = torch.autograd.grad((w64 * G.double()).sum(), z64)
    assert rel_err(w, w64) <= TOL[torch.float32]
    assert rel_err(g, g64) <= GRAD_TOL, f"{variant}: rel err {rel_err(g, g64):.3g}"


@pytest.mark.filterwarnings("ignore:Input #")
def test_route_fp32_gradcheck(gen):
    # rows are permutations of 0, 0.5, 1, ...: gaps of 0.5 keep the choice fixed under eps
    z = torch.stack([torch.randperm(6, generator=gen).float() * 0.5 for _ in range(5)]).requires_grad_()
    cfg = RoutingConfig(top_k=2, scoring="sigmoid", routed_scaling_factor=1.5)
    assert torch.autograd.gradcheck(lambda a: route(a, cfg).weights, (z,), eps=1e-3, atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("backend", DIFFERENTIABLE)
def test_end_to_end_logits_gradient(backend, gen):
    H, I = (13, 7) if backend == "cpu" else (12, 8)
    z = torch.randn(10, 5, generator=gen).requires_grad_()
    inputs, _ = make(10, 5, H, I, 2, gen)
    x, w13, w2 = inputs[:3]
    w, ids = route(z, RoutingConfig(top_k=2))
    G = torch.randn(10, H, generator=gen)
    got = torch.autograd.grad((fused_experts(x, w13, w2, w, ids, backend=backend) * G).sum(), (z, x))
    z64, x64 = z.detach().double().requires_grad_(), x.detach().double().requires_grad_()
    p = torch.softmax(z64, -1).gather(1, ids.long())
    out64 = loop_experts(x64, w13.detach().double(), w2.detach().double(), None, None,
                         p / p.sum(-1, keepdim=True), ids)
    want = torch.autograd.grad((out64 * G.double()).sum(), (z64, x64))
    for g, r in zip(got, want):
        assert rel_err(g, r) <= GRAD_TOL


# -- backends that cannot backpropagate ----------------------------------------------------

class NoGradBackend(ExpertsBackend):
    """A forward-only backend (as a custom kernel without a backward would be)."""

    name = "test_forward_only"
    differentiable = False

    def unsupported(self, problem):
        return None

    def apply(self, x, weights, topk_weights, topk_ids, **kw):
        with torch.no_grad():
            return reference_experts(x, weights, topk_weights, topk_ids, **kw)


@pytest.fixture
def forward_only(monkeypatch):
    backend = NoGradBackend()
    monkeypatch.setitem(BACKENDS, backend.name, backend)
    prio = PRIORITIES["unquantized"]
    monkeypatch.setitem(prio, "cpu", [backend.name] + prio["cpu"])
    return backend


def test_backends_declare_differentiable_truthfully():
    # A backend that claims autograd must be in DIFFERENTIABLE, whose gradients these tests
    # check; every other backend (Triton, quantized) must declare differentiable = False.
    for name in DIFFERENTIABLE:
        assert BACKENDS[name].differentiable is True
    claimed = {name for name, b in BACKENDS.items() if b.differentiable}
    assert claimed == set(DIFFERENTIABLE), f"differentiable without gradient tests: {claimed - set(DIFFERENTIABLE)}"
    assert ExpertsBackend.differentiable is True


@pytest.mark.parametrize("needs_grad", ["x", "w13"])
def test_oracle_refuses_forward_only_backend_under_autograd(forward_only, needs_grad, gen):
    inputs, ids = make(5, 4, 12, 8, 2, gen)
    x, w13, w2, _, _, w = [None if t is None else t.detach() for t in inputs]
    {"x": x, "w13": w13, "topk_weights": w}[needs_grad].requires_grad_()
    with pytest.raises(ValueError, match="test_forward_only.*does not support autograd"):
        fused_experts(x, w13, w2, w, ids, backend=forward_only.name)
    # auto skips it and the next backend gives real gradients
    out = fused_experts(x, w13, w2, w, ids)
    assert out.grad_fn is not None
    problem = problem_of(x, ExpertWeights(w13, w2), 2, "silu", False, False, w)
    choice = choose_backend(problem)
    assert choice.backend.name == "cpu" and "does not support autograd" in choice.reason


@pytest.mark.parametrize("T", [0, 1, 9])
def test_forward_only_backend_gives_routing_weight_gradients(forward_only, T, gen):
    # Gradients through the routing weights only (a trainable gate over frozen experts): the
    # forward-only backend runs each assignment unweighted and torch takes the weighted sum.
    inputs, ids = make(T, 4, 12, 8, 2, gen)
    x, w13, w2, _, _, w = [None if t is None else t.detach() for t in inputs]
    w.requires_grad_()
    out = fused_experts(x, w13, w2, w, ids, backend=forward_only.name)
    w_ref = w.detach().clone().requires_grad_()
    ref = fused_experts(x, w13, w2, w_ref, ids, backend="reference")
    assert rel_err(out, ref) <= TOL[torch.float32]
    g = torch.randn(T, 12, generator=gen)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    assert rel_err(w.grad, w_ref.grad) <= GRAD_TOL if T else w.grad.abs().sum() == 0


@pytest.mark.parametrize("quant", ["int8_w8a8", "int4_w4a16", "fp8_w8a8"])
def test_quantized_layer_trains_its_gate(quant, gen):
    # A quantized layer with its own gate, called without no_grad: the experts run on their
    # forward-only backends and the gate receives the gradient of the weighted sum over k.
    torch.manual_seed(0)
    T, k, H = 5, 2, 128
    layer = FusedMoE(4, H, 128, RoutingConfig(top_k=k), gate=True, quant=quant)
    x = torch.randn(T, H, generator=gen)
    y = layer(x)
    y.square().sum().backward()
    grad = layer.gate.weight.grad.clone()
    layer.gate.weight.grad = None
    w, ids = route(torch.nn.functional.linear(x, layer.gate.weight), layer.routing)
    with torch.no_grad():  # each assignment's output: the same call as one expert a row (same backend)
        rows = fused_experts(x.repeat_interleave(k, 0), layer.experts.expert_weights(), None,
                             torch.ones(T * k, 1), ids.reshape(T * k, 1)).view(T, k, H)
    ref = (w.unsqueeze(-1) * rows).sum(1)
    assert rel_err(y, ref) <= 1e-6
    ref.square().sum().backward()
    assert rel_err(grad, layer.gate.weight.grad) <= 1e-5


def test_outputs_stay_in_the_graph_when_nothing_is_local(gen):
    inputs, ids = make(3, 4, 12, 8, 2, gen)
    x, w13, w2, _, _, w = inputs
    emap = torch.tensor([-1, -1, -1, -1], dtype=torch.int32)  # every expert on another rank
    for backend in DIFFERENTIABLE:
        out = fused_experts(x, w13, w2, w, ids, expert_map=emap, backend=backend)
        assert out.requires_grad and not out.any()
        out.sum().backward()
        assert x.grad is not None and not x.grad.any() and not w13.grad.any()
        x.grad = w13.grad = None


def test_forward_only_backend_serves_inference(forward_only, gen):
    inputs, ids = make(5, 4, 12, 8, 2, gen)
    x, w13, w2, _, _, w = inputs
    with torch.no_grad():
        out = fused_experts(x, w13, w2, w, ids, backend=forward_only.name)
        problem = problem_of(x, ExpertWeights(w13, w2), 2, "silu", False, False, w)
        assert choose_backend(problem).backend.name == forward_only.name
    assert rel_err(out, reference_experts(x.detach(), ExpertWeights(w13.detach(), w2.detach()), w.detach(), ids)) == 0


# -- the layer -----------------------------------------------------------------------------

def test_fused_moe_trains_in_every_shared_mode(gen):
    # Regression: mode "fused" concatenated the weights with .detach(), so the routed and
    # shared experts silently got no gradient.
    seed = int(torch.randint(0, 2 ** 31, (1,), generator=gen))
    x = torch.randn(2, 5, 16, generator=gen)
    results = {}
    for mode in ("separate", "fused"):
        torch.manual_seed(seed)
        layer = FusedMoE(6, 16, 8, RoutingConfig(top_k=2), gate=True,
                         shared_experts=SharedExpertsConfig(16, gated=True, mode=mode))
        xi = x.clone().requires_grad_()
        layer(xi).square().sum().backward()
        results[mode] = {n: p.grad for n, p in layer.named_parameters()}
        results[mode]["x"] = xi.grad
    for name, g in results["separate"].items():
        assert g is not None and results["fused"][name] is not None, name
        assert rel_err(results["fused"][name], g) <= GRAD_TOL, name
