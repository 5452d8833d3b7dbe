"""GEMM1 of the 128 x 128 block scheme on cuBLAS (kernels/cublas_block.py), without the GPU.

The rule and the knob run here; the data flow around the products (the experts' counts, their
scales copied M-major, the per-expert views, the activation and its quantization) runs under
Triton's interpreter in a child process with the cuBLAS product replaced by its dequantized
fp32 emulation, which also checks the operand layouts cuBLAS wants. The GPU suite runs the real
products (tests/kernels/test_gluon_block_gpu.py).
"""

import pytest
import torch

from conftest import random_expert_map
from triton_child import IN_INTERPRETER, run_in_interpreter

pytest.importorskip("triton")

from moekit.kernels import cublas_block  # noqa: E402
from moekit.kernels.quant_tuning import QuantKnobs  # noqa: E402

if not IN_INTERPRETER:

    def test_cublas_gemm1_under_the_triton_interpreter():
        run_in_interpreter(__file__)

    def test_knob_validates_and_round_trips():
        assert QuantKnobs().cublas1 == "auto" and QuantKnobs().to_json() == {}
        assert QuantKnobs.from_json({"gluon": 128, "cublas1": "off"}) == QuantKnobs(gluon=128, cublas1="off")
        with pytest.raises(ValueError, match=r"cublas1 must be one of \['auto', 'on', 'off'\], got 'yes'"):
            QuantKnobs(cublas1="yes")

    def test_refused_off_hopper_and_the_rule_counts_rows_an_expert(monkeypatch):
        cpu = torch.device("cpu")
        assert "Hopper (compute capability 9.x), got cpu" in cublas_block.refusal(cpu, 7168, 2048)
        assert "H and 2I must be multiples of 512" in cublas_block.refusal(cpu, 768, 512)
        assert not cublas_block.wanted(16384, 8, 256, 7168, 2048, cpu)
        monkeypatch.setattr(cublas_block, "refusal", lambda device, H, I: None)
        E, k = 256, 8
        rows = cublas_block.CUBLAS_ROWS
        assert cublas_block.wanted(rows * E // k, k, E, 7168, 2048, cpu)
        assert not cublas_block.wanted(rows * E // k - 1, k, E, 7168, 2048, cpu)
        # products too short to hide their launches stay on the Gluon GEMM1 (Qwen3-30B-A3B, OLMoE)
        assert not cublas_block.wanted(16384, 8, 128, 2048, 768, cpu)  # 1024 rows an expert, 6.4 GFLOP
        assert not cublas_block.wanted(16384, 8, 64, 2048, 1024, cpu)  # 2048 rows, 17 GFLOP
        assert cublas_block.wanted(65536, 8, 64, 2048, 1024, cpu)  # 8192 rows, 69 GFLOP
        assert cublas_block.wanted(2048, 2, 8, 4096, 14336, cpu)  # Mixtral, 512 rows

    def test_explain_says_where_gemm1_runs_and_why(monkeypatch):
        assert "32 rows an expert, under 384" in cublas_block.explain(1024, 8, 256, 7168, 2048, None)
        assert "6.4 GFLOP, under 20" in cublas_block.explain(16384, 8, 128, 2048, 768, None)
        assert "(cuBLAS: no CUDA device here); on cuBLAS eagerly" in cublas_block.explain(16384, 8, 256, 7168, 2048, None)
        cpu = torch.device("cpu")
        assert "Hopper (compute capability 9.x), got cpu" in cublas_block.explain(16384, 8, 256, 7168, 2048, cpu)
        monkeypatch.setattr(cublas_block, "refusal", lambda device, H, I: None)
        assert cublas_block.explain(16384, 8, 256, 7168, 2048, cpu) == (
            "GEMM1 on cuBLAS (torch._scaled_mm) eagerly, on the Gluon kernel under CUDA-graph capture")

    def test_info_shows_the_gemm1_rule(capsys):
        from moekit.cli.main import main  # noqa: PLC0415

        assert main(["info", "--quant", "fp8_w8a8_block128", "--tiles", "deepseek-v3", "--device-name", "NVIDIA_H200",
                     "--M", "1024", "16384"]) == 0
        out = capsys.readouterr().out
        assert "GEMM1 on the Gluon kernel (cuBLAS: 32 rows an expert, under 384)" in out.split("M=  1024")[1]
        assert "on cuBLAS eagerly where it runs" in out.split("M= 16384")[1]

    def test_an_explicit_on_that_cannot_run_says_why():
        from moekit.kernels.launch_quant import _cublas_gemm1  # noqa: PLC0415

        with pytest.raises(ValueError, match="knobs.cublas1='on' cannot run this call's GEMM1 on cuBLAS: .*Hopper"):
            _cublas_gemm1("on", 4096, 8, 16, 1024, 512, torch.device("cpu"))
        assert not _cublas_gemm1("off", 1 << 20, 8, 16, 1024, 512, torch.device("cpu"))

else:
    from moekit.kernels.launch import moe_align
    from moekit.quant import quantize_experts

    def _block_scales(s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """[r/128, c/128] block scales -> [r, c]."""
        return s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]

    def _emulated_product(a, b, scale_a, scale_b, out_dtype, out):
        """torch._scaled_mm's block recipe in fp32, checking the layouts cuBLAS takes."""
        m, K = a.shape
        N = b.shape[1]
        assert a.dtype == b.dtype == torch.float8_e4m3fn and a.is_contiguous()
        assert b.stride() == (1, K), "w13[e].t(): column-major"
        assert scale_a.shape == (m, K // 128) and scale_a.stride() == (1, m), "1 x 128 scales M-major"
        assert scale_b.shape == (K // 128, N // 128) and scale_b.stride() == (1, K // 128)
        assert out.shape == (m, N) and out.is_contiguous() and out.dtype == out_dtype
        av = a.float() * scale_a.repeat_interleave(128, 1)
        bv = b.float() * _block_scales(scale_b, K, N)
        out.copy_(av @ bv)
        return out

    def _sorted_rows(xq, xs, al, T, k):
        """x's rows in sorted order, zeros on padding rows (gluon_block.gather_rows' contract)."""
        R = al.max_blocks * al.block_m
        sid = al.sorted_ids.long()
        live = (torch.arange(R) < int(al.expert_end[-1])) & (sid >= 0) & (sid < T * k)  # rows past the end: unwritten
        tok = torch.where(live, sid // k, T)  # row T: a zero row, so no tokens index safely too
        xq8 = torch.cat([xq.view(torch.uint8), xq.view(torch.uint8).new_zeros(1, xq.shape[1])])
        xs0 = torch.cat([xs, xs.new_zeros(1, xs.shape[1])])
        return xq8[tok].view(torch.float8_e4m3fn), xs0[tok]

    @pytest.mark.parametrize("T, k, E, n_remote, empty", [(0, 2, 3, 0, False), (1, 1, 2, 0, False), (5, 2, 4, 0, True),
                                                          (9, 3, 6, 3, False), (70, 4, 5, 2, True)])
    def test_gather_rows_writes_each_token_row_to_its_sorted_rows(T, k, E, n_remote, empty, gen):
        from moekit.kernels import gluon_block  # noqa: PLC0415

        H = 384  # three scale groups: not a power of two
        emap = random_expert_map(E, n_remote, gen)
        n_ids = E + n_remote
        first = 1 if empty else 0  # global id 0 never chosen: an expert (or a remote one) with no rows
        rows = [torch.randperm(n_ids - first, generator=gen)[:k] + first for _ in range(T)]
        ids = (torch.stack(rows) if rows else torch.empty(0, k, dtype=torch.long)).to(torch.int32)
        xq, xs = _quant_x(torch.randn(T, H, generator=gen))
        al = moe_align(ids, emap, E, 128)
        R = al.max_blocks * al.block_m
        got, got_s = gluon_block.gather_rows(xq, xs, al.sorted_ids, al.expert_end, k, R)
        want, want_s = _sorted_rows(xq, xs, al, T, k)
        end = int(al.expert_end[-1])
        assert got.shape == (R, H) and got_s.shape == (R, H // 128) and got.dtype == torch.float8_e4m3fn
        assert torch.equal(got[:end].view(torch.uint8), want[:end].view(torch.uint8))
        assert torch.equal(got_s[:end], want_s[:end])

    def _quant_x(x: torch.Tensor):
        g = x.float().view(x.shape[0], x.shape[1] // 128, 128)
        s = g.abs().amax(dim=2).clamp_min(1e-12) / 448.0
        return (g / s[..., None]).to(torch.float8_e4m3fn).view(x.shape), s

    @pytest.mark.parametrize("T, k, E, n_remote, empty, piece", [(5, 2, 4, 0, True, 0), (9, 3, 6, 3, False, 4),
                                                                (3, 1, 2, 0, True, 0), (70, 4, 5, 2, False, 12)])
    def test_gemm1_gives_the_quantized_activation_of_the_dequantized_product(T, k, E, n_remote, empty, piece, gen,
                                                                           monkeypatch):
        """piece: rows of a product at most (cublas_block.PIECE_ROWS; 0 = an expert's rows)."""
        monkeypatch.setattr(cublas_block, "_product", _emulated_product)
        monkeypatch.setattr(cublas_block, "PIECE_ROWS", piece)
        H, I = 512, 256
        w = quantize_experts(torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5,
                             torch.randn(E, H, I, generator=gen) * I ** -0.5, "fp8_w8a8_block128")
        emap = random_expert_map(E, n_remote, gen)
        n_ids = E + n_remote
        ids = torch.stack([torch.randperm(n_ids, generator=gen)[:k] for _ in range(T)])
        if empty:  # an expert with no rows: global id 0 never chosen
            ids = torch.stack([torch.randperm(n_ids - 1, generator=gen)[:k] + 1 for _ in range(T)])
        ids = ids.to(torch.int32)
        x = torch.randn(T, H, generator=gen).half()
        xq, xs = _quant_x(x)
        al = moe_align(ids, emap, E, 128)
        R = al.max_blocks * al.block_m
        a1s, a1s_s = _sorted_rows(xq, xs, al, T, k)
        a2, a2_s = cublas_block.gemm1(a1s, a1s_s, w.w13, w.scales["w13_scale"], ids, emap, al.sorted_ids,
                                      al.expert_end, torch.float16)
        assert a2.shape == (R, I) and a2.dtype == torch.float8_e4m3fn and a2_s.shape == (R, I // 128)
        end = int(al.expert_end[-1])
        w13 = torch.stack([w.w13[e].float() * _block_scales(w.scales["w13_scale"][e], 2 * I, H) for e in range(E)])
        xd = (xq.float().view(T, H // 128, 128) * xs[..., None]).view(T, H)
        starts = [0] + al.expert_end.tolist()[:-1]
        for r in range(end):
            a = int(al.sorted_ids[r])
            got = (a2[r].float().view(-1, 128) * a2_s[r][:, None]).view(-1)
            if a >= T * k:  # padding: zeros
                assert torch.equal(a2[r].float(), torch.zeros(I)) and torch.equal(a2_s[r], torch.ones(I // 128))
                continue
            e = max(i for i, s in enumerate(starts) if s <= r and int(al.expert_end[i]) > r)
            h = (xd[a // k] @ w13[e].t()).half().float()  # GEMM1's rows in x's dtype
            act = (h[:I] / (1 + torch.exp(-h[:I])) * h[I:]).half().float()
            assert float((got - act).norm() / act.norm()) <= 0.07  # e4m3: 3 mantissa bits
            # the quantization is quantize_rows': scale max|a| / 448 per 128 columns
            assert torch.allclose(a2_s[r], act.view(-1, 128).abs().amax(1) / 448.0, rtol=2e-3)
