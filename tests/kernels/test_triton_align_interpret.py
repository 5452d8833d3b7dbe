"""The one-launch medium alignment (triton_align.align_medium) on CPU under Triton's interpreter.

Its rows are the one-program alignment's bit for bit (assignment order within an expert),
alone (moe_align) and in the quantization's launch (align_and_quantize), and the sorted
path runs end to end on it. TRITON_INTERPRET is read when moekit and the kernels are
imported, so the cases run in a child process (see triton_child). fp16/fp32 only: tl.dot on
bf16 operands returns wrong values in the interpreter.
"""

import pytest
import torch
import triton

from conftest import TOL, rel_err
from triton_child import IN_INTERPRETER, run_in_interpreter

if not IN_INTERPRETER:

    def test_medium_alignment_under_the_triton_interpreter():
        run_in_interpreter(__file__)

else:
    import moekit.kernels.launch as launch
    from moekit import fused_experts
    from moekit.experts.base import ExpertWeights
    from moekit.experts.reference import reference_experts
    from moekit.kernels import triton_align as align
    from moekit.kernels import triton_quant_rows as qr
    from moekit.kernels.launch import fused_moe, moe_align
    from moekit.kernels import quant_rows as quant_rows_module
    from moekit.kernels.quant_rows import align_and_quantize, modes_of, quant_rows
    from moekit.quant import TOLERANCE, emulated_experts, get_scheme, quantize_experts

    SMALL, MEDIUM, CHUNKED = dict(small_max=10**9), dict(small_max=0, medium_max=10**9), dict(small_max=0, medium_max=0)

    @pytest.fixture(autouse=True)
    def poisoned_buffers(monkeypatch):
        """Alignment buffers filled with -7 before the kernels run: a row or end a path fails to
        write cannot pass for one another run left in reused memory."""
        make = launch.alignment_buffers

        def poisoned(*args):
            al, e_pad = make(*args)
            al.sorted_ids.fill_(-7)
            al.expert_end.fill_(-7)
            return al, e_pad

        monkeypatch.setattr(launch, "alignment_buffers", poisoned)
        monkeypatch.setattr(quant_rows_module, "alignment_buffers", poisoned)

    def _routing(T, E_global, k, gen, skip=()):
        """Distinct experts per token from those not in `skip`; weights in (0, 1]."""
        pool = torch.tensor([e for e in range(E_global) if e not in skip])
        ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(T)])
        return torch.rand(T, k, generator=gen) + 0.05, ids.to(torch.int32)

    def _expert_map(E, n_remote, gen):
        """E local experts among E + n_remote global ones, the rest -1."""
        if not n_remote:
            return None
        emap = torch.full((E + n_remote,), -1, dtype=torch.int32)
        emap[torch.randperm(E + n_remote, generator=gen)[:E]] = torch.arange(E, dtype=torch.int32)
        return emap

    def _expected(ids, emap, E, bm):
        """Per expert its assignments in order, then sentinels (T*k) up to a multiple of bm."""
        flat = ids.reshape(-1).long()
        local = flat if emap is None else emap.long()[flat]
        rows, ends = [], []
        for e in range(E):
            mine = (local == e).nonzero().flatten().tolist()
            rows += mine + [flat.numel()] * (-len(mine) % bm)
            ends.append(len(rows))
        return rows, ends

    def _rows(al):
        """(the written rows, expert_end) of an Alignment as lists (rows past expert_end[-1] are unwritten)."""
        ends = al.expert_end.tolist()
        return al.sorted_ids[:ends[-1] if ends else 0].tolist(), ends

    def _same_sets(got, want):
        """Equal expert_end, and each expert's rows equal as sets (the chunked path's arrival order)."""
        (g_rows, g_ends), (w_rows, w_ends) = got, want
        assert g_ends == w_ends
        for lo, hi in zip([0] + w_ends[:-1], w_ends):
            assert sorted(g_rows[lo:hi]) == sorted(w_rows[lo:hi])

    class _Spy:
        """Wraps a kernel: records the grid (and ALIGN regime, if any) of each launch and forwards it."""

        def __init__(self, kernel):
            self.kernel, self.grids, self.regimes = kernel, [], []

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                self.grids.append(tuple(grid))
                self.regimes.append(kwargs.get("ALIGN"))
                return self.kernel[grid](*args, **kwargs)
            return run

    @pytest.mark.parametrize("T,E,k,bm,n_remote,mchunk,skip", [
        (100, 9, 3, 16, 0, 256, ()),        # two programs, TK not a multiple of MCHUNK, E not a power of two
        (50, 5, 2, 16, 3, 256, ()),         # TK < MCHUNK: one program; expert map with remote experts
        (64, 10, 2, 16, 0, 32, ()),         # TK a multiple of MCHUNK (four programs)
        (37, 70, 2, 64, 0, 32, ()),         # most experts empty, block_m 64
        (60, 6, 2, 16, 0, 32, (0, 4)),      # experts 0 and 4 get no token
        (40, 3, 3, 16, 0, 16, ()),          # k = E, more programs than experts (some own no expert)
        (233, 12, 4, 64, 4, 64, (5,)),      # fifteen programs, map, an expert with no token, block_m 64
        (64, 256, 8, 16, 0, 256, ()),       # E_PAD 512: MEDIUM_TILE // 512 assignments ranked per step
        (1, 8, 2, 16, 6, 16, "remote"),     # both slots remote: no rows at all
    ])
    def test_medium_rows_are_the_small_rows(T, E, k, bm, n_remote, mchunk, skip, gen):
        emap = _expert_map(E, n_remote, gen)
        if skip == "remote":
            ids = (emap < 0).nonzero().flatten()[:k].to(torch.int32).reshape(1, k)
        else:
            _, ids = _routing(T, E + n_remote, k, gen, skip)
        small = moe_align(ids, emap, E, bm, **SMALL)
        medium = moe_align(ids, emap, E, bm, **MEDIUM, mchunk=mchunk)
        assert _rows(medium) == _rows(small) == _expected(ids, emap, E, bm)
        assert medium.max_blocks * bm >= medium.expert_end[-1]
        _same_sets(_rows(moe_align(ids, emap, E, bm, **CHUNKED)), _rows(small))

    def test_thresholds_pick_the_regime(gen, monkeypatch):
        spies = {name: _Spy(getattr(align, name))
                 for name in ("align_small_kernel", "align_medium_kernel", "align_count_kernel")}
        for name, spy in spies.items():
            monkeypatch.setattr(align, name, spy)

        def launched(T, k):
            for spy in spies.values():
                spy.grids.clear()
            _, ids = _routing(T, 16, k, gen)
            al = moe_align(ids, None, 16, 16)
            rows, ends = _expected(ids, None, 16, 16)
            _same_sets(_rows(al), (rows, ends))
            return {name: spy.grids for name, spy in spies.items() if spy.grids}

        assert launched(128, 4) == {"align_small_kernel": [(1,)]}            # TK = SMALL
        assert launched(171, 3) == {"align_medium_kernel": [(3,)]}           # TK = 513: cdiv(513, 256)
        monkeypatch.setattr(launch, "ALIGN_MEDIUM_MAX", 600)                   # read at the call
        assert launched(150, 4) == {"align_medium_kernel": [(3,)]}           # TK = 600
        assert launched(151, 4) == {"align_count_kernel": [(1,)]}            # TK = 604: chunked

    @pytest.mark.parametrize("name,gran", [("int8_w8a8", 2), ("fp8_w8a8_block128", 3), ("fp8_w8a8", 4)])
    def test_quantization_launch_aligns_like_the_small_path(name, gran, gen, monkeypatch):
        T, E, k, H, n_remote = 90, 7, 3, 256, 3
        scheme = get_scheme(name)
        modes = modes_of(scheme)
        emap = _expert_map(E, n_remote, gen)
        _, ids = _routing(T, E + n_remote, k, gen, skip=(int((emap == 2).nonzero()),))  # local expert 2: no token
        x = torch.randn(T, H, generator=gen).half()
        group = scheme.activation_group if gran == 3 else 0
        if gran == 4:  # static per-expert scales; a row per local slot, or one per token (src)
            s = torch.rand(E, generator=gen) * 0.004 + 0.008
            s[:3] = 0.01
        else:
            s = torch.empty(T, 1 if gran == 2 else H // group, dtype=torch.float32)
        rows_q = T * k if gran == 4 else T

        spy = _Spy(qr.align_quant_kernel)
        monkeypatch.setattr(qr, "align_quant_kernel", spy)

        def run(fused, **regime):
            q = torch.zeros(rows_q, H, dtype=modes.act_dtype)
            ss = s if gran == 4 else torch.zeros_like(s)
            src = torch.full((T * k,), -1, dtype=torch.int32) if gran == 4 else None
            if fused:
                al = align_and_quantize(ids, emap, E, 16, x, q, ss, modes, gran, group, None, regime["small_max"],
                                        src=src, medium_max=regime["medium_max"], mchunk=64)
            else:
                al = moe_align(ids, emap, E, 16, **regime)
                quant_rows(x, q, ss, modes, gran, group, topk_ids=ids if gran == 4 else None,
                           expert_map=emap if gran == 4 else None, src=src)
            return _rows(al), q.float(), ss, src

        want = run(False, **SMALL)
        assert want[0] == _expected(ids, emap, E, 16)
        medium = run(True, **MEDIUM)
        assert medium[0] == want[0]
        chunked = run(True, **CHUNKED)
        _same_sets(chunked[0], want[0])
        assert spy.regimes == [align.REGIME_MEDIUM, align.REGIME_CHUNKED]
        assert spy.grids[0] == (triton.cdiv(T * k, 64) + T,)  # medium programs, then one per row (H <= 1024)
        for got in (medium, chunked):
            assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
            assert (got[3] is None) or torch.equal(got[3], want[3])

    def _problem(T, E, k, H, I, gen, n_remote=0):
        x = torch.randn(T, H, generator=gen)
        wts = ExpertWeights(torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5,
                            torch.randn(E, H, I, generator=gen) * I ** -0.5, None, None)
        emap = _expert_map(E, n_remote, gen)
        w, ids = _routing(T, E + n_remote, k, gen)
        return x, wts, w, ids, emap

    @pytest.mark.parametrize("medium_max", [None, 0])  # None: ALIGN_MEDIUM_MAX (medium); 0: chunked
    def test_sorted_path_end_to_end(medium_max, gen, monkeypatch):
        monkeypatch.setattr(launch, "ALIGN_SMALL_MAX", 0)
        if medium_max is not None:
            monkeypatch.setattr(launch, "ALIGN_MEDIUM_MAX", medium_max)
        spy = _Spy(align.align_medium_kernel)
        monkeypatch.setattr(align, "align_medium_kernel", spy)
        x, wts, w, ids, emap = _problem(70, 9, 3, 32, 16, gen, n_remote=2)
        out = fused_moe(x, wts.w13, wts.w2, None, None, w, ids, emap, "silu", direct=False)
        ref = reference_experts(x, wts, w, ids, activation="silu", expert_map=emap)
        assert bool(spy.grids) == (medium_max is None)
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
        assert rel_err(out, ref) <= TOL[torch.float32]

    def test_quantized_experts_end_to_end_on_the_medium_path(gen, monkeypatch):
        monkeypatch.setattr(launch, "ALIGN_SMALL_MAX", 0)
        spy = _Spy(qr.align_quant_kernel)
        monkeypatch.setattr(qr, "align_quant_kernel", spy)
        E, H, I = 6, 48, 40
        wts = quantize_experts(torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5,
                               torch.randn(E, H, I, generator=gen) * I ** -0.5, "int8_w8a8")
        w, ids = _routing(70, E, 3, gen)
        x = torch.randn(70, H, generator=gen).half()
        out = fused_experts(x, wts, None, w, ids, backend="triton")
        ref = emulated_experts(x, wts, w, ids)
        assert spy.regimes == [align.REGIME_MEDIUM]  # x quantized in the alignment's only launch
        assert rel_err(out, ref) <= TOLERANCE[get_scheme("int8_w8a8").precision]
