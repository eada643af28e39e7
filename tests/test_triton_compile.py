"""Every Triton kernel compiled to a cubin for sm_90 and sm_80 on the CPU (no GPU needed): paged attention
(single pass and split-KV, decode and chunk tiles), the split reduce and the KV store, at the constexprs and
launch options the engine's own launch code picks for each model's per-rank heads under tensor parallelism;
the MoE experts' kernels and the W4A16 linear kernel at real models' shapes, the same way.

How the launch values are derived: a fresh subprocess (TRITON_INTERPRET unset, so the kernels are real
`JITFunction`s and the modules' INTERPRETED flags are False for real, with no patching of them) calls the
engine's entry points `triton_cache.store_kv_cache` and `triton_attention.paged_attention` on CPU tensors
shaped as `qwen2.Attention` makes them. Each kernel object in the module is swapped for a recorder, so
`tile_config`, `make_launch_plan`, `choose_num_splits` and the BLOCK_T / BLOCK_R rules run unchanged and the
recorder catches exactly the arguments, constexprs, num_warps and num_stages of the launch. The only other
stand-in is `_num_sms` (no GPU to ask): the SM count of the GPU each arch is planned for. Triton's own binder
then turns the recorded arguments into the signature and specializations a real launch would compile
(pointer/int divisibility, ints equal to 1), and `triton.compile(ASTSource(...), target=GPUTarget(...))`
builds ttir -> ttgir -> llir -> ptx -> cubin with the bundled ptxas. Launches that agree on the engine's
constexprs, pointer dtypes and options are compiled once; `ptxas -v` (TRITON_DUMP_PTXAS_LOG) says whether a
kernel spills registers, which fails the test.

Why a subprocess: the tests run with TRITON_INTERPRET=1 (conftest), under which triton's own library
(tl.cdiv, tl.max, ...) is decorated for the interpreter, and code generation for a GPU target then fails
("'block_argument' object has no attribute 'dtype'" at the first tl.cdiv). One subprocess compiles every
case for the whole file and hands back JSON.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

# Compute capability -> SM count the split-KV heuristic plans with (H100/H200 SXM: 132, A100: 108).
ARCHS = {90: 132, 80: 108}
TP_SIZES = (1, 2, 4, 8)
DTYPES = ("bfloat16", "float32")  # bf16: the GPU default; fp32: the exact-dots path (DOT_FP32)
BLOCK_SIZE = 16  # the engine's default cache block size
STAGES = ("ttir", "ttgir", "llir", "ptx", "cubin")
# (name, head_dim, num_heads, num_kv_heads) of the whole model; tiny/bench as `mmserve.tiny_model` builds them
# (head_dim = hidden // heads there), the Qwen ones from their Hugging Face configs.
QWEN_MODELS = (
    ("qwen2-vl-2b", 128, 12, 2),
    ("qwen2-vl-7b", 128, 28, 4),
    ("qwen2.5-vl-72b", 128, 64, 8),
)

# Host batch lists (query_start_loc, seq_lens) of the batches each case runs, all with BLOCK_SIZE blocks:
# - decode: three decodes at short contexts -> the small (decode) tile, one pass (too few keys to split);
# - chunk: a 100-token prefill chunk from position 0 plus two decodes -> the chunk tile, one pass;
# - long-decode-<n>: one decode after n cached tokens -> split-KV + reduce; n = 512 * 2**k gives
#   num_splits = n // 256 = 2 .. 64 (_MAX_SPLITS), i.e. every SPLITS_POW2 the reduce can be launched with;
# - long-chunk: a 64-token chunk after 4096 cached tokens -> split-KV on the chunk tile + reduce.
BATCHES: dict[str, tuple[list[int], list[int]]] = {
    "decode": ([0, 1, 2, 3], [300, 200, 100]),
    "chunk": ([0, 100, 101, 102], [100, 250, 180]),
    **{f"long-decode-{n}": ([0, 1], [n + 1]) for n in (512 << k for k in range(6))},
    "long-chunk": ([0, 64], [4096 + 64]),
}
SPLIT_BATCHES = tuple(b for b in BATCHES if b.startswith("long-"))


def _models() -> list[tuple[str, int, int, int]]:
    from mmserve.tiny_model import PRESETS

    presets = [(name, p.hidden // p.heads, p.heads, p.kv_heads) for name, p in PRESETS.items()]
    # Qwen3's head_dim is set apart from hidden / heads: twice it in the presets (the bench one's is 128,
    # as the hub's Qwen3 / Qwen3-VL models', already covered by the Qwen2 ones below).
    tiny = PRESETS["tiny"]
    presets.append(("tiny-qwen3", 2 * tiny.hidden // tiny.heads, tiny.heads, tiny.kv_heads))
    return presets + list(QWEN_MODELS)


def _rank_heads(num_heads: int, num_kv_heads: int, tp: int) -> tuple[int, int] | None:
    """(query heads, KV heads) of one rank, as `qwen2.Attention` splits them; None if tp cannot split it."""
    from mmserve.models.parallel import kv_head_range

    try:
        _, kv = kv_head_range(num_heads, num_kv_heads, 0, tp)
    except ValueError:
        return None
    return num_heads // tp, kv


def _cases() -> list[dict]:
    cases = []
    for name, head_dim, heads, kv_heads in _models():
        for tp in TP_SIZES:
            rank = _rank_heads(heads, kv_heads, tp)
            if rank is None or (
                name == "tiny-qwen3" and tp > 1
            ):  # its new shape is head_dim; TP adds nothing
                continue
            for dtype in DTYPES:
                cases.append(
                    dict(
                        id=f"{name}-tp{tp}-{'bf16' if dtype == 'bfloat16' else 'fp32'}",
                        head_dim=head_dim,
                        num_heads=rank[0],
                        num_kv_heads=rank[1],
                        dtype=dtype,
                    )
                )
    # An FP8 KV cache (`--kv-cache-dtype fp8_e4m3 | fp8_e5m2`): its own kernel variants (codes decoded in the
    # kernel, the store's integer encoder), at the hub models' shapes on one rank: e4m3 on two of them,
    # e5m2 (another decode and encode, the same tiles) on the third.
    for name, head_dim, heads, kv_heads in QWEN_MODELS:
        for dtype in DTYPES:
            for kv_dtype in ("float8_e5m2",) if name == "qwen2-vl-7b" else ("float8_e4m3fn",):
                short = "e4m3" if kv_dtype == "float8_e4m3fn" else "e5m2"
                cases.append(
                    dict(
                        id=f"{name}-tp1-{'bf16' if dtype == 'bfloat16' else 'fp32'}-kv-{short}",
                        head_dim=head_dim,
                        num_heads=heads,
                        num_kv_heads=kv_heads,
                        dtype=dtype,
                        kv_cache_dtype=kv_dtype,
                    )
                )
    return cases


# ---------------------------------------------------------------------------------------------------------
# The compile subprocess (this file run as a script).


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch instead of running it."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, grid, args, kwargs))


def _record_launches(case: dict, num_sms: int) -> list[tuple[str, object, object, tuple, dict]]:
    """(batch, kernel, grid, args, kwargs) of every launch the engine makes for `case`'s batches on this GPU."""
    import torch

    from mmserve.kernels import triton_attention as ta
    from mmserve.kernels import triton_cache as tc

    kernels = (ta._paged_attention_kernel, ta._reduce_splits_kernel, tc._store_kv_cache_kernel, ta._num_sms)
    out: list[tuple[str, object, object, tuple, dict]] = []
    launches: list = []
    try:
        ta._paged_attention_kernel = _Recorder(kernels[0], launches)
        ta._reduce_splits_kernel = _Recorder(kernels[1], launches)
        tc._store_kv_cache_kernel = _Recorder(kernels[2], launches)
        ta._num_sms = lambda device: num_sms
        ta.make_launch_plan.cache_clear()  # its cache key has no SM count
        dtype = getattr(torch, case["dtype"])
        heads, kv_heads, hd = case["num_heads"], case["num_kv_heads"], case["head_dim"]
        for batch, (query_start_loc, seq_lens) in BATCHES.items():
            num_tokens = query_start_loc[-1]
            max_blocks = max(-(-n // BLOCK_SIZE) for n in seq_lens)
            # As qwen2.Attention: q and k come out of the rotary embedding contiguous, v is a view of qkv.
            qkv = torch.empty(num_tokens, (heads + 2 * kv_heads) * hd, dtype=dtype)
            q = torch.empty(num_tokens, heads, hd, dtype=dtype)
            k = torch.empty(num_tokens, kv_heads, hd, dtype=dtype)
            v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)[2].view(-1, kv_heads, hd)
            kv_dtype = getattr(torch, case.get("kv_cache_dtype", case["dtype"]))
            kv_cache = torch.empty(2, 4, BLOCK_SIZE, kv_heads, hd, dtype=kv_dtype)  # only its strides matter
            kv_scales = torch.ones(2, kv_heads)
            block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int64)
            slot_mapping = torch.zeros(num_tokens, dtype=torch.int64)
            tc.store_kv_cache(k, v, kv_cache, slot_mapping, kv_scales)
            ta.paged_attention(q, kv_cache, block_tables, query_start_loc, seq_lens, hd**-0.5, kv_scales)
            out += [(batch, *launch) for launch in launches]
            launches.clear()
    finally:
        ta._paged_attention_kernel, ta._reduce_splits_kernel, tc._store_kv_cache_kernel, ta._num_sms = kernels
        ta.make_launch_plan.cache_clear()
    return out


def _specialize(kernel, args: tuple, kwargs: dict, target):
    """What `JITFunction.run` hands `triton.compile` for these arguments (triton's own binder and packing)."""
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    return kernel._pack_args(backend, kwargs, bound_args, specialization, options)


_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


class _ThreadLog(io.TextIOBase):
    """sys.stdout while compiling: each thread's writes (ptxas's log) go to its own buffer."""

    def __init__(self) -> None:
        self.local = threading.local()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not hasattr(self.local, "buf"):
            self.local.buf = io.StringIO()
        return self.local.buf.write(text)

    def take(self) -> str:
        text = self.local.buf.getvalue() if hasattr(self.local, "buf") else ""
        self.local.buf = io.StringIO()
        return text


def _compile(kernel, signature, constexprs, attrs, options, target, log: _ThreadLog) -> dict:
    import triton
    from triton.compiler import ASTSource

    start = time.perf_counter()
    log.take()
    try:
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__
        )
    except Exception as e:
        return dict(ok=False, error=f"{type(e).__name__}: {e}"[-4000:], seconds=time.perf_counter() - start)
    ptxas = log.take()  # TRITON_DUMP_PTXAS_LOG=1 prints `ptxas -v` to stdout
    spills, registers = _SPILLS.search(ptxas), _REGISTERS.search(ptxas)
    return dict(
        ok=True,
        seconds=time.perf_counter() - start,
        stages=sorted(compiled.asm),
        cubin_bytes=len(compiled.asm.get("cubin", b"")),
        spill_bytes=int(spills[1]) + int(spills[2]) if spills else None,
        registers=int(registers[1]) if registers else None,
        shared=compiled.metadata.shared,
    )


def _describe(kernel, signature: dict, constexprs: dict, options, arch: int) -> str:
    names = kernel.arg_names
    consts = " ".join(f"{names[i[0]]}={v}" for i, v in sorted(constexprs.items()) if names[i[0]].isupper())
    ptrs = ",".join(sorted({t for t in signature.values() if t.startswith("*")}))
    return (
        f"{kernel.__name__} sm_{arch} {consts} ptrs={ptrs} "
        f"num_warps={options.num_warps} num_stages={options.num_stages}"
    )


def _compile_launches(
    cases: list[dict], record: Callable[[dict, int], list[tuple[str, object, object, tuple, dict]]]
) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """Every launch `record(case, num_sms)` makes (batch, kernel, grid, args, kwargs), per case and GPU,
    compiled once per distinct key: (launches per case id, compile result per key)."""
    from triton.backends.compiler import GPUTarget

    launches: dict[str, list[dict]] = {}
    todo: dict[str, tuple] = {}  # compile key -> what to compile
    for case in cases:
        launches[case["id"]] = []
        for arch, num_sms in ARCHS.items():
            target = GPUTarget("cuda", arch, 32)  # CUDA warps are 32 threads
            for batch, kernel, grid, args, kwargs in record(case, num_sms):
                options, signature, constexprs, attrs = _specialize(kernel, args, kwargs, target)
                names = kernel.arg_names
                # The engine's constexprs (upper case), pointer dtypes and launch options make the key; the
                # variants Triton adds for runtime ints (== 1, divisible by 16) at the same key are not
                # compiled again (the first one met is): they would more than double the compile time.
                values = {names[i[0]]: v for i, v in constexprs.items() if names[i[0]].isupper()}
                pointers = {k: v for k, v in signature.items() if v.startswith("*")}
                key = repr((kernel.__name__, arch, sorted(values.items()), sorted(pointers.items()), options))
                grid = list(grid) if isinstance(grid, tuple) else None  # a callable grid: decided at launch
                launches[case["id"]].append(
                    dict(batch=batch, kernel=kernel.__name__, arch=arch, key=key, grid=grid, **values)
                )
                todo.setdefault(key, (kernel, signature, constexprs, attrs, options, target))
    log = _ThreadLog()
    # Threads: ptxas runs as a subprocess and much of MLIR's work releases the GIL; Triton's own async
    # compile mode also compiles from an executor.
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool, contextlib.redirect_stdout(log):
        futures = {key: pool.submit(_compile, *job, log) for key, job in todo.items()}
        results = {key: future.result() for key, future in futures.items()}
    for key, (kernel, signature, constexprs, _, options, target) in todo.items():
        results[key]["desc"] = _describe(kernel, signature, constexprs, options, target.arch)
    return launches, results


def _main(cases_path: str, out_path: str) -> None:
    assert "TRITON_INTERPRET" not in os.environ
    from mmserve.kernels import triton_attention as ta
    from mmserve.kernels import triton_cache as tc

    start = time.perf_counter()
    launches, results = _compile_launches(json.loads(Path(cases_path).read_text()), _record_launches)
    report = dict(
        interpreted=[ta.INTERPRETED, tc.INTERPRETED],
        launches=launches,
        results=results,
        seconds=time.perf_counter() - start,
    )
    Path(out_path).write_text(json.dumps(report))


# ---------------------------------------------------------------------------------------------------------
# The tests (pytest process).

CASES = _cases()


def _compile_in_subprocess(tmp: Path, cases: list[dict], entry: str) -> dict:
    """Runs `entry` (`_main` or `_moe_main`) of this file in a fresh process without the interpreter (the
    GPU launch values, real compiles) over `cases`; its JSON report."""
    cases_path, out_path = tmp / "cases.json", tmp / "report.json"
    cases_path.write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp / "cache")  # a cold cache: every kernel is really compiled, ptxas runs
    env["TRITON_DUMP_PTXAS_LOG"] = "1"  # `ptxas -v` reports registers and spills
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), str(root), env.get("PYTHONPATH", "")])
    code = f"import sys, {Path(__file__).stem} as t; t.{entry}(sys.argv[1], sys.argv[2])"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(cases_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"compile subprocess failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(out_path.read_text())


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Runs the compile subprocess once over every case; its JSON report."""
    return _compile_in_subprocess(tmp_path_factory.mktemp("triton-compile"), CASES, "_main")


def test_launch_values_are_the_gpu_ones(report: dict) -> None:
    # tile_config & co. answered for a GPU, not for the interpreter.
    assert report["interpreted"] == [False, False]
    compiled = report["results"].values()
    print(f"\n{len(compiled)} distinct compiles in {report['seconds']:.1f} s")


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_engine_launches_compile(report: dict, case: dict) -> None:
    failures = _compile_failures(report, case["id"])
    assert not failures, "\n".join(dict.fromkeys(failures))


def _compile_failures(report: dict, case_id: str) -> list[str]:
    """What went wrong compiling each of a case's launches: an error, no cubin or a stage missing, no ptxas
    spill report, or register spills."""
    failures = []
    for launch in report["launches"][case_id]:
        result = report["results"][launch["key"]]
        where = f"{launch['batch']}: {result['desc']}"
        if not result["ok"]:
            failures.append(f"{where}\n  {result['error']}")
        elif not result["cubin_bytes"] or not set(STAGES) <= set(result["stages"]):
            failures.append(
                f"{where}\n  no cubin ({result['cubin_bytes']} bytes) or stages missing: {result['stages']}"
            )
        elif result["spill_bytes"] is None:
            failures.append(f"{where}\n  no spill report in the ptxas log")
        elif result["spill_bytes"]:
            failures.append(
                f"{where}\n  spills {result['spill_bytes']} bytes ({result['registers']} registers)"
            )
    return failures


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_every_path_was_launched(report: dict, case: dict) -> None:
    """The batches reached what they were chosen for, on both archs: one pass on the decode and chunk tiles,
    split-KV on both tiles with every SPLITS_POW2 up to 64, a store per batch."""
    from mmserve.kernels.triton_attention import _MAX_SPLITS

    launches = report["launches"][case["id"]]
    for arch in ARCHS:
        mine = [x for x in launches if x["arch"] == arch]
        attn = {x["batch"]: x for x in mine if x["kernel"] == "_paged_attention_kernel"}
        assert set(attn) == set(BATCHES)
        assert not attn["decode"]["SPLIT"] and not attn["chunk"]["SPLIT"]
        assert all(attn[b]["SPLIT"] for b in SPLIT_BATCHES)
        assert attn["long-chunk"]["BLOCK_M"] == attn["chunk"]["BLOCK_M"]
        # fp32 keeps the decode tile for chunks on a GPU (its exact dots spill otherwise).
        if case["dtype"] == "bfloat16":
            assert attn["chunk"]["BLOCK_M"] > attn["decode"]["BLOCK_M"]
        reduces = [x for x in mine if x["kernel"] == "_reduce_splits_kernel"]
        assert sorted(x["batch"] for x in reduces) == sorted(SPLIT_BATCHES)
        pow2 = {x["SPLITS_POW2"] for x in reduces if x["batch"].startswith("long-decode")}
        assert pow2 == {2**k for k in range(1, _MAX_SPLITS.bit_length())}
        assert sum(x["kernel"] == "_store_kv_cache_kernel" for x in mine) == len(BATCHES)


# ---------------------------------------------------------------------------------------------------------
# The MoE kernels (`triton_moe`): the same recorder, binder and compile path, from their own subprocess
# (`_moe_main`).

# (name, hidden, moe_intermediate, num_experts, top_k) from the Hugging Face configs; Qwen3-VL-30B-A3B and
# Qwen3-VL-235B-A22B have the same text-model experts as their Qwen3 namesakes.
MOE_MODELS = (
    ("qwen3-30b-a3b", 2048, 768, 128, 8),
    ("qwen3-235b-a22b", 4096, 1536, 128, 8),
)
MOE_DTYPES = ("bfloat16", "float16", "float32")
# Tokens per batch: a decode batch (a few rows per expert: the 16-row tile) and a prefill (the larger tile).
MOE_BATCHES = {"decode": 4, "prefill": 512}
_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _moe_cases() -> list[dict]:
    """Each model at each TP size whose rank gets a whole slice of the intermediate size."""
    return [
        dict(
            id=f"{name}-tp{tp}-{_SHORT[dtype]}",
            hidden=hidden,
            intermediate=intermediate // tp,
            num_experts=num_experts,
            top_k=top_k,
            dtype=dtype,
        )
        for name, hidden, intermediate, num_experts, top_k in MOE_MODELS
        for tp in TP_SIZES
        if intermediate % tp == 0
        for dtype in MOE_DTYPES
    ]


def _record_moe_launches(case: dict) -> list[tuple[str, object, object, tuple, dict]]:
    """(batch, kernel, grid, args, kwargs) of every launch `triton_moe.fused_moe` makes for `case`'s batches."""
    import torch

    from mmserve.kernels import triton_moe as tm

    kernels = (tm._fused_moe_kernel, tm._silu_and_mul_kernel)
    out: list[tuple[str, object, object, tuple, dict]] = []
    launches: list = []
    try:
        tm._fused_moe_kernel = _Recorder(kernels[0], launches)
        tm._silu_and_mul_kernel = _Recorder(kernels[1], launches)
        dtype = getattr(torch, case["dtype"])
        hidden, inter, experts, top_k = (
            case["hidden"],
            case["intermediate"],
            case["num_experts"],
            case["top_k"],
        )
        # Weights as the loader makes them: contiguous [E, 2I, H] and [E, H, I] (torch.empty only reserves
        # address space; nothing touches it).
        w_gate_up = torch.empty(experts, 2 * inter, hidden, dtype=dtype)
        w_down = torch.empty(experts, hidden, inter, dtype=dtype)
        for batch, num_tokens in MOE_BATCHES.items():
            x = torch.empty(num_tokens, hidden, dtype=dtype)
            topk_weights = torch.empty(num_tokens, top_k, dtype=dtype)
            topk_ids = torch.arange(num_tokens * top_k).remainder(experts).view(num_tokens, top_k)
            tm.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
            out += [(batch, *launch) for launch in launches]
            launches.clear()
    finally:
        tm._fused_moe_kernel, tm._silu_and_mul_kernel = kernels
    return out


def _moe_main(cases_path: str, out_path: str) -> None:
    assert "TRITON_INTERPRET" not in os.environ
    from mmserve.kernels import triton_moe as tm

    start = time.perf_counter()
    cases = json.loads(Path(cases_path).read_text())
    launches, results = _compile_launches(cases, lambda case, _num_sms: _record_moe_launches(case))
    report = dict(
        interpreted=tm.INTERPRETED, launches=launches, results=results, seconds=time.perf_counter() - start
    )
    Path(out_path).write_text(json.dumps(report))


MOE_CASES = _moe_cases()


@pytest.fixture(scope="module")
def moe_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Runs the MoE compile subprocess once over every MoE case; its JSON report."""
    return _compile_in_subprocess(tmp_path_factory.mktemp("triton-moe-compile"), MOE_CASES, "_moe_main")


def test_moe_launch_values_are_the_gpu_ones(moe_report: dict) -> None:
    assert moe_report["interpreted"] is False
    print(f"\n{len(moe_report['results'])} distinct MoE compiles in {moe_report['seconds']:.1f} s")


@pytest.mark.parametrize("case", MOE_CASES, ids=[c["id"] for c in MOE_CASES])
def test_moe_launches_compile(moe_report: dict, case: dict) -> None:
    failures = _compile_failures(moe_report, case["id"])
    assert not failures, "\n".join(dict.fromkeys(failures))


@pytest.mark.parametrize("case", MOE_CASES, ids=[c["id"] for c in MOE_CASES])
def test_every_moe_path_was_launched(moe_report: dict, case: dict) -> None:
    """Per arch and batch: a gate_up launch, a silu-and-mul, a down launch with the routing weight; the
    decode batch on the 16-row tile, the prefill on a larger one."""
    launches = moe_report["launches"][case["id"]]
    for arch in ARCHS:
        for batch in MOE_BATCHES:
            mine = [x for x in launches if x["arch"] == arch and x["batch"] == batch]
            assert [x["kernel"] for x in mine] == [
                "_fused_moe_kernel",
                "_silu_and_mul_kernel",
                "_fused_moe_kernel",
            ]
            assert [mine[0]["MUL_ROUTED_WEIGHT"], mine[2]["MUL_ROUTED_WEIGHT"]] == [False, True]
            assert mine[0]["DOT_FP32"] == (case["dtype"] == "float32")
            assert (mine[0]["BLOCK_M"] == 16) == (batch == "decode")


# ---------------------------------------------------------------------------------------------------------
# The W4A16 linear kernel (`triton_w4a16`): the same recorder, binder and compile path (`_w4a16_main`), at
# the launches `triton_w4a16.w4a16_linear` makes for a Qwen2-VL decoder layer's int4 projections.

W4A16_MODELS = (("qwen2-vl-2b", 1536, 8960, 12, 2, 128), ("qwen2-vl-7b", 3584, 18944, 28, 4, 128))
# (name, group_size, zero points): GPTQ-style symmetric and AWQ-style asymmetric, both with groups of 128.
W4A16_SCHEMES = (("sym-g128", 128, False), ("asym-g128", 128, True))
W4A16_ROWS = {"decode": 8, "prefill": 512}


def _w4a16_layers(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """layer -> (N, K, bias) of a Qwen2 decoder layer (q/k/v fused, gate/up fused)."""
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden, True),
        "o": (hidden, heads * head_dim, False),
        "gate_up": (2 * intermediate, hidden, False),
        "down": (hidden, intermediate, False),
    }


def _w4a16_cases() -> list[dict]:
    cases = [
        dict(id=f"{model[0]}-{scheme}-{_SHORT[dtype]}", model=model, group_size=g, zeros=z, dtype=dtype,
             rows=W4A16_ROWS)
        for model in W4A16_MODELS
        for scheme, g, z in W4A16_SCHEMES
        for dtype in ("bfloat16", "float16")
    ]
    # Groups of 32 (the K step shrinks to a group), the middle M tiles, and fp32's exact dots.
    small = W4A16_MODELS[0]
    cases += [
        dict(id="qwen2-vl-2b-asym-g32-bf16", model=small, group_size=32, zeros=True, dtype="bfloat16",
             rows=W4A16_ROWS),
        dict(id="qwen2-vl-2b-asym-g128-bf16-m32-m64", model=small, group_size=128, zeros=True, dtype="bfloat16",
             rows={"m32": 32, "m64": 64}),
        dict(id="qwen2-vl-2b-sym-g128-fp32", model=small, group_size=128, zeros=False, dtype="float32",
             rows=W4A16_ROWS),
    ]  # fmt: skip
    return cases


def _record_w4a16_launches(case: dict, num_sms: int) -> list[tuple[str, object, object, tuple, dict]]:
    """("layer rows", kernel, grid, args, kwargs) of every launch the entry point makes for the case's layers."""
    import torch

    from mmserve.kernels import triton_w4a16 as tw

    kernel, num_sms_fn = tw._w4a16_kernel, tw._num_sms
    launches: list = []
    out: list[tuple[str, object, object, tuple, dict]] = []
    try:
        tw._w4a16_kernel = _Recorder(kernel, launches)
        tw._num_sms = lambda device: num_sms
        dtype = getattr(torch, case["dtype"])
        g = case["group_size"]
        for layer, (n, k, has_bias) in _w4a16_layers(*case["model"][1:]).items():
            # As a loader makes them (torch.empty only reserves address space: nothing touches it).
            qweight = torch.empty(n, k // 8, dtype=torch.int32)
            scales = torch.empty(n, k // g, dtype=dtype)
            zeros = torch.empty(n, k // g, dtype=torch.uint8) if case["zeros"] else None
            bias = torch.empty(n, dtype=dtype) if has_bias else None
            for rows_name, m in case["rows"].items():
                tw.w4a16_linear(torch.empty(m, k, dtype=dtype), qweight, scales, zeros, g, bias)
                out += [(f"{layer} {rows_name}", *launch) for launch in launches]
                launches.clear()
    finally:
        tw._w4a16_kernel, tw._num_sms = kernel, num_sms_fn
    return out


def _w4a16_main(cases_path: str, out_path: str) -> None:
    assert "TRITON_INTERPRET" not in os.environ
    from mmserve.kernels import triton_w4a16 as tw

    start = time.perf_counter()
    launches, results = _compile_launches(json.loads(Path(cases_path).read_text()), _record_w4a16_launches)
    report = dict(
        interpreted=tw.INTERPRETED, launches=launches, results=results, seconds=time.perf_counter() - start
    )
    Path(out_path).write_text(json.dumps(report))


W4A16_CASES = _w4a16_cases()


@pytest.fixture(scope="module")
def w4a16_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _compile_in_subprocess(tmp_path_factory.mktemp("triton-w4a16-compile"), W4A16_CASES, "_w4a16_main")


def test_w4a16_launch_values_are_the_gpu_ones(w4a16_report: dict) -> None:
    assert w4a16_report["interpreted"] is False
    print(f"\n{len(w4a16_report['results'])} distinct W4A16 compiles in {w4a16_report['seconds']:.1f} s")


@pytest.mark.parametrize("case", W4A16_CASES, ids=[c["id"] for c in W4A16_CASES])
def test_w4a16_launches_compile(w4a16_report: dict, case: dict) -> None:
    failures = _compile_failures(w4a16_report, case["id"])
    assert not failures, "\n".join(dict.fromkeys(failures))


@pytest.mark.parametrize("case", W4A16_CASES, ids=[c["id"] for c in W4A16_CASES])
def test_w4a16_launches_fit_the_batch(w4a16_report: dict, case: dict) -> None:
    """Decode on the 16-row tile, prefill on the 64-row one; every layer launched on both archs; the K split
    only at decode and only where a layer's output tiles leave SMs idle."""
    launches = w4a16_report["launches"][case["id"]]
    assert len(launches) == len(ARCHS) * 4 * len(case["rows"])
    for launch in launches:
        layer, rows = launch["batch"].split()
        if rows == "decode":
            assert launch["BLOCK_M"] == 16
        if rows == "prefill":
            assert launch["BLOCK_M"] == (32 if case["dtype"] == "float32" else 64)
            assert launch["grid"][2] == 1
        assert launch["GROUP_K"] and case["group_size"] % launch["BLOCK_K"] == 0
        assert launch["HAS_ZEROS"] == case["zeros"] and launch["HAS_BIAS"] == (layer == "qkv")
        tiles = launch["grid"][0] * launch["grid"][1]
        assert launch["grid"][2] == 1 or tiles < ARCHS[launch["arch"]]
