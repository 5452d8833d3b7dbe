"""moekit.activations against the formulas of ROUTING.md and the model families, written out."""

import pytest
import torch

from moekit import ActivationParams
from moekit.activations import ACTIVATIONS, apply_activation, is_gated


def _sig(v):
    return 1 / (1 + torch.exp(-v))


FORMULAS = {  # (gate, up, params) -> output, in float64
    "silu": lambda g, u, p: g * _sig(g) * u,
    "gelu": lambda g, u, p: 0.5 * g * (1 + torch.erf(g / 2 ** 0.5)) * u,
    "gelu_tanh": lambda g, u, p: 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3))) * u,
    # gpt-oss: the gate clamped from above, up on both sides, alpha in the sigmoid, up + 1
    "swigluoai": lambda g, u, p: (g.clamp(max=p.limit) * _sig(p.alpha * g.clamp(max=p.limit))
                                  * (u.clamp(-p.limit, p.limit) + 1)),
    # DeepSeek-V4 / GLM-5-Next / HunYuan-V4: the same clamps around a plain SwiGLU (alpha unused)
    "swiglu_limit": lambda g, u, p: g.clamp(max=p.limit) * _sig(g.clamp(max=p.limit)) * u.clamp(-p.limit, p.limit),
    # Step-3.5 / 3.7, Bailing-hybrid: the clamp after the SiLU
    "swiglustep": lambda g, u, p: (g * _sig(g)).clamp(max=p.limit) * u.clamp(-p.limit, p.limit),
    "silu_no_mul": lambda g, u, p: g * _sig(g),
    "gelu_no_mul": lambda g, u, p: 0.5 * g * (1 + torch.erf(g / 2 ** 0.5)),
    "relu2_no_mul": lambda g, u, p: g.clamp(min=0) ** 2,
}


def test_every_activation_has_a_formula():
    assert sorted(FORMULAS) == sorted(ACTIVATIONS)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_matches_its_formula(activation, gen):
    params = ActivationParams(alpha=1.3, limit=0.9)  # a limit half the values cross
    I = 33
    h = torch.randn(50, 2 * I if is_gated(activation) else I, generator=gen, dtype=torch.float64) * 2
    g, u = (h[:, :I], h[:, I:]) if is_gated(activation) else (h, None)
    want = FORMULAS[activation](g, u, params)
    got = apply_activation(h, activation, params)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_swiglu_limit_is_not_swigluoai_without_alpha():
    """The two clamped forms differ by the + 1 on up (and alpha): a regression guard on their names."""
    h = torch.tensor([[0.5, 2.0]], dtype=torch.float64)  # gate 0.5, up 2.0 (clamped to 1.0)
    p = ActivationParams(alpha=1.0, limit=1.0)
    assert apply_activation(h, "swiglu_limit", p).item() == pytest.approx(0.5 * float(_sig(torch.tensor(0.5))) * 1.0)
    assert apply_activation(h, "swigluoai", p).item() == pytest.approx(0.5 * float(_sig(torch.tensor(0.5))) * 2.0)
