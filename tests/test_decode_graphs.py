"""Decode steps replayed from graphs over static buffers (engine/decode_graphs.py): off CUDA in the "static"
mode (the same batch object run again, with the Triton attention in the interpreter), whose greedy tokens and
logprobs must equal the eager engine's exactly, through batch-size changes, media rows, preemption and prefix
hits; the pad rows' writes; the mode's choice; and, on a CUDA device, real captured graphs against eager."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from mmserve.config import EngineArgs
from mmserve.engine.decode_graphs import DecodeGraphs, choose_mode, default_capture_sizes
from mmserve.errors import InvalidRequestError
from mmserve.models.forward_batch import ForwardBatch

ASSETS = Path(__file__).resolve().parent.parent / "assets"
PROMPTS = ["hello there", "a b c d e f g", "the quick brown fox jumps over", "x"]
MAX_TOKENS = (3, 9, 6, 12)  # finishing at different steps: decode batches of 4, 3, 2 and 1


@pytest.fixture
def triton_attention(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The graph-safe attention: Triton's, in the interpreter on the CPU (the conftest sets it up)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("MMSERVE_ATTENTION_BACKEND", "triton")
    yield


def _assert_logprobs_equal(eager: list, replayed: list) -> None:
    """Exactly on the CPU where every row count takes the C linear kernel (each row computed alone: the conftest's
    choice where a compiler exists); else within rounding: a padded batch's row count may take another product
    (cuBLAS too), and on a GPU the graph's key split, fixed for the longest context, merges in another order."""
    exact = os.environ.get("MMSERVE_CPU_LINEAR") == "c" and not torch.cuda.is_available()
    for eager_lps, replayed_lps in zip(eager, replayed, strict=True):
        for a, b in zip(eager_lps, replayed_lps, strict=True):
            assert a.keys() == b.keys()
            assert all(a[t] == b[t] if exact else abs(a[t] - b[t]) < 1e-4 for t in a), (a, b)


def _run(model: Path, mode: str, monkeypatch: pytest.MonkeyPatch, prompts: list, params: list, **engine: object):
    from mmserve import LLM

    monkeypatch.setenv("MMSERVE_DECODE_GRAPHS", mode)
    llm = LLM(model, **engine)
    try:
        outputs = llm.generate(prompts, params)
        tokens = [o.token_ids for o in outputs]
        logprobs = [o.logprobs for o in outputs]
        graph_mode, sizes, replays = llm.engine.executor.decode_graphs()
        assert graph_mode == mode and llm.info().decode_graph_mode == mode
        assert not any(llm.engine.leak_report().values()), llm.engine.leak_report()
        return tokens, logprobs, sizes, replays, llm.stats()
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_vl"])
def test_decode_steps_replayed_from_static_buffers_equal_the_eager_engine(
    arch: str, tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, triton_attention: None
) -> None:
    """Requests finish at different steps, so decode batches of 4, 3, 2 and 1 replay at sizes 4, 4, 2 and 1 (pad
    rows beside live ones); with Qwen2-VL a photo's request decodes with M-RoPE's position offset."""
    from mmserve import SamplingParams

    model = tiny_model_dir(arch)
    prompts: list = list(PROMPTS)
    if arch == "qwen2_vl":
        from mmserve import LLM

        messages = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": str(ASSETS / "sample.jpg")}},
            {"type": "text", "text": "what is this"},
        ]}]  # fmt: skip
        probe = LLM(model, num_kv_blocks=8)
        prompts[2] = probe.processor.chat_prompt(messages)
        probe.close()
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3) for n in MAX_TOKENS]
    engine = dict(num_kv_blocks=96, max_num_seqs=8, cuda_graph_sizes=(1, 2, 4, 8), max_step_ms=0)  # one prefill step
    eager = _run(model, "off", monkeypatch, prompts, params, **engine)
    static = _run(model, "static", monkeypatch, prompts, params, **engine)
    assert static[0] == eager[0]
    _assert_logprobs_equal(eager[1], static[1])
    assert eager[2] == () and static[2] == (1, 2, 4, 8)
    replays = static[3]
    # Every prompt prefilled in the first step, then 4 rows for 2 steps and 3 for 3 (size 4), 2 for 3, 1 for 3.
    assert replays == {1: 3, 2: 3, 4: 5, 8: 0}, replays


def test_preemption_and_prefix_hits_under_replayed_decodes(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, triton_attention: None
) -> None:
    """A pool too small for every request at once (requests preempted and recomputed) and prompts that share a
    prefix: the same tokens as the eager engine, and no block left behind (the scratch block is not the pool's)."""
    from mmserve import SamplingParams

    model = tiny_model_dir("qwen2")
    shared = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    prompts = [shared + tail for tail in ("alpha", "beta", "gamma", "delta", "epsilon")]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # Fixed token budgets (no step-time target): the same schedule, so the same preemptions, in both engines.
    engine = dict(num_kv_blocks=14, block_size=4, max_num_seqs=8, cuda_graph_sizes=(1, 2, 4, 8), max_step_ms=0)
    eager = _run(model, "off", monkeypatch, prompts, params, **engine)
    static = _run(model, "static", monkeypatch, prompts, params, **engine)
    assert static[0] == eager[0]
    assert static[4].num_preemptions > 0 and static[4].num_preemptions == eager[4].num_preemptions
    assert static[4].prefix_cache_hits > 0
    assert sum(static[3].values()) > 0


def _toy_graphs(sizes: tuple[int, ...], kv: torch.Tensor, seen: list[ForwardBatch]) -> DecodeGraphs:
    """Graphs over a forward that writes each row's token id into its slot of `kv` (a flat slot pool, block
    size 4, scratch block 7) and returns [rows, 1]: what a real forward's K/V store does, minus the model."""

    def forward(batch: ForwardBatch) -> torch.Tensor:
        seen.append(batch)
        kv[batch.slot_mapping] = batch.input_ids.float()
        return batch.input_ids.float()[:, None]

    def metadata(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> object:
        return (query_start_loc, seq_lens)

    return DecodeGraphs(forward, metadata, mode="static", sizes=sizes, max_blocks_per_seq=3, scratch_block=7,
                        block_size=4, device=torch.device("cpu"))  # fmt: skip


def _decode_batch(token_ids: list[int], slots: list[int], seq_lens: list[int], width: int = 2) -> ForwardBatch:
    n = len(token_ids)
    return ForwardBatch(
        input_ids=torch.tensor(token_ids),
        positions=torch.tensor([[s - 1 for s in seq_lens]] * 3),
        slot_mapping=torch.tensor(slots),
        block_tables=torch.arange(n * width).view(n, width),
        logits_indices=torch.arange(n),
        query_start_loc=list(range(n + 1)),
        seq_lens=seq_lens,
    )


def test_a_pad_row_writes_only_the_scratch_block_even_where_a_larger_batch_wrote_before() -> None:
    kv = torch.zeros(32)
    seen: list[ForwardBatch] = []
    graphs = _toy_graphs((1, 2, 4), kv, seen)
    assert graphs.size_for(_decode_batch([5, 6, 7], [0, 4, 8], [1, 1, 1])) == 4
    out = graphs.run(_decode_batch([5, 6, 7, 9], [0, 4, 8, 12], [1, 1, 1, 1]), 4)
    assert out[:, 0].tolist() == [5, 6, 7, 9] and kv[12] == 9
    kv[12] = 42  # the fourth request's token, still live after it left the batch
    out = graphs.run(_decode_batch([15, 16, 17], [1, 5, 9], [2, 2, 2]), 4)
    assert out[:, 0].tolist() == [15, 16, 17]
    assert kv[12] == 42 and kv[28] == 0  # the pad row wrote token 0 into the scratch block's first slot
    assert graphs.seq_lens.tolist() == [2, 2, 2, 1] and graphs.block_tables[3].tolist() == [7, 7, 7]
    # The batch the forward ran over is the one built at capture: the same object, its host lists untouched.
    assert seen[-1] is seen[-2] and seen[-1].seq_lens == [1, 1, 1, 1]
    assert graphs.replays == {1: 0, 2: 0, 4: 2}


def test_what_runs_eagerly() -> None:
    graphs = _toy_graphs((1, 2, 4), torch.zeros(32), [])
    assert graphs.size_for(_decode_batch([1], [0], [1])) == 1
    assert graphs.size_for(_decode_batch([1] * 5, list(range(5)), [1] * 5)) is None  # more rows than captured
    assert graphs.size_for(_decode_batch([1, 2], [0, 1], [9, 9], width=4)) is None  # a longer table
    chunk = _decode_batch([1, 2], [0, 1], [2, 2])
    chunk = ForwardBatch(chunk.input_ids, chunk.positions, chunk.slot_mapping, chunk.block_tables[:1],
                         chunk.logits_indices[:1], [0, 2], [2])  # fmt: skip
    assert graphs.size_for(chunk) is None  # a prefill chunk: two query rows of one sequence


def test_the_mode_is_chosen_once_and_forcing_it_where_it_cannot_run_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MMSERVE_DECODE_GRAPHS", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert choose_mode(cuda, False, []) == "cuda"
    assert choose_mode(cuda, True, []) == "off"
    assert choose_mode(cuda, False, ["tensor parallelism"]) == "off"
    assert choose_mode(cpu, False, []) == "off"
    monkeypatch.setenv("MMSERVE_DECODE_GRAPHS", "static")
    assert choose_mode(cpu, False, []) == "static"
    assert choose_mode(cpu, True, []) == "off"  # --enforce-eager wins over the environment
    with pytest.raises(ValueError, match="tensor parallelism"):
        choose_mode(cpu, False, ["tensor parallelism"])
    monkeypatch.setenv("MMSERVE_DECODE_GRAPHS", "cuda")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        choose_mode(cpu, False, [])
    monkeypatch.setenv("MMSERVE_DECODE_GRAPHS", "sometimes")
    with pytest.raises(ValueError, match="not available"):
        choose_mode(cpu, False, [])


def test_the_cpu_attention_cannot_be_captured(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mmserve import LLM

    monkeypatch.setenv("MMSERVE_ATTENTION_BACKEND", "torch")
    monkeypatch.setenv("MMSERVE_DECODE_GRAPHS", "static")
    with pytest.raises(ValueError, match="attention plans from host lists"):
        LLM(tiny_model_dir("qwen2"), num_kv_blocks=8)


def test_capture_sizes() -> None:
    assert default_capture_sizes(128) == (1, 2, 4, *range(8, 129, 8))
    assert default_capture_sizes(3) == (1, 2, 3)
    assert default_capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert default_capture_sizes(4096)[-1] == 512
    for bad in ((), (0,), (513,), (True,)):
        with pytest.raises(InvalidRequestError, match="cuda_graph_sizes"):
            EngineArgs("m", cuda_graph_sizes=bad)


def test_serve_takes_vllms_graph_flags() -> None:
    from mmserve.cli import build_parser

    args = build_parser().parse_args(["serve", "--enforce-eager", "--cuda-graph-sizes", "1", "2", "8"])
    assert args.enforce_eager and args.cuda_graph_sizes == [1, 2, 8]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs: needs a CUDA device")
def test_captured_cuda_graphs_equal_eager_on_the_gpu(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mmserve import LLM, SamplingParams

    monkeypatch.delenv("MMSERVE_DECODE_GRAPHS", raising=False)
    model = tiny_model_dir("qwen2")
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3) for n in MAX_TOKENS]
    answers = []
    for enforce_eager in (True, False):
        llm = LLM(model, device="cuda", dtype="float32", num_kv_blocks=96, max_num_seqs=8, enforce_eager=enforce_eager)
        try:
            outputs = llm.generate(PROMPTS, params)
            mode, sizes, replays = llm.engine.executor.decode_graphs()
            assert mode == ("off" if enforce_eager else "cuda")
            if not enforce_eager:
                assert sizes == (1, 2, 4, 8) and sum(replays.values()) >= max(MAX_TOKENS) - 1
                # captured without autograd: no output holds a layer's activations in the pool
                graphs = llm.engine.executor._runner.decode_graphs
                assert graphs is not None and not any(g.hidden.requires_grad for g in graphs._graphs.values())
            answers.append(([o.token_ids for o in outputs], [o.logprobs for o in outputs]))
        finally:
            llm.close()
    assert answers[1][0] == answers[0][0]
    for eager_lps, graph_lps in zip(answers[0][1], answers[1][1], strict=True):
        for a, b in zip(eager_lps, graph_lps, strict=True):  # cuBLAS may pick another kernel per row count
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_the_graph_plan_attends_as_the_reference_whatever_the_host_lists_say(num_splits: int) -> None:
    """Triton's attention over a plan in device buffers (`decode_graph_plan`) reads the lengths from them: given
    stale host lists (the capture-time ones), it still equals the reference over the true lengths, pad rows
    included; with the split fixed for the longest context, a short one leaves splits empty at no cost."""
    pytest.importorskip("triton")
    import dataclasses

    from mmserve.kernels import reference, triton_attention

    # Compiled kernels need CUDA tensors; interpreted ones (the conftest's choice without CUDA) take CPU ones.
    device = torch.device("cpu" if triton_attention.INTERPRETED else "cuda")
    g = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_dim, num_heads = 10, 4, 2, 16, 4
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(device)
    seq_lens = [5, 1, 9, 1]  # the last a pad row: one key, its own (scratch block 9)
    tables = torch.tensor([[3, 1, 0], [2, 9, 9], [4, 5, 6], [9, 9, 9]], device=device)
    query = torch.randn(4, num_heads, head_dim, generator=g).to(device)
    expected = reference.paged_attention(query, cache, tables, [0, 1, 2, 3, 4], seq_lens, 0.25)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    starts = torch.arange(5, dtype=torch.int32, device=device)
    plan = triton_attention.decode_graph_plan(starts, lens, num_heads, num_kv_heads, 64)
    plan = dataclasses.replace(plan, num_splits=num_splits)
    out = triton_attention.paged_attention(query, cache, tables, [0, 1, 2, 3, 4], [1, 1, 1, 1], 0.25, None, plan)
    torch.testing.assert_close(out, expected)
