"""Tensor parallelism on the CPU with 2 ranks over gloo: greedy tokens identical to TP=1 and to
transformers' generate(), chosen-token logprobs within 1e-4 of TP=1 (fp32), for text, images, videos and
mixed batches, a 7-token budget with preemption, and prefix caching; GQA with more ranks than KV heads,
a vocabulary the rank count does not divide, fused checkpoint layouts, the vision tower in data mode
with more ranks than images; faults that fail requests alike on every rank; and a killed or hung rank,
which ends the engine (and the server, exit status 1) within a bounded time with no rank left running.

Each TP engine starts one rank process (~3 s: torch and transformers import there); engines are shared
per module, and every one is closed at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from mmserve import LLM
from mmserve.engine.encoder_split import split_encoder_work
from mmserve.engine.faults import RequestFailedError
from mmserve.request import MultiModalInput, PlaceholderRange
from mmserve.scheduler.output import EncoderWork
from tests.test_engine_process import free_port, serve, wait_healthy
from tests.test_mm_parity import CASES, rng_image
from tests.test_mm_parity import GREEDY as MM_GREEDY
from tests.test_mm_parity import hf_reference as mm_reference
from tests.test_parity import GREEDY, hf_reference, random_prompts

LOGPROB_ATOL = 1e-4
PLAIN_TOKENS = 4000  # ids below the special tokens (a random <|video_pad|> would need a video)
TEXT_PROMPTS_LENGTHS = (1, 9, 64, 133, 257)


def _rank_processes() -> list[psutil.Process]:
    """Rank processes started by this process (directly: the LLM's core runs here)."""
    return [p for p in psutil.Process().children() if "mmserve.engine.rank_worker" in " ".join(p.cmdline())]


_MAX_OPEN_ENGINES = 4  # each holds a rank process (~0.5 GB): tests are grouped by checkpoint


@pytest.fixture(scope="module")
def engines() -> Iterator[Callable[..., LLM]]:
    """(model_dir, tp, **settings) -> one LLM per distinct key, reused; the least recently used is
    closed beyond a few, the rest after the module."""
    made: dict[tuple, LLM] = {}

    def get(model_dir: Path, tp: int, **settings: object) -> LLM:
        key = (str(model_dir), tp, tuple(sorted(settings.items())))
        llm = made.pop(key, None) or LLM(model_dir, tensor_parallel_size=tp, **settings)
        made[key] = llm  # most recently used last
        while len(made) > _MAX_OPEN_ENGINES:
            made.pop(next(iter(made))).close()
        return llm

    yield get
    for llm in made.values():
        llm.close()
    assert not _rank_processes()  # every rank stopped with its engine


def _logprobs(out: object) -> list[float]:
    return [lp[t] for lp, t in zip(out.logprobs, out.token_ids, strict=True)]  # type: ignore[attr-defined]


def _same(tp_outputs: list, tp1_outputs: list, expected_tokens: list[list[int]] | None = None) -> None:
    for i, (a, b) in enumerate(zip(tp_outputs, tp1_outputs, strict=True)):
        assert a.token_ids == b.token_ids, f"output {i} differs from TP=1"
        if expected_tokens is not None:
            assert a.token_ids == expected_tokens[i], f"output {i} differs from transformers"
        assert _logprobs(a) == pytest.approx(_logprobs(b), abs=LOGPROB_ATOL)


def _idle(llm: LLM) -> None:
    assert all(v == 0 for v in llm.engine.leak_report().values()), llm.engine.leak_report()


# -- text -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["qwen2", "qwen2_vl"])
def text_case(request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path]) -> tuple:
    model_dir = tiny_model_dir(request.param)
    vocab = PLAIN_TOKENS
    prompts = random_prompts(vocab, TEXT_PROMPTS_LENGTHS, seed=11)
    prefix = random_prompts(vocab, (70,), seed=12)[0]
    shared = [prefix + tail for tail in random_prompts(vocab, (3, 17), seed=13)]
    all_prompts = prompts + shared
    expected = [tokens for tokens, _ in hf_reference(model_dir, all_prompts)]
    tp1 = LLM(model_dir).generate(all_prompts, GREEDY)
    return model_dir, all_prompts, expected, tp1


def test_text_equals_tp1_and_transformers_and_prefix_cache_hits(text_case: tuple, engines: Callable) -> None:
    model_dir, prompts, expected, tp1 = text_case
    llm = engines(model_dir, 2)
    _same(llm.generate(prompts, GREEDY), tp1, expected)
    hits = llm.stats().prefix_cache_hits
    _same(llm.generate(prompts, GREEDY), tp1, expected)  # again: served over cached blocks on both ranks
    assert llm.stats().prefix_cache_hits > hits
    assert any(r.comm_bytes > 0 for r in llm.step_records)
    _idle(llm)


def test_seven_token_budget_with_preemption(text_case: tuple, engines: Callable) -> None:
    model_dir, prompts, expected, tp1 = text_case
    llm = engines(model_dir, 2, max_num_batched_tokens=7, num_kv_blocks=20, block_size=16)
    _same(llm.generate(prompts, GREEDY), tp1, expected)
    assert llm.stats().num_preemptions > 0
    _idle(llm)


def test_fp8_kv_cache_with_calibrated_scales_equals_tp1(text_case: tuple, engines: Callable) -> None:
    """Each rank quantizes and calibrates its own KV heads (per-head scales): the same greedy output as one
    rank with the whole cache. Logprobs agree to 1e-2, not LOGPROB_ATOL: K/V that differ in the last fp32
    bit (another summation order across ranks) can round to neighbouring FP8 codes, 6% apart in e4m3."""
    model_dir, prompts, _, _ = text_case
    fp8 = dict(kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True)
    with LLM(model_dir, **fp8) as tp1_llm:
        tp1 = tp1_llm.generate(prompts, GREEDY)
    llm = engines(model_dir, 2, **fp8)
    assert llm.info().kv_cache_dtype == "fp8_e4m3"
    for i, (a, b) in enumerate(zip(llm.generate(prompts, GREEDY), tp1, strict=True)):
        assert a.token_ids == b.token_ids, f"output {i} differs from TP=1"
        assert _logprobs(a) == pytest.approx(_logprobs(b), abs=1e-2)
    _idle(llm)


# -- images and video -----------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def mm_case(request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path]) -> tuple:
    from transformers import AutoModelForImageTextToText

    model_dir = tiny_model_dir(request.param)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    tp1 = LLM(model_dir)
    names = list(CASES)
    expected = [mm_reference(model, model_dir, tp1, CASES[n])[0] for n in names]
    return model_dir, names, expected, tp1.generate([CASES[n] for n in names], MM_GREEDY)


def test_media_mixed_batch_and_each_alone(mm_case: tuple, engines: Callable) -> None:
    model_dir, names, expected, tp1 = mm_case
    llm = engines(model_dir, 2)
    _same(llm.generate([CASES[n] for n in names], MM_GREEDY), tp1, expected)
    for i, name in enumerate(names):  # one image alone: the second rank encodes nothing (data mode)
        _same(llm.generate([CASES[name]], MM_GREEDY), [tp1[i]], [expected[i]])
    _idle(llm)


def test_the_tower_sharded_like_the_decoder_gives_the_same_output(mm_case: tuple, engines: Callable) -> None:
    model_dir, names, expected, tp1 = mm_case
    llm = engines(model_dir, 2, mm_encoder_tp_mode="weights")
    _same(llm.generate([CASES[n] for n in names], MM_GREEDY), tp1, expected)
    assert llm.engine.info().weight_bytes < engines(model_dir, 2).engine.info().weight_bytes  # the tower split too
    _idle(llm)


def test_the_sharded_tower_encodes_in_slices_as_one_rank_encodes_whole(mm_case: tuple, engines: Callable) -> None:
    """Weights mode with a step target far below one group's encode, a text request decoding beside an image
    and a video: every rank runs the same slices of its shard of the tower (a block a step, the collectives
    inside), and the tokens are those of one rank encoding each group whole; nothing is left behind."""
    from mmserve import SamplingParams

    model_dir = mm_case[0]
    assets = Path(__file__).resolve().parent.parent / "assets"
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": str(assets / "sample.jpg")}},
        {"type": "text", "text": "and this clip"},
        {"type": "video_url", "video_url": {"url": str(assets / "sample_clip.mp4")}},
    ]}]  # fmt: skip
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True, logprobs=0)
    whole = engines(model_dir, 1)
    prompts = ["a text prompt that decodes beside the media", whole.processor.chat_prompt(messages)]
    expected = whole.generate(prompts, params)
    assert whole.stats().num_encoder_slices == 0
    llm = engines(model_dir, 2, mm_encoder_tp_mode="weights", max_num_batched_tokens=64, max_step_ms=0.01)
    _same(llm.generate(prompts, params), expected)
    stats = llm.stats()
    assert stats.num_encoder_slices >= 2 and stats.num_partial_encodes == 0
    _idle(llm)


def test_media_under_a_budget_smaller_than_one_image(mm_case: tuple, engines: Callable) -> None:
    model_dir, names, expected, tp1 = mm_case
    llm = engines(model_dir, 2, max_num_batched_tokens=7, max_num_encoder_tokens=12)
    _same(llm.generate([CASES[n] for n in names], MM_GREEDY), tp1, expected)
    assert max(r.num_prefill_tokens + r.num_decode_tokens for r in llm.step_records) <= 7
    assert sum(1 for r in llm.step_records if r.num_encoder_tokens) > len(names)  # media over many steps
    _idle(llm)


def test_media_with_preemption(mm_case: tuple, engines: Callable) -> None:
    model_dir, names, expected, tp1 = mm_case
    llm = engines(model_dir, 2, num_kv_blocks=10, block_size=16, max_num_batched_tokens=32)
    chosen = [i for i, n in enumerate(names) if n in ("image_resized", "video_even", "two_images", "image_and_video")]
    outputs = llm.generate([CASES[names[i]] for i in chosen], MM_GREEDY)
    _same(outputs, [tp1[i] for i in chosen], [expected[i] for i in chosen])
    assert llm.stats().num_preemptions > 0
    _idle(llm)


def test_faults_fail_requests_alike_on_every_rank_and_the_engine_goes_on(mm_case: tuple, engines: Callable) -> None:
    model_dir, names, expected, tp1 = mm_case
    tp1_llm = LLM(model_dir)
    llm = engines(model_dir, 2)
    batch = [CASES[n] for n in names[:3]]
    llm.engine.call_utility("inject_faults", ("fail_requests", ["*"]))  # inputs fail to build, on each rank
    with pytest.raises(RequestFailedError):
        llm.generate(batch, MM_GREEDY)
    llm.engine.call_utility("inject_faults", ("clear",))
    llm.engine.call_utility("inject_faults", ("fail_next_step",))  # the batched forward fails everywhere
    with pytest.raises(RequestFailedError):
        llm.generate(batch, MM_GREEDY)
    _same(llm.generate(batch, MM_GREEDY), tp1[:3], expected[:3])  # still in lockstep
    _idle(llm)
    # Media that fail to encode on the second rank only: every rank fails the step at the same point.
    # (New pixels: the batch's own are in the prefix cache by now, and would not be encoded again.)
    fresh = [{"prompt": CASES["two_images"]["prompt"], "images": [rng_image(31, 150, 100), rng_image(32, 56, 84)]}]
    llm.engine.call_utility("inject_faults", ("fail_encode", ["1"]))
    with pytest.raises(RequestFailedError):
        llm.generate(fresh, MM_GREEDY)
    assert [o.token_ids for o in llm.generate(fresh, MM_GREEDY)] == [o.token_ids for o in tp1_llm.generate(fresh, MM_GREEDY)]
    _idle(llm)


# -- shapes that do not split evenly, and checkpoint layouts --------------------------------------------
@pytest.fixture(scope="module")
def odd_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One KV head (fewer than the ranks) and an odd, tied vocabulary (4045 rows over 2 ranks)."""
    from mmserve.tiny_model import make_tiny_model

    out = tmp_path_factory.mktemp("tiny-odd")
    return make_tiny_model(out, arch="qwen2", preset="tiny", vocab_multiple=1, kv_heads=1, bpe_vocab=4031)


def _fused_copy(model_dir: Path, out: Path) -> Path:
    """The same checkpoint with q/k/v and gate/up stored fused (qkv_proj, gate_up_proj), as some exports do."""
    out.mkdir()
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    for f in model_dir.glob("*.safetensors"):
        state = load_file(f)
        fused: dict[str, torch.Tensor] = {}
        for key, tensor in state.items():
            for parts, name in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
                if f".{parts[0]}." in key:
                    keys = [key.replace(f".{parts[0]}.", f".{p}.") for p in parts]
                    fused[key.replace(f".{parts[0]}.", f".{name}.")] = torch.cat([state[k] for k in keys])
            if not any(f".{p}." in key for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
                fused[key] = tensor
        save_file(fused, out / f.name, metadata={"format": "pt"})
    return out


def test_gqa_past_the_kv_heads_an_odd_vocabulary_and_a_fused_layout(
    odd_model_dir: Path, engines: Callable, tmp_path: Path
) -> None:
    from mmserve.models.config import DecoderConfig

    cfg = DecoderConfig.from_pretrained(odd_model_dir)[0]
    assert cfg.num_kv_heads == 1 and cfg.vocab_size % 2 == 1 and cfg.tie_word_embeddings
    prompts = random_prompts(PLAIN_TOKENS, (5, 40, 90), seed=21)
    expected = [tokens for tokens, _ in hf_reference(odd_model_dir, prompts)]
    tp1 = LLM(odd_model_dir)
    reference = tp1.generate(prompts, GREEDY)
    llm = engines(odd_model_dir, 2)
    _same(llm.generate(prompts, GREEDY), reference, expected)
    # Each rank holds half of every sharded weight (the tied vocabulary rows included).
    assert llm.engine.info().weight_bytes < 0.6 * tp1.engine.info().weight_bytes
    fused = _fused_copy(odd_model_dir, tmp_path / "fused")
    with LLM(fused, tensor_parallel_size=2) as fused_llm:
        _same(fused_llm.generate(prompts, GREEDY), reference, expected)


def test_qwen3_moe_families_equal_tp1_and_transformers(
    tiny_model_dir: Callable[[str], Path], engines: Callable
) -> None:
    """Each rank holds a slice of every expert (and of the dense layers); the DeepStack levels travel with
    the all-gathered embeddings in data mode and are computed by every rank in weights mode."""
    from transformers import AutoModelForImageTextToText

    from tests.test_qwen3_parity import GREEDY as QWEN3_GREEDY
    from tests.test_qwen3_parity import MM_CASES

    text_dir = tiny_model_dir("qwen3_moe")
    prompts = random_prompts(PLAIN_TOKENS, (1, 9, 64, 133), seed=31)
    expected = [tokens for tokens, _ in hf_reference(text_dir, prompts)]
    _same(engines(text_dir, 2).generate(prompts, GREEDY), LLM(text_dir).generate(prompts, GREEDY), expected)
    vl_dir = tiny_model_dir("qwen3_vl_moe")
    model = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()
    tp1 = LLM(vl_dir)
    cases = [MM_CASES[n] for n in ("text", "image_odd", "video_odd", "image_and_video")]
    expected = [mm_reference(model, vl_dir, tp1, case)[0] for case in cases]
    reference = tp1.generate(cases, QWEN3_GREEDY)
    for settings in ({}, {"mm_encoder_tp_mode": "weights", "max_num_batched_tokens": 7}):
        llm = engines(vl_dir, 2, **settings)
        _same(llm.generate(cases, QWEN3_GREEDY), reference, expected)
        _idle(llm)


def test_a_model_that_cannot_split_is_refused_before_any_rank_starts(tiny_model_dir: Callable[[str], Path]) -> None:
    before = {p.pid for p in _rank_processes()}  # the module's shared engines
    with pytest.raises(ValueError, match="attention heads do not split over 3"):
        LLM(tiny_model_dir("qwen2"), tensor_parallel_size=3)
    assert {p.pid for p in _rank_processes()} == before


# -- the encoder's data mode ----------------------------------------------------------------------------
def _item(name: str, tokens: int, groups: int = 1) -> MultiModalInput:
    return MultiModalInput(name, PlaceholderRange(0, tokens * groups), "video" if groups > 1 else "image", groups)


@pytest.mark.parametrize("shard_encoder", [False, True])
def test_each_rank_gets_the_pixels_of_its_runs_also_when_one_item_comes_as_several(shard_encoder: bool) -> None:
    """One video's groups 2-3 (a running request) and 0-1 (a new one, evicted meanwhile) in one step, with
    an image before them: every rank rebuilds, for each of its runs, exactly that run's patch rows."""
    from mmserve.encoders.vision import EncoderInput
    from mmserve.engine.encoder_split import encoder_runs
    from mmserve.engine.rank_plan import PlanDecoder, PlanEncoder
    from mmserve.scheduler.output import SchedulerOutput

    h = w = 4
    video = MultiModalInput("v", PlaceholderRange(10, 16), "video", 4,
                            EncoderInput(torch.arange(4 * h * w * 3.0).view(4 * h * w, 3), (4, h, w)))  # fmt: skip
    image = MultiModalInput("a", PlaceholderRange(0, 8), "image", 1,
                            EncoderInput(-torch.arange(2 * 16 * 3.0).view(32, 3), (1, 4, 8)))  # fmt: skip
    work = (EncoderWork(image, 0), EncoderWork(video, 2), EncoderWork(video, 3), EncoderWork(video, 0),
            EncoderWork(video, 1))  # fmt: skip
    plan = SchedulerOutput((), 0, encoder_work=work)
    encoder = PlanEncoder(2, shard_encoder=shard_encoder)
    shared, per_rank = encoder.encode(plan)
    decoder = PlanDecoder()
    if per_rank[1] is not None:
        assert decoder.decode(per_rank[1]) is None
    decoded = decoder.decode(shared)
    runs = encoder_runs(decoded.encoder_work) if shard_encoder else split_encoder_work(decoded.encoder_work, 2)[1]
    expected = encoder_runs(work) if shard_encoder else split_encoder_work(work, 2)[1]
    assert [(r.mm_input.mm_hash, r.first, r.count) for r in runs] == [(r.mm_input.mm_hash, r.first, r.count) for r in expected]
    assert runs  # the second rank encodes something in both modes here
    for got, want in zip(runs, expected, strict=True):
        last = want.first + want.count - 1
        assert torch.equal(got.mm_input.data.groups(got.first, last)[0], want.mm_input.data.groups(want.first, last)[0])


def test_slices_cross_to_the_other_ranks_with_their_blocks_and_pixels_only_for_a_first_slice() -> None:
    """Weights mode: a slice that starts a group and one that continues another cross with their blocks; only
    the starting one's pixels are sent (the other rank continues its own partial encode)."""
    from mmserve.encoders.vision import EncoderInput
    from mmserve.engine.encoder_split import encoder_runs
    from mmserve.engine.rank_plan import PlanDecoder, PlanEncoder
    from mmserve.scheduler.output import SchedulerOutput

    h = w = 4
    video = MultiModalInput("v", PlaceholderRange(0, 16), "video", 4,
                            EncoderInput(torch.arange(4 * h * w * 3.0).view(4 * h * w, 3), (4, h, w)))  # fmt: skip
    work = (EncoderWork(video, 1, blocks=(2, 4, 4)), EncoderWork(video, 2, blocks=(0, 1, 4)))
    shared, per_rank = PlanEncoder(2, shard_encoder=True).encode(SchedulerOutput((), 0, encoder_work=work))
    decoder = PlanDecoder()
    assert per_rank[1] is not None and decoder.decode(per_rank[1]) is None
    decoded = decoder.decode(shared).encoder_work
    assert [(x.group, x.blocks) for x in decoded] == [(1, (2, 4, 4)), (2, (0, 1, 4))]
    assert decoded[0].mm_input.data is None  # a continuing slice: no pixels crossed
    assert torch.equal(decoded[1].mm_input.data.groups(2, 2)[0], video.data.groups(2, 2)[0])
    only_continuing = SchedulerOutput((), 0, encoder_work=work[:1])
    assert PlanEncoder(2, shard_encoder=True).encode(only_continuing)[1] == [None, None]
    # A slice that starts a group between two whole groups of another item: the runner merges the whole ones
    # into one run (slices apart), so their pixels must cross as that run.
    image = MultiModalInput("x", PlaceholderRange(0, 4), "image", 1,
                            EncoderInput(-torch.arange(h * w * 3.0).view(h * w, 3), (1, h, w)))  # fmt: skip
    work = (EncoderWork(video, 0), EncoderWork(image, 0, blocks=(0, 2, 4)), EncoderWork(video, 1))
    shared, per_rank = PlanEncoder(2, shard_encoder=True).encode(SchedulerOutput((), 0, encoder_work=work))
    decoder = PlanDecoder()
    assert decoder.decode(per_rank[1]) is None
    decoded = decoder.decode(shared).encoder_work
    (run,) = encoder_runs([x for x in decoded if x.blocks is None])
    assert torch.equal(run.mm_input.data.groups(0, 1)[0], video.data.groups(0, 1)[0])
    assert torch.equal(decoded[1].mm_input.data.groups(0, 0)[0], image.data.groups(0, 0)[0])


def test_encoder_work_splits_in_order_balanced_by_tokens() -> None:
    one = [EncoderWork(_item("a", 64), 0)]
    assert [len(s) for s in split_encoder_work(one, 2)] == [1, 0]  # more ranks than images: one idles
    video = _item("v", 16, groups=8)
    shares = split_encoder_work([EncoderWork(video, g) for g in range(8)], 2)
    assert [(r.first, r.count) for share in shares for r in share] == [(0, 4), (4, 4)]  # two runs of 4
    mixed = [EncoderWork(_item("big", 300), 0), EncoderWork(_item("s1", 100), 0), EncoderWork(_item("s2", 100), 0),
             EncoderWork(_item("s3", 100), 0)]  # fmt: skip
    tokens = [sum(r.num_tokens for r in share) for share in split_encoder_work(mixed, 2)]
    assert tokens == [300, 300]
    three = split_encoder_work(mixed, 3)
    assert [w.mm_input.mm_hash for share in three for r in share for w in [r]] == ["big", "s1", "s2", "s3"]


# -- a rank that dies or hangs --------------------------------------------------------------------------
_DEATH_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    import psutil
    from mmserve import LLM, SamplingParams
    from mmserve.errors import EngineDeadError

    model_dir, how = sys.argv[1], sys.argv[2]
    sp = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    llm = LLM(model_dir, tensor_parallel_size=2, distributed_timeout_s=3.0)
    llm.generate(["warm up"], SamplingParams(max_tokens=2, temperature=0.0))
    (rank,) = [p for p in psutil.Process().children() if "rank_worker" in " ".join(p.cmdline())]
    os.kill(rank.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    start = time.monotonic()
    try:
        llm.generate(["hello"] * 4, sp)
        error = None
    except EngineDeadError as exc:
        error = str(exc)
    waited = time.monotonic() - start
    try:
        llm.generate(["again"], sp)
        after = None
    except EngineDeadError as exc:
        after = str(exc)
    llm.close()
    time.sleep(0.2)
    print(json.dumps({"error": error, "after": after, "waited_s": waited, "rank_gone": not psutil.pid_exists(rank.pid)
                      or rank.status() == psutil.STATUS_ZOMBIE}))
    """
)


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_a_dead_or_hung_rank_ends_the_engine_within_a_bound_and_leaves_no_rank(
    how: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _DEATH_SCRIPT, str(tiny_model_dir("qwen2")), how],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["error"] is not None and "rank" in result["error"], result
    assert result["after"] is not None  # a dead engine stays dead: it never serves a rank short
    assert result["waited_s"] < (2.0 if how == "kill" else 3.0 + 5.0), result  # the collective timeout bounds a hang
    assert result["rank_gone"]


def _start_server(model_dir: Path, tmp_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = serve(str(model_dir), port, tmp_path, "--tensor-parallel-size", "2", "--distributed-timeout-s", "5")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 90)
    except BaseException:
        proc.kill()
        raise
    return proc, url


def _server_ranks(proc: subprocess.Popen) -> list[psutil.Process]:
    return [p for p in psutil.Process(proc.pid).children(recursive=True) if "rank_worker" in " ".join(p.cmdline())]


def test_the_server_drains_and_stops_its_ranks_and_exits_1_when_a_rank_dies(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_dir("qwen2")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    proc, url = _start_server(model_dir, tmp_path)
    try:
        (rank,) = _server_ranks(proc)
        response = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=30)
        assert response.status_code == 200, response.text
        os.kill(proc.pid, signal.SIGTERM)  # a drain: exit 0, and the rank stops with the core
        assert proc.wait(timeout=30) == 0
        rank.wait(timeout=10)
    finally:
        proc.kill()
    proc, url = _start_server(model_dir, tmp_path)
    try:
        (rank,) = _server_ranks(proc)
        descendants = psutil.Process(proc.pid).children(recursive=True)  # the core, the rank, decode workers
        os.kill(rank.pid, signal.SIGKILL)  # the engine core notices while idle, and the server stops
        assert proc.wait(timeout=20) == 1
        _, alive = psutil.wait_procs(descendants, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        proc.kill()


_TWO_NODE_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    from mmserve import LLM, SamplingParams
    from mmserve.errors import EngineDeadError

    model_dir, port = sys.argv[1], int(sys.argv[2])

    def remote_rank():  # "node 1": rank 1 started by hand with torchrun's variables
        env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.2",
                   MASTER_PORT=str(port))
        return subprocess.Popen([sys.executable, "-m", "mmserve.engine.rank_worker"], env=env)

    def node0():
        return LLM(model_dir, tensor_parallel_size=2, tensor_parallel_local_ranks=1, master_addr="127.0.0.2",
                   master_port=port)

    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = ["a two node engine", "over tcp sockets"]
    tp1 = [o.token_ids for o in LLM(model_dir).generate(prompts, sp)]
    rank = remote_rank()
    llm = node0()
    tp2 = [o.token_ids for o in llm.generate(prompts, sp)]
    llm.close()
    result = {"same": tp1 == tp2, "rank_exit": rank.wait(timeout=20)}
    # The remote rank dies while node 0 is idle: its TCP connection closes, the engine is dead at once.
    rank = remote_rank()
    llm = node0()
    os.kill(rank.pid, signal.SIGKILL)
    rank.wait()
    time.sleep(1.0)
    start = time.monotonic()
    try:
        llm.generate(prompts, sp)
        result["dead"] = None
    except EngineDeadError as exc:
        result["dead"] = str(exc)
    llm.close()
    result["dead_within_s"] = time.monotonic() - start
    print(json.dumps(result))
    """
)


def test_a_rank_from_another_node_joins_by_torchrun_variables_over_tcp(tiny_model_dir: Callable[[str], Path]) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _TWO_NODE_SCRIPT, str(tiny_model_dir("qwen2")), str(free_port())],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["same"] and result["rank_exit"] == 0, result
    assert result["dead"] is not None and "rank 1" in result["dead"], result
    assert result["dead_within_s"] < 3.0, result
