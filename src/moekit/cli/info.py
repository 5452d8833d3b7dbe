"""`moekit info`: the machine, every backend, whether it can run here and why not, and what
the oracle would pick for a sample problem on each device; with --tiles SHAPE, the Triton
tiles a call of that shape takes at each M and where they come from (a tuned table's entry, a
rule measured on the H200, the heuristic)."""

from __future__ import annotations

import platform

import torch

import moekit
from moekit.activations import ACTIVATIONS
from moekit.cli.main import UsageError, installed
from moekit.experts.base import OPTIONAL_BACKENDS, ExpertsProblem
from moekit.oracle import available_backends, explain


TILE_MS = [1, 16, 64, 256, 1024, 4096, 16384]


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="backends available here and what the oracle picks")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="activation/weight dtype of the sample problem (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--quant", default=None, help="quantization scheme of the sample problem")
    p.add_argument("--activation", default="silu", choices=ACTIVATIONS,
                   help="activation of the sample problem (default silu)")
    p.add_argument("--tiles", default=None, metavar="SHAPE",
                   help="print the Triton tiles of SHAPE (a PERF.md shape name, or E,k,H,I) at each --M and where "
                        "they come from")
    p.add_argument("--M", type=int, nargs="+", default=None,
                   help=f"tokens, for --tiles (default {' '.join(map(str, TILE_MS))})")
    p.add_argument("--device-name", default=None,
                   help="for --tiles: the tables of this GPU (e.g. NVIDIA_H200; default: this machine's GPU)")
    p.set_defaults(func=run)


def _tiles_shape(text: str):
    from moekit.benchmarks.gpu import shape_by_name  # noqa: PLC0415

    if "," not in text:
        return shape_by_name(text)[1:]
    try:
        E, k, H, I = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--tiles must be a shape name or E,k,H,I (four integers), got {text!r}") from None
    if min(E, k, H, I) < 1 or k > E:
        raise ValueError(f"--tiles needs E, k, H, I >= 1 and k <= E, got {text!r}")
    return E, k, H, I


def print_tiles(text: str, Ms, dtype: torch.dtype, scheme, device) -> None:
    """The tiles of a call of shape `text` at each M on `device` (a device_name(), None: no GPU)."""
    from moekit.kernels.tuning import on_hopper, pick_config  # noqa: PLC0415

    E, k, H, I = _tiles_shape(text)
    where = device or "no CUDA device (the heuristic; --device-name reads a GPU's tables)"
    rules = "" if device is None or on_hopper(device) else " (no Hopper GPU here: without a table, no H200 rule)"
    print(f"\nTriton tiles for E={E}, k={k}, H={H}, I={I}, {str(dtype).replace('torch.', '')}"
          f"{', ' + scheme.name if scheme else ''} on {where}{rules}:")
    for M in Ms:
        if scheme is None:
            config, source = pick_config(M, E, k, H, I, dtype, device)
            extra = ""
        else:
            from moekit.kernels.launch_quant import pick_quant_tiles  # noqa: PLC0415
            from moekit.kernels.quant_rows import modes_of  # noqa: PLC0415

            config, knobs, source = pick_quant_tiles(M, E, k, H, I, dtype, device, scheme, modes_of(scheme))
            extra = f" knobs {knobs.to_json()}" if knobs.to_json() else ""
            if knobs.gluon and knobs.cublas1 == "auto":
                from moekit.kernels import cublas_block, hopper_block  # noqa: PLC0415

                here = torch.device("cuda") if torch.cuda.is_available() else None
                why_not = hopper_block.refusal(here, dtype, E, H, I, knobs.gluon) if here is not None else "no GPU"
                if why_not is None and knobs.cuda != "off":
                    extra += "\n      both GEMMs on moekit's CUDA kernels (kernels/hopper_block.py)"
                else:
                    extra += f"\n      {cublas_block.explain(M, k, E, H, I, here)}"
        print(f"  M={M:6d} ({M * k / E:8.1f} rows an expert): {source}\n      {config.to_json()}{extra}")


def _router_line() -> str:
    """Where route() runs here: one Triton launch on CUDA, torch ops elsewhere."""
    here = "torch ops on CPU tensors, under autograd and in torch.compile"
    if not torch.cuda.is_available():
        return here + "; one Triton launch on CUDA tensors (no CUDA here)"
    if not installed("triton"):
        return here + "; on CUDA too (triton is not installed: pip install 'moekit[gpu]')"
    return "one Triton launch on CUDA tensors (every variant but custom functions); " + here


def _devices():
    yield "cpu"
    if torch.cuda.is_available():
        yield "cuda"


def run(args) -> int:
    scheme = None
    if args.quant is not None:
        from moekit.quant import get_scheme  # noqa: PLC0415

        try:
            scheme = get_scheme(args.quant)
        except ValueError as err:
            raise UsageError(f"--quant: {err}") from None
    if args.tiles is None:
        unused = [flag for flag, v in (("--M", args.M), ("--device-name", args.device_name)) if v is not None]
        if unused:
            raise UsageError(f"without --tiles SHAPE, {' and '.join(unused)} would be ignored")
    else:
        args.M = args.M or TILE_MS
        if min(args.M) < 1:
            raise UsageError(f"--M must be >= 1, got {args.M}")
        try:
            _, _, H, I = _tiles_shape(args.tiles)  # before the report, not after it
            if scheme is not None:  # no tiles for a shape the scheme refuses
                from moekit.quant import check_fits  # noqa: PLC0415

                check_fits(scheme, H, I)
        except ValueError as err:
            raise UsageError(str(err)) from None
        if not installed("triton"):
            raise UsageError("--tiles needs Triton (the tile tables and rules): pip install 'moekit[gpu]'")
    print(f"moekit {moekit.__version__}  torch {torch.__version__}  python {platform.python_version()}")
    print(f"cpu: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    from moekit import native  # noqa: PLC0415

    print(f"native CPU kernels (cpu, cpu_int8, cpu_wo: decode and few-row calls): {native.status()}")
    if torch.cuda.is_available():
        print(f"cuda: {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()})")
    else:
        print("cuda: not available")
    print(f"router: {_router_line()}")
    try:
        from moekit.kernels import hopper_block  # noqa: PLC0415

        print(f"CUDA kernels (fp8_w8a8_block128 on Hopper, 128-row tiles): {hopper_block.describe()}")
    except ImportError:  # triton missing: the GPU kernels are not installed
        pass
    print("\nbackends (can it run on this machine?)")
    for name, reason in available_backends().items():
        desc = moekit.BACKENDS[name].description
        print(f"  {name:12s} {'yes' if reason is None else 'no: ' + reason}  -- {desc}")
    for name, needs in OPTIONAL_BACKENDS.items():
        if name not in moekit.BACKENDS:
            print(f"  {name:12s} no: not installed, it needs {needs}")
    for device in _devices():
        dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device == "cuda" else torch.float32)
        wdtype = dtype if scheme is None else scheme.storage_dtype()
        problem = ExpertsProblem(device, dtype, wdtype, args.activation, False, False, False, 64, 1024, 512, 8,
                                 quant=args.quant)
        print(f"\noracle for {problem.describe()}:")
        picked = False
        for name, reason in explain(problem):
            if reason is None and not picked:
                print(f"  -> {name}: chosen (first in the priority list that supports the call)")
                picked = True
            elif reason is None:
                print(f"     {name}: could run")
            else:
                print(f"     {name}: refused: {reason}")
        if not picked:
            print("  no backend can run this problem here")
        if scheme is not None:  # the backends outside this precision's list, and why they would not do
            listed = {name for name, _ in explain(problem)}
            print(f"  not in the {scheme.precision!r} priority list for {device} ({scheme.describe()}):")
            for name in sorted(set(moekit.BACKENDS) - listed):
                b = moekit.BACKENDS[name]
                reason = b.available() or b.unsupported(problem)
                print(f"     {name}: {'could run but is not listed' if reason is None else 'refused: ' + reason}")
    if args.tiles is not None:
        from moekit.kernels.tuning import device_name  # noqa: PLC0415

        device = args.device_name or (device_name() if torch.cuda.is_available() else None)
        try:
            print_tiles(args.tiles, args.M, getattr(torch, args.dtype) if args.dtype else torch.bfloat16, scheme, device)
        except ValueError as err:
            raise UsageError(str(err)) from None
    return 0
