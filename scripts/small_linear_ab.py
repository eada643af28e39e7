"""Times builds of csrc/small_linear.c against each other and MKL's (W @ x^T) over the bench checkpoint's linear
weights, interleaved passes, median of 9 per row count; also the largest difference from the first build's output.

  gcc -O3 -march=native -ffast-math -ffp-contract=off -fno-associative-math -fopenmp -fPIC -c -o new.o mmserve/kernels/csrc/small_linear.c
  gcc -shared -fopenmp -o new.so new.o -lm            # likewise old.so from `git show REV:mmserve/kernels/csrc/...`
  python scripts/small_linear_ab.py --rows 1,2,4,8,16 old=old.so new=new.so [--bf16]
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import statistics
import time

import torch
from safetensors.torch import load_file


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("libs", nargs="+", help="NAME=path/to/small_linear.so")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--model", default=os.path.expanduser("~/.cache/mmserve/bench-qwen2"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    state = {}
    for f in glob.glob(os.path.join(args.model, "*.safetensors")):
        state.update(load_file(f))
    weights = [v.to(dtype).contiguous() for k, v in state.items() if v.dim() == 2 and "embed" not in k]
    libs = {}
    for spec in args.libs:
        name, path = spec.split("=", 1)
        fn = ctypes.CDLL(os.path.abspath(path)).small_linear
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5
        libs[name] = fn
    code = int(args.bf16)
    print(f"{len(weights)} weights, {sum(w.numel() * w.element_size() for w in weights) / 1e6:.0f} MB, {dtype}")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, w.shape[1]).to(dtype) for w in weights]
        outs = {n: [torch.empty(rows, w.shape[0], dtype=dtype) for w in weights] for n in libs}
        names = [*libs, "mm_t"]
        times: dict[str, list[float]] = {n: [] for n in names}
        for round_ in range(11):
            for name in names:
                start = time.perf_counter()
                for i, (w, x) in enumerate(zip(weights, xs, strict=True)):
                    if name == "mm_t":
                        torch.mm(w, x.t())
                    else:
                        o = outs[name][i]
                        libs[name](x.data_ptr(), w.data_ptr(), None, o.data_ptr(), rows, w.shape[1], w.shape[0], code, 2)
                if round_ >= 2:  # two warm-up rounds
                    times[name].append(time.perf_counter() - start)
        first = outs[next(iter(libs))]
        diff = {n: max(float((a.float() - b.float()).abs().max()) for a, b in zip(first, outs[n], strict=True)) for n in libs}
        cells = "  ".join(f"{n} {statistics.median(t) * 1e3:.2f} ms" for n, t in times.items())
        print(f"rows {rows:3d}: {cells}  max diff {diff}")

if __name__ == "__main__":
    main()
