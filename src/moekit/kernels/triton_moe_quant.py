"""Triton kernels of the quantized experts: the two GEMMs over fp8, int8 or int4 weights.

Rows as in the sorted path of triton_moe: triton_align groups the assignments by expert in
BM-row blocks; GEMM1 writes the activation at the sorted row, GEMM2 each assignment's
weighted output y [S, T*k, H] (S splits of K: fp32 partials when S > 1), and
triton_quant_rows.sum_slots_kernel adds a token's k rows (and S partials) in a fixed order.

Products accumulate in fp32 (int32 for int8 x int8, exact). A scale that is constant along
K (per tensor, expert, output channel or row) is applied once, after the K loop; one that
changes along K (128x128 weight blocks, 1x128 activation groups, weight groups of g
columns) multiplies each K tile's partial product, so a K tile never straddles two scale
groups (the launcher keeps BK <= the group; K is a multiple of it).

Modes (constexpr):
    A_QUANT   0: float activations (weight-only schemes); 1: activations quantized before the
              GEMM (an fp8 / int8 buffer with scales; static per-expert scales: one row per
              assignment, A_BY_ASSIGN).
    A_KSCALE  activation scales per row and K group [rows, K/KGROUP]; else one per row at
              a_s_ptr + e * stride_ase + row * stride_asm (stride_asm = 0: one per tensor
              or per expert).
    W_KSCALE  weight scales per K group: [E, N/W_SROWS, K/KGROUP] (128x128 blocks: W_SROWS
              128; groups: 1); else one per output channel, stride_sn = 0 for one per expert.
    W_INT4    two 4-bit values per byte along K (column 2j low nibble, 2j+1 high): a K tile
              is read as packed bytes [BK/2, BN] and multiplied by the even and the odd
              columns of the activations in two products (no byte is loaded twice).
    HAS_ZERO  uint8 zero points shaped like the weight scales (weight-only groups).
    INT_DOT   int8 x int8 products in int32.
    EVEN_K    K is a multiple of BK: no K masks, so loads stay whole vectors.
    CONVERT   int4 weights to floats: 0 casts (through int8, which Triton converts with bit
              operations); 1 ors the nibble u into the mantissa of MAGIC, the fp16 (0x6400,
              value MAGIC_V = 1024) or bf16 (0x4300, 128) pattern, which is the float MAGIC_V + u,
              and subtracts MAGIC_V + offset (or + zero point) in 16 bits: exact, two values per
              instruction, no int-to-float instruction; 2 does the same in inline PTX on whole
              32-bit registers (_nibbles_ptx_source: eight weights in 12 instructions; CUDA
              only, not the interpreter). 8-bit weights are always cast (int8 takes
              Triton's bit-operation conversion; uint8 with zero points, int16 arithmetic).
              3 and 4 ("pairs": inline PTX on CUDA / its bit-operation twin anywhere): paired
              int4 products (_mainloop_pairs): the activation rows come in PAIRS_ORDER with
              the sums of their weight groups (x prepared in the alignment's launch,
              triton_quant_rows GRAN 5; GEMM2's rows by GEMM1's epilogue), a word of eight
              weights converts with masks and shifts only, and no offset is subtracted per
              weight (one correction per group and output).
    FOLD_W    weight-only schemes: each K tile's weights are dequantized to x's dtype with their
              group's scales ((q - zero) * s, one rounding) before the product, which then
              accumulates in the MMA; without it the product of the integer weights is scaled
              after it, which makes every K tile's product finish before the next one starts
              (the prefill regime's cost: bench/NOTES-triton.md, "Weight-only schemes at large M").
    PREFETCH  the next K tile's weights and activations are loaded before the current tile
              is multiplied (register double buffering; needs EVEN_K).
    PDL       programmatic dependent launch (SM90+): wait for the previous kernel first, let the
              next one launch once the products are done.
    GATE_UP   GEMM1 reads gate and up rows interleaved (column 2j gate j, 2j+1 up j) as one
              [BK, 2 BN] tile and one product, then splits the accumulator.
    SWAP      fp8 products with scales constant along K: the accumulator is [BN, BM] and each
              K step multiplies W tile^T by a^T, so the weight rows (BN >= 64) are the side of
              Hopper's 64-row warpgroup fp8 product and a few tokens (BM = 16, 32) its other
              side; with the tokens on the 64-row side, BM < 64 tiles fall back to 16-row
              products that convert every fp8 weight to fp16 first.

    OUT_POLICY  L2 eviction policy of the stores (triton_moe.store_policy: evict-last for the
              small buffers of decode calls, which the next kernel reads).

Letters: T tokens, H hidden, I intermediate, E local experts, k slots per token,
TK = T * k assignments, R rows of the activation buffer, S splits of GEMM2's K.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_moe import _block_expert, _gate_up_act, _gate_up_bias, _gemm2_operands, _silu_mul_scaled, _tile_ids
from .triton_quant_rows import to_pairs_order, to_quant

__all__ = ["gemm1_quant_kernel", "gemm2_quant_kernel", "MAGIC_FP16", "MAGIC_BF16", "PAIRS_ORDER"]

# The paired column order of the activation rows of CONVERT 3 / 4: position p of every group of
# eight columns holds column PAIRS_ORDER[p] of the group; its first four positions are what the
# first weight tiles of _pair_tiles multiply, the last four the second tiles'.
PAIRS_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)

# (bit pattern, its value): u | pattern is the float value + u for 0 <= u < 16.
MAGIC_FP16 = (0x6400, 1024.0)
MAGIC_BF16 = (0x4300, 128.0)


@triton.jit
def _bits(u, MAGIC: tl.constexpr, dtype: tl.constexpr):
    """The float MAGIC_V + u of dtype for int16 u in [0, 16): u or-ed into MAGIC's mantissa."""
    return (u | MAGIC).to(dtype, bitcast=True)


def _nibbles_ptx_source(bf16: bool, sub: bool) -> str:
    """PTX of CONVERT = 2 for four packed bytes $4: the low nibbles' floats in $0, $1 and the high
    ones' in $2, $3 (two 16-bit floats per register, in byte order).

    t0 = [b0, b2, b1, b3] and t1 = [b2, b0, b3, b1] put the nibbles of bytes (0, 1) and (2, 3) at
    bits 0-7 and 16-23, the halves of a 2 x 16-bit register; a mask (lop3: t & 0x000F000F | MAGIC)
    takes the low nibbles, a shift by 4 first the high ones. With sub, a packed fma by 1 and
    -(MAGIC_V + 8) leaves u - 8 (exact: small integers).
    """
    magic, one, off, fma = (("0x43004300", "0x3F803F80", "0xC308C308", "fma.rn.bf16x2") if bf16 else
                            ("0x64006400", "0x3C003C00", "0xE408E408", "fma.rn.f16x2"))
    body = ["prmt.b32 t0, $4, $4, 0x3120;", "prmt.b32 t1, $4, $4, 0x1302;"]
    for outs, shift in ((("$0", "$1"), False), (("$2", "$3"), True)):
        for t, out in zip(("t0", "t1"), outs):
            if shift:
                body.append(f"shr.u32 {t}, {t}, 4;")
            body.append(f"lop3.b32 {'u' if sub else out}, {t}, 0x000F000F, {magic}, 0xEA;")
            if sub:
                body.append(f"{fma} {out}, u, one, off;")
    return ("{ .reg .b32 t0, t1, u, one, off; mov.b32 one, " + one + "; mov.b32 off, " + off + "; "
            + " ".join(body) + " }")


def _pairs_ptx_source(bf16: bool) -> str:
    """PTX of CONVERT = 3 for four packed bytes $4, the eight weights of K columns 8j..8j+7 (byte b
    holding columns 2b and 2b + 1): the word masked as it is puts the low nibbles of bytes 0 and 2
    (columns 8j and 8j + 4) in the halves of a 2 x 16-bit register, and shifted by 4, 8 and 12
    the next pairs, so no byte permutes: $0, $1 hold columns (0, 4), (1, 5) and $2, $3 columns
    (2, 6), (3, 7), as floats MAGIC_V + u (the offset is not subtracted: _mainloop_pairs)."""
    magic = "0x43004300" if bf16 else "0x64006400"
    body = []
    for shift, out in ((0, "$0"), (4, "$1"), (8, "$2"), (12, "$3")):
        src = "$4"
        if shift:
            body.append(f"shr.u32 t, $4, {shift};")
            src = "t"
        body.append(f"lop3.b32 {out}, {src}, 0x000F000F, {magic}, 0xEA;")
    return "{ .reg .b32 t; " + " ".join(body) + " }"


_PAIRS_BF16: tl.constexpr = tl.constexpr(_pairs_ptx_source(True))
_PAIRS_FP16: tl.constexpr = tl.constexpr(_pairs_ptx_source(False))
_PTX_BF16: tl.constexpr = tl.constexpr(_nibbles_ptx_source(True, False))
_PTX_BF16_SUB: tl.constexpr = tl.constexpr(_nibbles_ptx_source(True, True))
_PTX_FP16: tl.constexpr = tl.constexpr(_nibbles_ptx_source(False, False))
_PTX_FP16_SUB: tl.constexpr = tl.constexpr(_nibbles_ptx_source(False, True))


@triton.jit
def _nibbles_ptx(q, SUB: tl.constexpr, dtype: tl.constexpr):
    """(low, high) nibbles u of uint8 q [BK/2, BN] as dtype floats: MAGIC_V + u, or u - 8 when SUB."""
    if dtype == tl.bfloat16:
        lo, hi = tl.inline_asm_elementwise(_PTX_BF16_SUB if SUB else _PTX_BF16, "=r,=r,=r,=r,r", [q],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        lo, hi = tl.inline_asm_elementwise(_PTX_FP16_SUB if SUB else _PTX_FP16, "=r,=r,=r,=r,r", [q],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    return lo, hi


@triton.jit
def _pair_tiles(w_ptrs, kb, CONVERT: tl.constexpr, MAGIC: tl.constexpr, dt: tl.constexpr):
    """The int4 weights of a K tile as two dt tiles [BK/2, BN] of floats MAGIC_V + u (u the stored
    nibble, exact), rows in the paired order: of K columns 8j..8j+7 the first tile holds (0, 4, 1,
    5) at rows 4j..4j+3 and the second (2, 6, 3, 7). w_ptrs [BK/2, BN]: the tile's bytes (row kb
    of the tile at w_ptrs[kb]).

    CONVERT 3: the bytes loaded as they are and converted by inline PTX on whole registers
    (_pairs_ptx_source; CUDA only). 4, the twin on any device: row 4j + i of the first tile is the
    nibble i // 2 of byte 4j + 2 (i % 2), of the second of the byte after it, each loaded where
    it is."""
    if CONVERT == 3:
        q = tl.load(w_ptrs)
        if dt == tl.bfloat16:
            first, second = tl.inline_asm_elementwise(_PAIRS_BF16, "=r,=r,=r,=r,r", [q],
                                                      dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            first, second = tl.inline_asm_elementwise(_PAIRS_FP16, "=r,=r,=r,=r,r", [q],
                                                      dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        byte = (4 * (kb // 4) + 2 * (kb % 2) - kb)[:, None]  # the first tile's byte of row kb, from row kb's
        shift = (4 * ((kb % 4) // 2))[:, None].to(tl.uint8)
        first = _bits(((tl.load(w_ptrs + byte) >> shift) & 15).to(tl.int16), MAGIC, dt)
        second = _bits(((tl.load(w_ptrs + byte + 1) >> shift) & 15).to(tl.int16), MAGIC, dt)
    return first, second


@triton.jit
def _paired_halves(a, BM: tl.constexpr, BK: tl.constexpr):
    """The halves of each group of eight columns of a [BM, BK] rows stored in PAIRS_ORDER: the first
    (columns 0, 4, 1, 5 of the group) and the second (2, 6, 3, 7), _pair_tiles' weight rows.
    Reordered once more, stored position 4h + i lands at 2i + h: h is the minor index. In
    registers a thread holds the pairs of adjacent stored columns, so the split only picks whole
    32-bit registers (a row block's registers are regrouped for the products with moves)."""
    return tl.split(tl.reshape(to_pairs_order(a, BM, BK), [BM, BK // 2, 2]))


@triton.jit
def _cast_weights(q, zero, HAS_ZERO: tl.constexpr, OFFSET: tl.constexpr, NARROW: tl.constexpr, dtype: tl.constexpr):
    """Integer weights q minus their zero point [BN] (or the constant OFFSET), cast to dtype.
    NARROW: the difference fits int8, whose conversion to 16-bit floats Triton does with bit
    operations (wider integers take int-to-float instructions at a quarter of the issue rate)."""
    wide = tl.int8 if NARROW else tl.int16
    if HAS_ZERO:
        v = q.to(wide) - zero.to(wide)[None, :]
    elif OFFSET != 0:
        v = q.to(wide) - OFFSET
    else:
        v = q
    return v.to(dtype)


@triton.jit
def _weight_only_tiles(q, zero, W_INT4: tl.constexpr, HAS_ZERO: tl.constexpr, CONVERT: tl.constexpr,
                       MAGIC: tl.constexpr, MAGIC_V: tl.constexpr, dt: tl.constexpr):
    """Integer weights q minus their zero point (or offset) as dt floats, exact: (tile, tile) for
    8-bit weights [BK, BN]; for int4 bytes [BK/2, BN] (the low nibbles, the high nibbles): the
    even and the odd K rows (CONVERT: the module docstring)."""
    if not W_INT4:
        lo = _cast_weights(q, zero, HAS_ZERO, 0, not HAS_ZERO, dt)
        hi = lo
    elif CONVERT == 0:
        lo = _cast_weights(q & 15, zero, HAS_ZERO, 8, True, dt)
        hi = _cast_weights(q >> 4, zero, HAS_ZERO, 8, True, dt)
    elif CONVERT == 2:
        lo, hi = _nibbles_ptx(q, not HAS_ZERO, dt)
        if HAS_ZERO:
            sub = _bits(zero.to(tl.int16), MAGIC, dt)[None, :]  # MAGIC_V + z
            lo, hi = lo - sub, hi - sub
    else:
        # MAGIC_V + u from bits, then the offset or zero point subtracted in 16 bits (exact: small integers).
        if HAS_ZERO:
            sub = _bits(zero.to(tl.int16), MAGIC, dt)[None, :]  # MAGIC_V + z
        else:
            sub = tl.full([], MAGIC_V + 8.0, dt)
        lo = _bits((q & 15).to(tl.int16), MAGIC, dt) - sub
        hi = _bits((q >> 4).to(tl.int16), MAGIC, dt) - sub
    return lo, hi


@triton.jit
def _weight_only_product(acc, a, a_odd, q, zero, ws, W_INT4: tl.constexpr, HAS_ZERO: tl.constexpr,
                         CONVERT: tl.constexpr, MAGIC: tl.constexpr, MAGIC_V: tl.constexpr, FOLD_W: tl.constexpr):
    """acc + a [BM, BK'] @ ((q - zero or offset) * ws) [BK', BN] in fp32 for integer weights q and
    their K group's scales ws [1, BN]. FOLD_W: the scaled weights rounded to a's dtype, multiplied
    into acc; else the integer weights' product, scaled in fp32 and added."""
    dt = a.dtype
    lo, hi = _weight_only_tiles(q, zero, W_INT4, HAS_ZERO, CONVERT, MAGIC, MAGIC_V, dt)
    if FOLD_W:
        out = tl.dot(a, (lo * ws).to(dt), acc)
        if W_INT4:
            out = tl.dot(a_odd, (hi * ws).to(dt), out)
    else:
        part = tl.dot(a, lo)
        if W_INT4:
            part = tl.dot(a_odd, hi, part)
        out = acc + part * ws
    return out


@triton.jit
def _k_step(acc, a, a_odd, q, zero, ws, a_s,
            A_QUANT: tl.constexpr, A_KSCALE: tl.constexpr, W_KSCALE: tl.constexpr, W_INT4: tl.constexpr,
            HAS_ZERO: tl.constexpr, INT_DOT: tl.constexpr, CONVERT: tl.constexpr, MAGIC: tl.constexpr,
            MAGIC_V: tl.constexpr, SWAP: tl.constexpr, FOLD_W: tl.constexpr):
    """acc + a [BM, BK] @ W tile (the tile's K-group scales ws [1, BN] or one for the tile, a_s [BM]
    applied to its product).

    W_INT4: a holds the even and a_odd the odd columns of the K tile [BM, BK/2]; the tile's
    bytes [BK/2, BN] hold the matching low and high nibbles.
    """
    if A_QUANT == 0 and W_KSCALE:  # every weight-only scheme has weight groups
        out = _weight_only_product(acc, a, a_odd, q, zero, ws, W_INT4, HAS_ZERO, CONVERT, MAGIC, MAGIC_V, FOLD_W)
    elif A_KSCALE or W_KSCALE:
        part = tl.dot(a, q)
        if W_KSCALE:
            part = part * ws
        if A_KSCALE:
            part = part * a_s[:, None]
        out = acc + part
    elif INT_DOT:
        out = tl.dot(a, q, acc, out_dtype=tl.int32)
    elif SWAP:  # acc [BN, BM] += W tile^T a^T: the weight rows fill the MMA's 64-row side
        out = tl.dot(tl.trans(q), tl.trans(a), acc)
    else:
        out = tl.dot(a, q, acc)
    return out


@triton.jit
def _k_constant_scales(a_s_ptrs, a_ok, ws_ptrs, A_QUANT: tl.constexpr, A_KSCALE: tl.constexpr,
                       W_KSCALE: tl.constexpr):
    """The scales that are constant along K: per row (activations) and per column (weights), ones
    where a mode has none. Loaded before the K loop, so the epilogue does not wait for them."""
    a_s = tl.full(a_ok.shape, 1.0, tl.float32)
    if A_QUANT != 0 and not A_KSCALE:
        a_s = tl.load(a_s_ptrs, mask=a_ok, other=0.0)
    w_s = tl.full(ws_ptrs.shape, 1.0, tl.float32)
    if not W_KSCALE:
        w_s = tl.load(ws_ptrs)
    return a_s, w_s


@triton.jit
def _dequant(acc, a_s, w_s, A_QUANT: tl.constexpr, A_KSCALE: tl.constexpr, W_KSCALE: tl.constexpr):
    """The finished product times the K-constant scales a_s [BM] and w_s [BN] (_k_constant_scales)."""
    out = acc.to(tl.float32)
    if A_QUANT != 0 and not A_KSCALE:
        out = out * a_s[:, None]
    if not W_KSCALE:
        out = out * w_s[None, :]
    return out


@triton.jit
def _mainloop(a_row_ptrs, a_ok, a_s_ptrs, w_ptr, ws_ptr, wz_ptr, wrows, row0, up_off, k_lo, k_hi, K,
              stride_wn, stride_sn,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATED: tl.constexpr,
              A_QUANT: tl.constexpr, A_KSCALE: tl.constexpr, W_KSCALE: tl.constexpr, W_SROWS: tl.constexpr,
              W_INT4: tl.constexpr, HAS_ZERO: tl.constexpr, INT_DOT: tl.constexpr, KGROUP: tl.constexpr,
              EVEN_K: tl.constexpr, CONVERT: tl.constexpr, MAGIC: tl.constexpr, MAGIC_V: tl.constexpr,
              PREFETCH: tl.constexpr, INTERLEAVED: tl.constexpr, SWAP: tl.constexpr, FOLD_W: tl.constexpr):
    """Dequantized products over K columns [k_lo, k_hi) of rows a with one expert's weight rows
    `wrows` (and, GATED, rows wrows + up_off): returns (gate, up), fp32 [BM, BN] each (up = gate
    when not GATED).

    a_row_ptrs [BM]: each row's start; a_ok [BM]: live rows; a_s_ptrs [BM]: each row's
    activation scales. w_ptr, ws_ptr, wz_ptr: the expert's weights, scales, zero points.
    wrows [BN]: weight rows, all in range (the caller masks the columns it stores); row0: the
    tile's first gate row. INTERLEAVED: wrows alternate gate and up rows (GATED is False).
    Weight scales of W_SROWS-row blocks are one per tile and K group when a tile's gate (and up)
    rows lie in one block: scalars (two, gate and up, when INTERLEAVED), not a load per column.
    """
    kk = tl.arange(0, BK)
    a_ptrs = a_row_ptrs[:, None] + (k_lo + kk)[None, :]
    if W_INT4:
        kw = tl.arange(0, BK // 2)
        k_in_row = (k_lo // 2 + kw)[:, None]
        k_of_w = 2 * kw
    else:
        k_in_row = (k_lo + kk)[:, None]
        k_of_w = kk
    w_ptrs = w_ptr + wrows[None, :].to(tl.int64) * stride_wn + k_in_row
    wu_ptrs = w_ptr + (wrows + up_off)[None, :].to(tl.int64) * stride_wn + k_in_row
    ws_g = ws_ptr + (wrows // W_SROWS) * stride_sn
    wz_g = wz_ptr + (wrows // W_SROWS) * stride_sn
    ws_u = ws_ptr + ((wrows + up_off) // W_SROWS) * stride_sn
    wz_u = wz_ptr + ((wrows + up_off) // W_SROWS) * stride_sn
    block_g = ws_ptr + (row0 // W_SROWS) * stride_sn  # W_SROWS > 1: the tile's scale row, gate
    block_u = ws_ptr + ((row0 + up_off) // W_SROWS) * stride_sn  # and up
    odd = (tl.arange(0, BN) % 2 == 1)[None, :]
    if INT_DOT and not (A_KSCALE or W_KSCALE):
        acc_g = tl.zeros([BM, BN], dtype=tl.int32)
    elif SWAP:
        acc_g = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = acc_g
    a_s_row, ws_gate = _k_constant_scales(a_s_ptrs, a_ok, ws_g, A_QUANT, A_KSCALE, W_KSCALE)
    ws_up = ws_gate
    if GATED:  # the up rows' weight scales (A_QUANT 0: the activation scales are not loaded again)
        _, ws_up = _k_constant_scales(a_s_ptrs, a_ok, ws_u, 0, A_KSCALE, W_KSCALE)
    if PREFETCH:  # EVEN_K: every tile is whole
        a_next = tl.load(a_ptrs, mask=a_ok[:, None], other=0.0)
        qg_next = tl.load(w_ptrs)
        qu_next = qg_next
        if GATED:
            qu_next = tl.load(wu_ptrs)
    for k0 in range(k_lo, k_hi, BK):
        if PREFETCH:
            a = a_next
            q_g = qg_next
            q_u = qu_next
            more = (k0 + BK < k_hi).to(tl.int32)  # the last step reloads its own tile
            a_next = tl.load(a_ptrs + more * BK, mask=a_ok[:, None], other=0.0)
            if W_INT4:
                qg_next = tl.load(w_ptrs + more * (BK // 2))
            else:
                qg_next = tl.load(w_ptrs + more * BK)
            if GATED:
                if W_INT4:
                    qu_next = tl.load(wu_ptrs + more * (BK // 2))
                else:
                    qu_next = tl.load(wu_ptrs + more * BK)
        elif EVEN_K:
            a = tl.load(a_ptrs, mask=a_ok[:, None], other=0.0)
            q_g = tl.load(w_ptrs)
            q_u = q_g
            if GATED:
                q_u = tl.load(wu_ptrs)
        else:
            a = tl.load(a_ptrs, mask=a_ok[:, None] & (kk + k0 < K)[None, :], other=0.0)
            w_ok = (k_of_w + k0 < K)[:, None]
            q_g = tl.load(w_ptrs, mask=w_ok, other=0.0)
            q_u = q_g
            if GATED:
                q_u = tl.load(wu_ptrs, mask=w_ok, other=0.0)
        a_odd = a
        if A_QUANT == 0 and W_INT4:
            a, a_odd = tl.split(tl.reshape(a, [BM, BK // 2, 2]))
        kb = k0 // KGROUP
        a_s = tl.zeros([BM], dtype=tl.float32)
        if A_KSCALE:
            a_s = tl.load(a_s_ptrs + kb, mask=a_ok, other=0.0)
        ws = tl.zeros([1, BN], dtype=tl.float32)
        zero = tl.zeros([BN], dtype=tl.uint8)
        if W_KSCALE:
            if W_SROWS == 1 or BN > W_SROWS * (1 + INTERLEAVED):  # a scale per column, or tiles over blocks
                ws = tl.load(ws_g + kb)[None, :]
            elif INTERLEAVED:
                ws = tl.where(odd, tl.load(block_u + kb), tl.load(block_g + kb))
            else:
                ws = tl.load(block_g + kb) + ws
        if HAS_ZERO:
            zero = tl.load(wz_g + kb)
        acc_g = _k_step(acc_g, a, a_odd, q_g, zero, ws, a_s, A_QUANT, A_KSCALE, W_KSCALE, W_INT4, HAS_ZERO, INT_DOT,
                        CONVERT, MAGIC, MAGIC_V, SWAP, FOLD_W)
        if GATED:
            if W_KSCALE:
                if W_SROWS == 1 or BN > W_SROWS:
                    ws = tl.load(ws_u + kb)[None, :]
                else:
                    ws = tl.load(block_u + kb) + tl.zeros([1, BN], dtype=tl.float32)
            if HAS_ZERO:
                zero = tl.load(wz_u + kb)
            acc_u = _k_step(acc_u, a, a_odd, q_u, zero, ws, a_s, A_QUANT, A_KSCALE, W_KSCALE, W_INT4, HAS_ZERO, INT_DOT,
                            CONVERT, MAGIC, MAGIC_V, SWAP, FOLD_W)
        a_ptrs += BK
        if W_INT4:
            w_ptrs += BK // 2
            wu_ptrs += BK // 2
        else:
            w_ptrs += BK
            wu_ptrs += BK
    if SWAP:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    gate = _dequant(acc_g, a_s_row, ws_gate, A_QUANT, A_KSCALE, W_KSCALE)
    if GATED:
        up = _dequant(acc_u, a_s_row, ws_up, A_QUANT, A_KSCALE, W_KSCALE)
    else:
        up = gate
    return gate, up


@triton.jit
def _mainloop_pairs(a_row_ptrs, a_ok, sum_row_ptrs, w_ptr, ws_ptr, wz_ptr, wrows, k_lo, k_hi, stride_wn, stride_sn,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_ZERO: tl.constexpr,
                    KGROUP: tl.constexpr, SUM_G: tl.constexpr, CONVERT: tl.constexpr, MAGIC: tl.constexpr,
                    MAGIC_V: tl.constexpr):
    """The products of int4 weight-only schemes with CONVERT 3 / 4 (QuantKnobs.w_convert "pairs"),
    fp32 [BM, BN], over K columns [k_lo, k_hi) (whole weight groups).

    The activation rows a_row_ptrs [BM] are stored in the paired order (PAIRS_ORDER), so each K
    tile splits into the halves _pair_tiles' weight rows need by whole registers; the weights
    enter the products as MAGIC_V + u, the stored nibble u with the float bias left in, and each
    group's products, summed over its K tiles, are corrected once:
    (sum a (MAGIC_V + u) - (MAGIC_V + z) sum a) * s, z the zero point (8 when symmetric), with
    sum a the group's sums of the rows (sum_row_ptrs [BM]: SUM_G columns an entry). The
    subtraction per weight goes; a row-by-column correction per group comes instead.
    """
    dt: tl.constexpr = a_row_ptrs.dtype.element_ty
    a_ptrs = a_row_ptrs[:, None] + (k_lo + tl.arange(0, BK))[None, :]
    kw = tl.arange(0, BK // 2)
    w_ptrs = w_ptr + wrows[None, :].to(tl.int64) * stride_wn + (k_lo // 2 + kw)[:, None]
    ws_ptrs = ws_ptr + wrows * stride_sn
    wz_ptrs = wz_ptr + wrows * stride_sn
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kg in range(k_lo, k_hi, KGROUP):
        part = tl.zeros([BM, BN], dtype=tl.float32)
        for _ in tl.static_range(KGROUP // BK):
            a_first, a_second = _paired_halves(tl.load(a_ptrs, mask=a_ok[:, None], other=0.0), BM, BK)
            w_first, w_second = _pair_tiles(w_ptrs, kw, CONVERT, MAGIC, dt)
            part = tl.dot(a_first, w_first, part)
            part = tl.dot(a_second, w_second, part)
            a_ptrs += BK
            w_ptrs += BK // 2
        g = kg // KGROUP
        ws = tl.load(ws_ptrs + g)
        if HAS_ZERO:
            bias = tl.load(wz_ptrs + g).to(tl.float32) + MAGIC_V
        else:
            bias = tl.full([BN], MAGIC_V + 8.0, tl.float32)
        sums = tl.zeros([BM], dtype=tl.float32)
        for i in tl.static_range(KGROUP // SUM_G):
            sums += tl.load(sum_row_ptrs + g * (KGROUP // SUM_G) + i, mask=a_ok, other=0.0)
        acc += (part - sums[:, None] * bias[None, :]) * ws[None, :]
    return acc


@triton.jit
def _store_paired(out_ptr, sum_ptr, h, rows, pid_n, N, stride_om, stride_sum,
                  BM: tl.constexpr, BN: tl.constexpr, KGROUP: tl.constexpr, OUT_POLICY: tl.constexpr):
    """GEMM1's activation tile h [BM, BN] (buffer rows `rows`, columns pid_n * BN + ...; N a multiple
    of 8) stored for a GEMM2 with paired products: in PAIRS_ORDER, and the sums of the stored
    values in entries of min(BN, KGROUP) columns (sum_ptr: [rows, N / min(BN, KGROUP)] fp32)."""
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    hb = h.to(out_ptr.dtype.element_ty)
    hs = tl.where(col_ok[None, :], hb.to(tl.float32), 0.0)
    if BN > KGROUP:
        entry = pid_n * (BN // KGROUP) + tl.arange(0, BN // KGROUP)
        tl.store(sum_ptr + rows[:, None] * stride_sum + entry[None, :],
                 tl.sum(tl.reshape(hs, [BM, BN // KGROUP, KGROUP]), axis=2), mask=(entry * KGROUP < N)[None, :])
    else:
        tl.store(sum_ptr + rows * stride_sum + pid_n, tl.sum(hs, axis=1))
    # A group of eight columns lies wholly in or out of range (N % 8 == 0): the mask needs no reordering.
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], to_pairs_order(hb, BM, BN), mask=col_ok[None, :],
             eviction_policy=OUT_POLICY)


@triton.jit(do_not_specialize=["TK", "top_k", "NUM_M", "E"])
def gemm1_quant_kernel(
    a_ptr, a_s_ptr, w_ptr, ws_ptr, wz_ptr, b_ptr, out_ptr, out_s_ptr,
    topk_w_ptr, sorted_ptr, expert_end_ptr, src_ptr,
    N, K, TK, top_k, NUM_M, E,
    stride_am, stride_asm, stride_ase, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om, stride_sum,
    alpha, limit,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, ON_INPUT: tl.constexpr,
    A_QUANT: tl.constexpr, A_KSCALE: tl.constexpr, W_KSCALE: tl.constexpr, W_SROWS: tl.constexpr,
    W_INT4: tl.constexpr, HAS_ZERO: tl.constexpr, INT_DOT: tl.constexpr, KGROUP: tl.constexpr,
    A_BY_ASSIGN: tl.constexpr, OUT_STATIC: tl.constexpr,
    EVEN_K: tl.constexpr, CONVERT: tl.constexpr, MAGIC: tl.constexpr, MAGIC_V: tl.constexpr,
    PREFETCH: tl.constexpr, GATE_UP: tl.constexpr, PDL: tl.constexpr, SWAP: tl.constexpr, FOLD_W: tl.constexpr,
    OUT_POLICY: tl.constexpr = "",
):
    """act[row, n] = act(dequant(a[token] W13[e]^T) + b13[e])[n] for n < N (= I).

    a [T, K=H] (float, or quantized with a_s), or [T*k, K] rows of the assignments, assignment a
    reading row src[a] (A_BY_ASSIGN: static scales; triton_quant_rows, GRAN 4); w13 [E, 2N or N, K / pack]; b13 [E, 2N or N];
    out [R, N]: x's dtype, or fp8 quantized with the static scale out_s[e] (OUT_STATIC).
    CONVERT 3 / 4 (paired int4 products): a holds x in PAIRS_ORDER and a_s the sums of its weight
    groups [T, K / KGROUP]; out is written in PAIRS_ORDER and out_s [R, N / min(BN, KGROUP)] gets
    the sums of its rows for GEMM2 (_store_paired).
    PDL: launched as a programmatic dependent: waits for the previous kernels before reading
    anything they wrote, and lets the next kernel launch once its products are done.
    """
    if PDL:
        tl.extra.cuda.gdc_wait()
    pid_m, pid_n = _tile_ids(NUM_M, N, BN, GROUP_M)
    e = _block_expert(expert_end_ptr, pid_m, E, BM)
    if e >= E:  # past the last expert's rows
        return
    rows = tl.arange(0, BM)
    assign = tl.load(sorted_ptr + pid_m * BM + rows)
    live = assign < TK
    token = tl.where(live, assign // top_k, 0).to(tl.int64)
    w_row = tl.load(topk_w_ptr + assign, mask=live, other=0.0)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    e64 = e.to(tl.int64)
    if A_BY_ASSIGN:
        a_rows = tl.load(src_ptr + assign, mask=live, other=0).to(tl.int64)
    else:
        a_rows = token
    a_row_ptrs = a_ptr + a_rows * stride_am
    a_s_ptrs = a_s_ptr + e64 * stride_ase + a_rows * stride_asm
    w_e, ws_e, wz_e = w_ptr + e64 * stride_we, ws_ptr + e64 * stride_se, wz_ptr + e64 * stride_se
    # The epilogue's operands are loaded before the K loop, so it does not wait for them.
    b_gate, b_up = _gate_up_bias(b_ptr, e, cols, col_ok, N, stride_be, BN, HAS_BIAS, GATED)
    inv_out_s = 1.0
    if OUT_STATIC:  # one division a tile, a multiply per value
        inv_out_s = 1.0 / tl.load(out_s_ptr + e64)
    if GATED and GATE_UP:  # gate and up rows interleaved, one product
        c2 = tl.arange(0, 2 * BN)
        n2 = pid_n * BN + c2 // 2
        wrows = tl.where(n2 < N, n2, 0) + (c2 % 2) * N
        if CONVERT >= 3:  # paired int4 products
            acc = _mainloop_pairs(a_row_ptrs, live, a_s_ptrs, w_e, ws_e, wz_e, wrows, 0, K, stride_wn, stride_sn, BM,
                                  2 * BN, BK, HAS_ZERO, KGROUP, KGROUP, CONVERT, MAGIC, MAGIC_V)
        else:
            acc, _ = _mainloop(a_row_ptrs, live, a_s_ptrs, w_e, ws_e, wz_e, wrows, pid_n * BN, N, 0, K, K, stride_wn,
                               stride_sn, BM, 2 * BN, BK, False, A_QUANT, A_KSCALE, W_KSCALE, W_SROWS, W_INT4, HAS_ZERO,
                               INT_DOT, KGROUP, EVEN_K, CONVERT, MAGIC, MAGIC_V, PREFETCH, True, SWAP, FOLD_W)
        gate, up = tl.split(tl.reshape(acc, [BM, BN, 2]))
    elif CONVERT >= 3:  # paired int4 products, gate and up apart
        wrows = tl.where(col_ok, cols, 0)
        gate = _mainloop_pairs(a_row_ptrs, live, a_s_ptrs, w_e, ws_e, wz_e, wrows, 0, K, stride_wn, stride_sn,
                               BM, BN, BK, HAS_ZERO, KGROUP, KGROUP, CONVERT, MAGIC, MAGIC_V)
        up = gate
        if GATED:
            up = _mainloop_pairs(a_row_ptrs, live, a_s_ptrs, w_e, ws_e, wz_e, wrows + N, 0, K, stride_wn,
                                 stride_sn, BM, BN, BK, HAS_ZERO, KGROUP, KGROUP, CONVERT, MAGIC, MAGIC_V)
    else:
        gate, up = _mainloop(a_row_ptrs, live, a_s_ptrs, w_e, ws_e, wz_e, tl.where(col_ok, cols, 0), pid_n * BN, N,
                             0, K, K, stride_wn, stride_sn, BM, BN, BK, GATED, A_QUANT, A_KSCALE, W_KSCALE, W_SROWS,
                             W_INT4, HAS_ZERO, INT_DOT, KGROUP, EVEN_K, CONVERT, MAGIC, MAGIC_V, PREFETCH, False,
                             SWAP, FOLD_W)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # Quantized inputs had the routed weight applied before rounding. 8-bit activations: GEMM2's
    # input is rounded too (the fast sigmoid), and a static output scale folds into SiLU's.
    if GATED and ACT == "silu" and A_QUANT == 1:
        if HAS_BIAS:
            gate += b_gate[None, :]
            up += b_up[None, :]
        h = _silu_mul_scaled(gate, up, 1.0, inv_out_s, True)
    else:
        h = _gate_up_act(gate, up, w_row[:, None], b_gate[None, :], b_up[None, :], ACT, alpha, limit, GATED,
                         ON_INPUT and A_QUANT == 0, HAS_BIAS, A_QUANT == 1)
        if OUT_STATIC:
            h = h * inv_out_s
    o_ptrs = out_ptr + (pid_m * BM + rows).to(tl.int64)[:, None] * stride_om + cols[None, :]
    if CONVERT >= 3:
        _store_paired(out_ptr, out_s_ptr, h, (pid_m * BM + rows).to(tl.int64), pid_n, N, stride_om, stride_sum, BM, BN,
                      KGROUP, OUT_POLICY)
    elif OUT_STATIC:
        tl.store(o_ptrs, to_quant(h, 448.0, False), mask=col_ok[None, :], eviction_policy=OUT_POLICY)
    else:
        tl.store(o_ptrs, h.to(out_ptr.dtype.element_ty), mask=col_ok[None, :], eviction_policy=OUT_POLICY)


@triton.jit(do_not_specialize=["TK", "NUM_M", "E"])
def gemm2_quant_kernel(
    a_ptr, a_s_ptr, w_ptr, ws_ptr, wz_ptr, b_ptr, out_ptr,
    topk_w_ptr, sorted_ptr, expert_end_ptr,
    N, K, TK, NUM_M, E, K_SPLIT,
    stride_am, stride_asm, stride_ase, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_os, stride_om,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, ON_INPUT: tl.constexpr,
    A_QUANT: tl.constexpr, A_KSCALE: tl.constexpr, W_KSCALE: tl.constexpr, W_SROWS: tl.constexpr,
    W_INT4: tl.constexpr, HAS_ZERO: tl.constexpr, INT_DOT: tl.constexpr, KGROUP: tl.constexpr,
    EVEN_K: tl.constexpr, CONVERT: tl.constexpr, MAGIC: tl.constexpr, MAGIC_V: tl.constexpr,
    PREFETCH: tl.constexpr, PDL: tl.constexpr, SWAP: tl.constexpr, FOLD_W: tl.constexpr,
    OUT_POLICY: tl.constexpr = "", SUM_G: tl.constexpr = 1,
):
    """y[s, a, n] = w[a] * (dequant(act[row, Ks] W2[e, :, Ks]^T) + [s = 0] b2[e])[n] over split s's
    K columns Ks = [s K_SPLIT, (s + 1) K_SPLIT) (w left out when it went on the input).

    act [R, K=I] (float, or quantized with a_s indexed by row); w2 [E, N=H, K / pack];
    y [S, TK, N] (grid axis 1: the S splits). K_SPLIT is a multiple of BK. PDL: as GEMM1's.
    CONVERT 3 / 4 (paired int4 products): act in PAIRS_ORDER, a_s its rows' sums in entries of
    SUM_G columns (GEMM1's _store_paired); K_SPLIT a multiple of KGROUP.
    """
    if PDL:
        tl.extra.cuda.gdc_wait()
    pid_m, pid_n = _tile_ids(NUM_M, N, BN, GROUP_M)
    pid_s = tl.program_id(1)
    e = _block_expert(expert_end_ptr, pid_m, E, BM)
    if e >= E:  # past the last expert's rows
        return
    rows = tl.arange(0, BM)
    assign = tl.load(sorted_ptr + pid_m * BM + rows)
    live = assign < TK
    a_rows = (pid_m * BM + rows).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    e64 = e.to(tl.int64)
    k_lo = pid_s * K_SPLIT
    bias, route_w = _gemm2_operands(b_ptr, e, cols, col_ok & (cols * 0 + pid_s == 0), stride_be, topk_w_ptr, assign,
                                    live, BM, BN, HAS_BIAS, ON_INPUT)
    if CONVERT >= 3:  # paired int4 products
        acc = _mainloop_pairs(a_ptr + a_rows * stride_am, rows >= 0, a_s_ptr + a_rows * stride_asm,
                              w_ptr + e64 * stride_we, ws_ptr + e64 * stride_se, wz_ptr + e64 * stride_se,
                              tl.where(col_ok, cols, 0), k_lo, tl.minimum(K, k_lo + K_SPLIT), stride_wn, stride_sn,
                              BM, BN, BK, HAS_ZERO, KGROUP, SUM_G, CONVERT, MAGIC, MAGIC_V)
    else:
        acc, _ = _mainloop(
            a_ptr + a_rows * stride_am, rows >= 0, a_s_ptr + e64 * stride_ase + a_rows * stride_asm,
            w_ptr + e64 * stride_we, ws_ptr + e64 * stride_se, wz_ptr + e64 * stride_se, tl.where(col_ok, cols, 0),
            pid_n * BN, 0, k_lo, tl.minimum(K, k_lo + K_SPLIT), K, stride_wn, stride_sn, BM, BN, BK, False, A_QUANT,
            A_KSCALE, W_KSCALE, W_SROWS, W_INT4, HAS_ZERO, INT_DOT, KGROUP, EVEN_K, CONVERT, MAGIC, MAGIC_V, PREFETCH,
            False, SWAP, FOLD_W)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_BIAS:
        acc += bias[None, :]
    if not ON_INPUT:
        acc = acc * route_w[:, None]
    o_ptrs = (out_ptr + pid_s.to(tl.int64) * stride_os + tl.where(live, assign, 0).to(tl.int64)[:, None] * stride_om
              + cols[None, :])
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=live[:, None] & col_ok[None, :],
             eviction_policy=OUT_POLICY)
