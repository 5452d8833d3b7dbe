"""`moekit info`: the machine, every backend, whether it can run here and why not, and what
the oracle would pick for a sample problem on each device."""

from __future__ import annotations

import platform

import torch

import moekit
from moekit.experts.base import ExpertsProblem
from moekit.oracle import available_backends, explain


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="backends available here and what the oracle picks")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="activation/weight dtype of the sample problem (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--quant", default=None, help="quantization scheme of the sample problem")
    p.add_argument("--activation", default="silu")
    p.set_defaults(func=run)


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
            print(f"moekit info: {err}")
            return 2
    print(f"moekit {moekit.__version__}  torch {torch.__version__}  python {platform.python_version()}")
    print(f"cpu: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    if torch.cuda.is_available():
        print(f"cuda: {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()})")
    else:
        print("cuda: not available")
    print("\nbackends (can it run on this machine?)")
    for name, reason in available_backends().items():
        desc = moekit.BACKENDS[name].description
        print(f"  {name:12s} {'yes' if reason is None else 'no: ' + reason}  -- {desc}")
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
    return 0
