"""`moekit demo`: transformers eager and moekit side by side on one MoE model; no download.

By default the model is a built-in tiny DeepSeek-V3 (grouped sigmoid routing with a
correction bias, routed scaling and a shared expert in every layer) built from a
transformers config with seeded random weights; `--model PATH` takes a local checkpoint
folder instead (transformers loads it for the eager run, moekit's own loader for moekit).
The demo checks that the logits match (fp32: 1e-5 relative, bf16/fp16: 2e-2), greedily
generates the same tokens with both (required identical in fp32) and prints tokens/s of that
generation (decode: one token a step; the median of --rounds generations, the two models taking
turns) and of one longer prompt's forward (prefill: many tokens a call, where the experts'
batched GEMMs matter; the median of 5, in turns), the backend the oracle chose for each MoE
layer and why, and the expert load per layer.
Exit status 0 only when every check passed.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Dict, List, Tuple

import torch

from moekit.cli.main import UsageError, installed

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The built-in model: DeepSeek-V3 structure at toy size (hidden 64, 2 MoE layers, 4 heads,
# vocab 128; 8 routed experts in 4 groups, 2 groups kept, top-2, one shared expert).
TINY_DEEPSEEK_V3 = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=128,
    max_position_embeddings=256, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
    num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=0,
    routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
)


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="transformers eager vs moekit on a tiny MoE model (or --model PATH)")
    p.add_argument("--model", default=None,
                   help="a local transformers checkpoint folder (default: the built-in tiny DeepSeek-V3)")
    p.add_argument("--tokens", type=int, default=32, help="tokens to generate greedily (default 32)")
    p.add_argument("--prompt-tokens", type=int, default=8, help="length of the random prompt (default 8)")
    p.add_argument("--prefill-tokens", type=int, default=256,
                   help="length of the prompt whose forward is timed for prefill tokens/s (default 256; 0: skip)")
    p.add_argument("--rounds", type=int, default=3,
                   help="timed generations per model, taking turns; the median is reported (default 3)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="model dtype (default float32)")
    p.add_argument("--backend", default="auto", help="moekit experts backend (default auto: the oracle picks)")
    p.add_argument("--seed", type=int, default=0, help="seed of the built-in model's weights and the prompt")
    p.set_defaults(func=run)


def tiny_deepseek_v3(seed: int = 0, dtype: torch.dtype = torch.float32):
    """The built-in model: a tiny DeepSeek-V3 *ForCausalLM with seeded random weights (eager experts)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415

    config = AutoConfig.for_model("deepseek_v3", **TINY_DEEPSEEK_V3)
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    with torch.no_grad():  # spread-out weights so routing is decisive (transformers' init is tiny)
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    return model.to(dtype).eval()


def _models(args, dtype):
    import moekit.hf as mh  # noqa: PLC0415

    if args.model is None:
        eager = tiny_deepseek_v3(args.seed, dtype)
        ours = copy.deepcopy(eager)
        try:  # an explicit backend that can never run the model's layers is refused here
            mh.patch_model(ours, backend=args.backend)
        except ValueError as err:
            raise UsageError(f"--backend {args.backend}: {err}") from None
        return eager, ours, "built-in tiny DeepSeek-V3"
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    try:  # moekit's loader first: a model it cannot patch or load is refused before the eager one is built
        ours = mh.from_pretrained(args.model, dtype=dtype, backend=args.backend)
    except ValueError as err:  # CheckpointError too
        raise UsageError(f"--model {args.model}: {err}") from None
    eager = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, experts_implementation="eager").eval()
    return eager, ours, args.model


class _Progress:
    """A transformers streamer that advances a tqdm bar by one per generated token."""

    def __init__(self, total: int, desc: str) -> None:
        from tqdm.auto import tqdm  # noqa: PLC0415 (a dependency of transformers)

        self.bar = tqdm(total=total, desc=desc, unit="tok", leave=False)
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:  # the first call carries the prompt
            self.prompt_seen = True
            return
        self.bar.update(1)

    def end(self) -> None:
        self.bar.close()


def _generate(model, prompt: torch.Tensor, n: int, desc: str) -> Tuple[torch.Tensor, float]:
    """Greedy ids [1, P + n] and the seconds it took."""
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0, streamer=_Progress(n, desc))
    return out, time.perf_counter() - start


def _median(xs: List[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _prefill_seconds(models, ids: torch.Tensor, repeats: int = 5) -> List[float]:
    """Median seconds of one forward over ids [1, P] per model, the models taking turns (so a
    slower stretch of a shared host falls on both), after a warm-up forward each."""
    times = [[] for _ in models]
    with torch.no_grad():
        for model in models:
            model(ids)
        for _ in range(repeats):
            for model, ts in zip(models, times):
                start = time.perf_counter()
                model(ids)
                ts.append(time.perf_counter() - start)
    return [_median(ts) for ts in times]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not (torch.isfinite(out).all() and torch.isfinite(ref).all()):
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _choices(model, dtype) -> Dict[str, object]:
    """The oracle's choice (backend and why) for each patched MoE layer, by name.

    Raises ValueError when an explicitly named backend cannot run a layer."""
    import moekit.hf as mh  # noqa: PLC0415
    from moekit.experts.api import problem_of  # noqa: PLC0415
    from moekit.oracle import choose_backend  # noqa: PLC0415

    choices = {}
    for name, block in mh.moe_blocks(model).items():
        moe = block.moe
        x = torch.empty(1, moe.hidden_size, dtype=dtype, device=moe.experts.w13.device)
        problem = problem_of(x, moe.experts.expert_weights(), moe.routing.top_k, moe.activation, False, False)
        choices[name] = choose_backend(problem, moe.runner.backend, owner=moe.layer_name)
    return choices


def _layer_reports(model, counts: Dict[str, torch.Tensor], dtype) -> List[Tuple[str, str, str, str]]:
    """(layer, backend, why, expert load) for each patched MoE layer."""
    return [(name, choice.backend.name, choice.reason, " ".join(str(int(c)) for c in counts[name].tolist()))
            for name, choice in _choices(model, dtype).items()]


def _count_routing(model) -> Tuple[Dict[str, torch.Tensor], list]:
    """Hooks that add each MoE layer's routed ids to a per-expert count."""
    import moekit.hf as mh  # noqa: PLC0415

    counts, handles = {}, []
    for name, block in mh.moe_blocks(model).items():
        counts[name] = torch.zeros(block.moe.num_experts, dtype=torch.long)

        def hook(module, inputs, output, name=name):
            ids = module.runner.last_topk.ids.flatten().long().cpu()
            counts[name] += torch.bincount(ids, minlength=counts[name].numel())

        handles.append(block.moe.register_forward_hook(hook))
    return counts, handles


def _table(rows: List[Tuple[str, ...]], header: Tuple[str, ...]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _check_args(args) -> None:
    if args.tokens < 1 or args.prompt_tokens < 1:
        raise UsageError(f"--tokens and --prompt-tokens must be >= 1, got {args.tokens} and {args.prompt_tokens}")
    if args.rounds < 1:
        raise UsageError(f"--rounds must be >= 1, got {args.rounds}")
    if args.prefill_tokens < 0:
        raise UsageError(f"--prefill-tokens must be >= 0 (0 skips the prefill timing), got {args.prefill_tokens}")
    if args.backend != "auto":
        from moekit.experts.base import get_backend  # noqa: PLC0415

        try:
            get_backend(args.backend)
        except ValueError as err:
            raise UsageError(f"--backend: {err}") from None
    if args.model is not None and not os.path.isfile(os.path.join(args.model, "config.json")):
        raise UsageError(f"--model must be a local checkpoint folder with config.json, got {args.model!r}")


def run(args) -> int:
    if not installed("transformers"):
        print("moekit demo needs Hugging Face transformers: pip install 'moekit[hf]'")
        return 2
    _check_args(args)
    dtype = DTYPES[args.dtype]
    eager, ours, label = _models(args, dtype)
    try:
        _choices(ours, dtype)
    except ValueError as err:
        raise UsageError(f"--backend {args.backend}: {err}") from None
    vocab = eager.config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(args.seed + 1))
    with torch.no_grad():
        err = _rel_err(ours(prompt).logits, eager(prompt).logits)
    tol = TOLERANCE[dtype]
    for model in (eager, ours):  # warm-up: first-call costs (kernel selection, caches) stay out of tokens/s
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
    times_eager, times_ours = [], []
    for r in range(args.rounds):  # the two take turns; each one's median round is reported
        ids, t = _generate(eager, prompt, args.tokens, "transformers eager")
        times_eager.append(t)
        if r == 0:
            ids_eager = ids
            counts, handles = _count_routing(ours)  # the first round's routing only
        ids, t = _generate(ours, prompt, args.tokens, "moekit")
        times_ours.append(t)
        if r == 0:
            ids_ours = ids
            for h in handles:
                h.remove()
    t_eager, t_ours = _median(times_eager), _median(times_ours)
    prefill = None
    if args.prefill_tokens:
        long_prompt = torch.randint(0, vocab, (1, args.prefill_tokens),
                                    generator=torch.Generator().manual_seed(args.seed + 2))
        prefill = _prefill_seconds((eager, ours), long_prompt)
    P = args.prompt_tokens
    same = int((ids_eager[0, P:] == ids_ours[0, P:]).sum())
    logits_ok = err <= tol
    ids_ok = same == args.tokens or dtype != torch.float32
    print(f"moekit demo: {label}, {args.dtype}, {args.tokens} tokens after a {P}-token prompt\n")
    print(_table([
        ("logits relative error", f"{err:.2e} (tolerance {tol:.0e})", "ok" if logits_ok else "FAILED"),
        ("greedy ids identical", f"{same}/{args.tokens}" + ("" if dtype == torch.float32 else " (required in fp32 only)"),
         "ok" if ids_ok else "FAILED"),
    ], ("check", "result", "")))
    print()
    speed = [["transformers eager", f"{args.tokens / t_eager:.1f}", "1.00x"],
             ["moekit", f"{args.tokens / t_ours:.1f}", f"{t_eager / t_ours:.2f}x"]]
    header = ("run", f"decode tokens/s (median of {args.rounds})", "vs eager")
    if prefill is not None:
        n = args.prefill_tokens
        speed[0] += [f"{n / prefill[0]:.0f}", "1.00x"]
        speed[1] += [f"{n / prefill[1]:.0f}", f"{prefill[0] / prefill[1]:.2f}x"]
        header += (f"prefill tokens/s ({n}-token prompt)", "vs eager")
    print(_table([tuple(r) for r in speed], header))
    print()
    print(_table(_layer_reports(ours, counts, dtype), ("MoE layer", "backend", "why", "tokens per expert")))
    passed = logits_ok and ids_ok
    print("\n" + ("all checks passed" if passed else "CHECKS FAILED"))
    return 0 if passed else 1
