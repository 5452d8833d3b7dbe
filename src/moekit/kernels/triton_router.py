"""The router in one launch: logits [T, E] -> (weights [T, k] fp32, ids [T, k] int32).

The same math as moekit.routing.route (ROUTING.md), for every variant but custom routing
functions: scoring (softmax, sigmoid, sqrt-softplus) with an optional correction bias and
DeepSeek grouped top-k, or top-k on the raw logits then softmax / sigmoid of the k; the
renormalisation and the router-side scaling. Selection is the stable descending order of the
torch path: among equal scores the lowest expert index wins, and -inf scores come last, in
index order. Scores use the precise exp / log1p / division / square root of torch's CUDA
kernels, so ids agree with the torch path; weights agree to an ulp or two (sums may add in
another order).

The torch path runs a dozen small kernels and one or two sorts a call: on an H200 host 97-503 us
of host time eagerly (with the NaN check) and 13-60 us of GPU time in a CUDA graph at one
decode token, where this one launch takes 51-92 us and 1.4-5.7 us (bench/results/h200-router.json).
A program routes whole rows of at most EP >= E logits (program_shape), picking the k experts
one at a time (each pick a max and a min over the row). NaN or +inf logits, rows of -inf only
and a non-finite bias set a flag the caller reads (its one host sync) when the check is on;
whatever the logits, every id written is in [0, E).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..config import RoutingConfig, settings

__all__ = ["route_kernel", "triton_route", "kernel_refusal", "program_shape", "MAX_EXPERTS", "MAX_TOP_K"]

MAX_EXPERTS = 4096  # a row of logits per program
MAX_TOP_K = 64  # picks are unrolled
MAX_GROUPS = 64

_SCORING = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}
_ORDER = {"score_then_topk": 0, "topk_then_softmax": 1, "topk_then_sigmoid": 2}
# renormalisation of the k picked weights: none, w / sum, w / (sum + eps), w / max(sum, eps)
RENORM_NONE, RENORM_SUM, RENORM_EPS, RENORM_CLAMP = 0, 1, 2, 3


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    """expf as torch's CUDA kernels compute it (libdevice; tl.exp is the approximate ex2 path).
    Triton's interpreter has no libdevice: there, numpy's exp."""
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _log1p(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.log1p(x)
    else:  # log(u) * x / (u - 1), u = 1 + x: accurate to a few ulp where 1 + x rounds
        u = 1.0 + x
        return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))


@triton.jit
def _first_max(v, avail, cols, BIG: tl.constexpr):
    """Per row of v [R, N] over the available entries: the largest value and its lowest column.
    A row whose available values are all NaN (only when the NaN check is off) picks its lowest
    available column, so the column is always a real one."""
    v = tl.where(avail, v, float("-inf"))
    m = tl.max(v, axis=1)
    idx = tl.min(tl.where(avail & (v == m[:, None]), cols[None, :], BIG), axis=1)
    first = tl.min(tl.where(avail, cols[None, :], BIG), axis=1)
    return m, tl.where(idx < BIG, idx, first)


@triton.jit
def route_kernel(
    z_ptr, b_ptr, w_ptr, ids_ptr, flag_ptr,
    T, E, stride_z, eps, scale,
    K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, R: tl.constexpr,
    SCORING: tl.constexpr, ORDER: tl.constexpr, HAS_BIAS: tl.constexpr,
    G: tl.constexpr, GP: tl.constexpr, TOPG: tl.constexpr, TOP2: tl.constexpr,
    RENORM: tl.constexpr, SCALE: tl.constexpr, CHECK: tl.constexpr, PRECISE: tl.constexpr,
):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    cols = tl.arange(0, EP)
    kcols = tl.arange(0, KP)
    live = (rows < T)[:, None] & (cols < E)[None, :]  # [R, EP]
    z = tl.load(z_ptr + rows[:, None].to(tl.int64) * stride_z + cols[None, :], mask=live,
                other=float("-inf")).to(tl.float32)
    if CHECK:  # NaN or +inf logits, rows of -inf only, a NaN or infinite bias
        bad = tl.sum(tl.where(live & ((z != z) | (z == float("inf"))), 1, 0))
        dead = (rows < T) & (tl.max(z, axis=1) == float("-inf"))
        bad += tl.sum(tl.where(dead, 1, 0))
        if HAS_BIAS:
            bv = tl.load(b_ptr + cols, mask=cols < E, other=0.0)
            bad += tl.sum(tl.where((bv != bv) | (tl.abs(bv) == float("inf")), 1, 0))
        tl.atomic_max(flag_ptr, bad)
    avail = (cols < E)[None, :] & (rows >= 0)[:, None]  # [R, EP]; padding rows pick too (not stored)
    z = tl.where(avail & ~live, 0.0, z)  # padding rows: finite logits, no NaN scores
    if ORDER == 0:
        if SCORING == 0:  # softmax over the row: exp(z - max) / sum, as torch's kernel
            e = _exp(z - tl.max(z, axis=1)[:, None], PRECISE)
            p = tl.div_rn(e, tl.sum(e, axis=1)[:, None] + tl.zeros_like(e))  # (the interpreter needs equal shapes)
        elif SCORING == 1:
            p = tl.div_rn(tl.full(z.shape, 1.0, tl.float32), 1.0 + _exp(-z, PRECISE))
        else:  # sqrt(softplus(z)), softplus with torch's threshold 20
            p = tl.sqrt_rn(tl.where(z > 20.0, z, _log1p(_exp(z, PRECISE), PRECISE)))
        c = p
        if HAS_BIAS:
            c = p + tl.load(b_ptr + cols, mask=cols < E, other=0.0)[None, :]
        c = tl.where(z == float("-inf"), float("-inf"), c)  # -inf logits last, whatever the bias
        if G > 0:  # DeepSeek grouped top-k: keep the TOPG best of G contiguous groups
            gid = cols // (E // G)
            gcols = tl.arange(0, GP)
            gscore = tl.full((R, GP), float("-inf"), tl.float32)
            for g in tl.static_range(G):
                in_g = avail & (gid == g)[None, :]
                m1, i1 = _first_max(c, in_g, cols, EP)
                s = m1
                if TOP2:
                    m2, _i2 = _first_max(c, in_g & (cols[None, :] != i1[:, None]), cols, EP)
                    s = m1 + tl.where(m2 == float("-inf"), 0.0, m2)  # a never-picked second adds nothing
                gscore = tl.where(gcols[None, :] == g, s[:, None], gscore)
            gavail = (gcols < G)[None, :] & (rows >= 0)[:, None]
            kept = (cols < 0)[None, :] & (rows >= 0)[:, None]  # [R, EP], all false
            for _j in tl.static_range(TOPG):
                _m, gi = _first_max(gscore, gavail, gcols, GP)
                gavail = gavail & (gcols[None, :] != gi[:, None])
                kept = kept | (gid[None, :] == gi[:, None])
            c = tl.where(kept, c, float("-inf"))
    else:
        c = z
    ids = tl.zeros((R, KP), tl.int32)
    w = tl.zeros((R, KP), tl.float32)
    for j in tl.static_range(K):
        m, i = _first_max(c, avail, cols, EP)
        avail = avail & (cols[None, :] != i[:, None])
        ids = tl.where(kcols[None, :] == j, i[:, None], ids)
        if ORDER == 0:  # the unbiased score of the pick
            v = tl.sum(tl.where(cols[None, :] == i[:, None], p, 0.0), axis=1)
        else:  # the raw logit of the pick
            v = m
        w = tl.where(kcols[None, :] == j, v[:, None], w)
    kmask = (kcols < K)[None, :]
    if ORDER == 1:  # softmax over the k picked logits
        e = tl.where(kmask, _exp(w - tl.max(tl.where(kmask, w, float("-inf")), axis=1)[:, None], PRECISE), 0.0)
        w = tl.div_rn(e, tl.sum(e, axis=1)[:, None] + tl.zeros_like(e))
    elif ORDER == 2:
        w = tl.div_rn(tl.full(w.shape, 1.0, tl.float32), 1.0 + _exp(-w, PRECISE))
    if RENORM != 0:
        denom = tl.sum(tl.where(kmask, w, 0.0), axis=1)
        if RENORM == 2:
            denom = denom + eps
        elif RENORM == 3:
            denom = tl.maximum(denom, eps)
        w = tl.div_rn(w, denom[:, None] + tl.zeros_like(w))
    if SCALE:
        w = w * scale
    out = rows[:, None].to(tl.int64) * K + kcols[None, :]
    smask = (rows < T)[:, None] & kmask
    tl.store(w_ptr + out, w, mask=smask)
    tl.store(ids_ptr + out, ids, mask=smask)


def program_shape(T: int, EP: int) -> Tuple[int, int]:
    """(rows a program, warps) for T rows of EP padded logits: about 8 logits a thread. Up to 256
    experts one warp holds whole rows, so every pick reduces within the warp (no shared memory);
    more experts spread a row over EP / 256 warps. (4 warps over R x EP blocks took 27 us a call
    at DeepSeek-V3's 256 experts from 16 rows, spilling; 9 us for one row.)"""
    if EP <= 256:
        return min(256 // EP, triton.next_power_of_2(T)), 1
    return 1, min(16, EP // 256)


def kernel_refusal(cfg: RoutingConfig, E: int) -> Optional[str]:
    """Why the kernel cannot route this config over E experts (None: it can)."""
    if cfg.custom is not None:
        return "custom routing functions run in Python"
    if E > MAX_EXPERTS:
        return f"more than {MAX_EXPERTS} experts"
    if cfg.top_k > MAX_TOP_K:
        return f"top_k above {MAX_TOP_K}"
    if cfg.uses_groups(E) and cfg.num_expert_group > MAX_GROUPS:
        return f"more than {MAX_GROUPS} expert groups"
    return None


def triton_route(z: torch.Tensor, cfg: RoutingConfig, bias: Optional[torch.Tensor],
                 check_nan: bool) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Route logits z [T, E] (any float dtype, rows contiguous) -> (weights [T, k] fp32, ids [T, k]
    int32, NaN flag [1] int32 or None). The caller validated cfg for E and the bias's shape; the
    flag, when check_nan, is nonzero if z holds a NaN or +inf or a row of -inf only, or the bias a
    NaN or inf."""
    T, E = z.shape
    k = cfg.top_k
    w = torch.empty(T, k, dtype=torch.float32, device=z.device)
    ids = torch.empty(T, k, dtype=torch.int32, device=z.device)
    flag = torch.zeros(1, dtype=torch.int32, device=z.device) if check_nan else None
    if T == 0:
        return w, ids, flag
    if z.stride(1) != 1:
        z = z.contiguous()
    grouped = cfg.order == "score_then_topk" and cfg.uses_groups(E)
    G = cfg.num_expert_group if grouped else 0
    top2 = grouped and cfg.group_score_for(bias is not None) == "top2_sum" and E // G >= 2
    mode, eps = RENORM_NONE, 0.0
    if cfg.order == "score_then_topk" and cfg.renormalize:
        eps, clamp = cfg.renorm_eps(grouped, bias is not None)
        mode = RENORM_CLAMP if clamp else RENORM_EPS if eps else RENORM_SUM
    elif cfg.order == "topk_then_sigmoid" and cfg.renormalize:
        mode = RENORM_SUM
    scale = cfg.routed_scaling_factor if cfg.scale_on == "router" else 1.0
    EP = triton.next_power_of_2(E)
    R, warps = program_shape(T, EP)
    b = bias.float() if bias is not None else z
    route_kernel[(triton.cdiv(T, R),)](
        z, b, w, ids, flag if flag is not None else ids, T, E, z.stride(0), float(eps), float(scale),
        K=k, KP=triton.next_power_of_2(k), EP=EP, R=R, SCORING=_SCORING[cfg.scoring], ORDER=_ORDER[cfg.order],
        HAS_BIAS=bias is not None and cfg.order == "score_then_topk", G=G, GP=triton.next_power_of_2(max(G, 1)),
        TOPG=cfg.topk_group if grouped else 0, TOP2=bool(top2), RENORM=mode, SCALE=scale != 1.0,
        CHECK=check_nan, PRECISE=not settings.triton_interpret, num_warps=warps)
    return w, ids, flag
