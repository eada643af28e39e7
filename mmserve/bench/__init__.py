"""`mmserve bench`: speed measured side by side in one run, written as JSON.

What the CLI needs cheaply lives here (no numpy, no torch): the systems and workloads it lists, and the
frozen configs its options are generated from. A knob is written once, as a config field (`knob` adds its help
and how its option reads); `add_config_options` makes the options and `config_from_options` the config, and a
report's `config` is the config's `asdict`."""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmserve.bench.slo_mix import Calibration


def knob(default: Any, help: str = "", *, flag: str | tuple[str, ...] | None = None,
         parse: Callable[[str], Any] | None = None, choices: tuple[str, ...] | None = None, repeat: bool = False,
         words: bool = False, option: str = "own", low: float | None = None) -> Any:
    """A config field that is one command-line option: `--field-name` (or `flag`, or several: aliases), `help`;
    the value read by `parse`, else by the field's type (a tuple: comma-separated items; a bool: --x / --no-x).
    `repeat`: the option may be given again, each adding one item; `words`: the items follow the option as
    separate words. `option`: "own" (this config makes the option), "shared" (another config or module makes an
    option of the same dest; its value, or None, reads into this field too) or "none" (not an option: the
    default always). `choices` and `low` (the least value) are checked by `BenchConfig` and its options."""
    meta = {"help": help, "flag": flag, "parse": parse, "choices": choices, "repeat": repeat, "words": words,
            "option": option, "low": low}  # fmt: skip
    return field(default=default, metadata=meta)


def _flags(f: dataclasses.Field) -> tuple[str, ...]:
    flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
    return (flag,) if isinstance(flag, str) else flag


def _value_type(cls: type, f: dataclasses.Field) -> Any:
    """The field's annotated type without its None (e.g. `int | None` -> int)."""
    hint = typing.get_type_hints(cls)[f.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def add_config_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """One option per field of the frozen config dataclass `cls` (`knob`'s settings, else `--field-name` with
    the field's default)."""
    for f in dataclasses.fields(cls):
        meta, default = f.metadata, f.default
        if meta.get("option", "own") != "own":
            continue
        flags = _flags(f)
        shown = f" (default: {','.join(map(str, default)) if isinstance(default, tuple) else default})"
        shown = "" if default in (None, (), "") else shown
        help_text = (meta.get("help") or "") + shown
        kwargs: dict[str, Any] = {"dest": f.name, "help": help_text.replace("%", "%%")}
        if meta.get("choices") and not isinstance(default, tuple):  # a tuple's items are checked by BenchConfig
            kwargs["choices"] = meta["choices"]
        # a bool: --x / --no-x; else None stands for the field's default (read as given)
        how = ({"action": argparse.BooleanOptionalAction, "default": default} if isinstance(default, bool) else
               {"action": "append"} if meta.get("repeat") else {"nargs": "+"} if meta.get("words") else {})  # fmt: skip
        parser.add_argument(*flags, **{"default": None, **how}, **kwargs)


def config_from_options(cls: type, args: argparse.Namespace) -> Any:
    """The `cls` instance that `add_config_options` options (and the shared ones its fields name) describe;
    ValueError for a value that does not read."""
    values = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata
        raw = None if meta.get("option") == "none" else getattr(args, f.name, None)
        if raw is None or isinstance(raw, bool):
            values[f.name] = f.default if raw is None else raw
            continue
        flag = _flags(f)[0]
        try:
            if meta.get("parse") is not None:
                values[f.name] = meta["parse"](raw)
            elif isinstance(raw, list):  # repeat / words: the items as given
                values[f.name] = tuple(raw)
            elif not isinstance(raw, str):  # a shared option its own parser already read
                values[f.name] = raw
            else:
                values[f.name] = _read(_value_type(cls, f), raw)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
    return cls(**values)


def _read(kind: Any, text: str) -> Any:
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        return tuple(_read(item, v.strip()) for v in text.split(",") if v.strip())
    if kind is float:
        return math.inf if text.strip().lower() in ("inf", "infinity") else float(text)
    return kind(text)


def num(value: float | None, spec: str = ".1f") -> str:
    """`value` formatted by `spec`, or "n/a" for None (a figure a run could not measure)."""
    return "n/a" if value is None else format(value, spec)


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A text table: the first column left-aligned, the others right-aligned, each as wide as its widest cell
    (cells are shown by `str`; format numbers with `num` first)."""
    cells = [[str(c) for c in row] for row in (header, *rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
                     for row in cells)  # fmt: skip


def summary(rows: Iterable[tuple[str, Any]]) -> str:
    """vLLM's summary layout: each label in 40 columns, its value right-aligned in the next 12 (or more)."""
    return "\n".join(f"{label:<40}{value!s:>12}" for label, value in rows)


def token_range(text: str) -> tuple[int, int]:
    """"MIN-MAX" (or one number) -> (MIN, MAX)."""
    low, _, high = text.partition("-")
    return int(low), int(high or low)


class BenchConfig:
    """Base of the bench configs (frozen dataclasses): at construction every field with `choices` (a word, or
    each item of a tuple, which must then not be empty) and `low` (the least value; of each item of a tuple) is
    checked, so a config built in code is refused as its options would be."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value, choices, low = getattr(self, f.name), f.metadata.get("choices"), f.metadata.get("low")
            if value is None:  # an optional field left to its default
                continue
            items = value if isinstance(value, tuple) else (value,)
            if choices and (not items or any(v not in choices for v in items)):
                raise ValueError(f"{f.name}: choose from {', '.join(choices)} (got {', '.join(map(str, items)) or 'none'})")
            if low is not None and any(v is not None and v < low for v in items):
                raise ValueError(f"{f.name} must be >= {low}, got {value}")


# Systems `mmserve bench throughput` compares (torch-free here so the CLI can list them cheaply).
SYSTEMS = ("mmserve", "mmserve-no-chunk", "mmserve-static", "mmserve-structured", "mmserve-eager", "hf-static", "hf-cb")
WORKLOADS = ("random", "random-mm", "prefix", "long-video")
ROUTER_POLICIES = ("round_robin", "cache_aware", "kv_aware")  # vllm-router's, as `bench router` compares them


@dataclass(frozen=True)
class RouterBenchConfig(BenchConfig):
    """`mmserve bench router`."""

    policies: tuple[str, ...] = knob(ROUTER_POLICIES, "vllm-router policies, side by side over the same replicas",
                                     choices=ROUTER_POLICIES)  # fmt: skip
    media: tuple[str, ...] = knob(("image", "none"), "image: a family shares an image and a system prompt; none: "
                                  "the system prompt only", choices=("image", "none"))  # fmt: skip
    num_replicas: int = knob(2, low=1)
    num_families: int = knob(4, low=1)
    requests_per_family: int = knob(12, low=1)
    concurrency: int = knob(4, "requests in flight through the router (closed loop)", low=1)
    system_len: int = knob(96, "tokens of each family's system prompt (about)")
    user_len: int = knob(48, "tokens of each request's own text (about)")
    output_len: int = 16
    image_size: int = 64
    num_kv_blocks: int = knob(1024, "per replica: enough that nothing is evicted in a run")
    seed: int = 0


@dataclass(frozen=True)
class DisaggBenchConfig(BenchConfig):
    """`mmserve bench disagg`."""

    num_chats: int = knob(8, "chats, all sent at once, streaming while the long prompts arrive", low=1)
    chat_input_len: int = knob(64, "tokens of each chat's prompt (about)", low=1)
    chat_output_len: int = knob(96, "tokens each chat streams (ignore_eos)", low=2)
    num_long: int = knob(3, "long media prompts, sent --long-interval-s apart once every chat streams", low=1)
    long_media: str = knob("image", "what a long prompt carries: --num-images images or one video",
                           choices=("image", "video"))  # fmt: skip
    num_images: int = knob(4, "images per long prompt", low=1)
    image_size: int = knob(448, "image side in pixels", low=28)
    num_frames: int = knob(32, "frames of a long prompt's video", low=2)
    video_size: int = knob(224, "video frame side in pixels", low=28)
    long_output_len: int = knob(8, "tokens each long prompt generates", low=1)
    long_interval_s: float = knob(1.0, "seconds between the long prompts", low=0.0)
    num_kv_blocks: int = knob(2048, "per instance", low=16)
    rounds: int = knob(3, "rounds of both systems in turn (the first alternating), each on a fresh draw; medians "
                       "are reported", low=1)  # fmt: skip
    seed: int = 0

    def quick(self) -> DisaggBenchConfig:
        """4 chats of 16 tokens, 2 long prompts of 2 112x112 images 0.2 s apart, one round: a smoke run"""
        return dataclasses.replace(self, num_chats=4, chat_input_len=24, chat_output_len=16, num_long=2,
                                   num_images=2, image_size=112, num_frames=4, video_size=56, long_output_len=4,
                                   long_interval_s=0.2, num_kv_blocks=512, rounds=1)  # fmt: skip


KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")  # as config.KV_CACHE_DTYPE_NAMES ("fp8" is fp8_e4m3)


@dataclass(frozen=True)
class KVCacheBenchConfig(BenchConfig):
    """`mmserve bench kv-cache`."""

    kv_cache_dtypes: tuple[str, ...] = knob(KV_CACHE_DTYPES, "side by side; the first is the accuracy reference",
                                            choices=KV_CACHE_DTYPES)  # fmt: skip
    dtype: str = knob("float32", "the compute dtype of every engine")
    kv_cache_tokens: int = knob(2048, "the pool's memory: this many tokens in the compute dtype", low=1)
    num_requests: int = knob(48, "the capacity batch, all submitted at once", low=1)
    prompt_len: int = knob(96, "tokens (about)", low=1)
    output_len: int = knob(64, "forced (ignore_eos)", low=1)
    accuracy_prompts: int = knob(24, low=1)
    accuracy_tokens: int = knob(24, "greedy tokens compared per prompt", low=1)
    calculate_kv_scales: bool = False
    repeats: int = knob(2, "timed batches per dtype, interleaved across dtypes; the median counts", low=1)
    seed: int = 0


MEDIA_SOURCES = ("data-url", "upload")
TRANSPORTS = ("ws", "http")


@dataclass(frozen=True)
class ServeBenchConfig(BenchConfig):
    """`mmserve bench serve` (every workload but slo-mix, which has `MixConfig`)."""

    url: str | None = knob(None, "a running server; default: start one on --model")
    metrics_url: tuple[str, ...] = knob(
        (), "a server whose /metrics the cache figures sum; repeat for every replica when --url is a router "
        "(default: --url)", repeat=True)  # fmt: skip
    transports: tuple[str, ...] = knob(
        ("ws",), "ws, http or ws,http (each its own draw of the workload: none finds another's prompts cached)",
        flag="--transport", choices=TRANSPORTS)  # fmt: skip
    workload: str = knob(
        "random", "prefix: every prompt starts with the same --num-images images and --prefix-len tokens of "
        "text; request 0 is sent alone and the rest wait for its first token (or its end), so it is a cold "
        "miss and the others hit the caches; TTFT of the first and of the repeats are reported apart (each "
        "transport gets a prefix of its own). long-video: the random text requests stream, then --num-videos "
        "videos of --num-frames frames arrive --video-interval-s apart; text ITL while they are in is reported "
        "against the rest. slo-mix: see its options", choices=(*WORKLOADS, "slo-mix"))  # fmt: skip
    media_source: str = knob("data-url", "random-mm, prefix: how images and videos travel (upload: each distinct "
                             "one once, before timing)", choices=MEDIA_SOURCES)  # fmt: skip
    prefix_len: int = knob(512, "prefix: shared prefix tokens (approximate)")
    num_prompts: int = 64
    input_len: tuple[int, int] = knob((16, 128), "MIN-MAX prompt tokens (approximate)", parse=token_range)
    output_len: tuple[int, int] = knob((16, 256), "MIN-MAX output tokens (ignore_eos)", parse=token_range)
    num_images: int | None = knob(None, "images per prompt: random-mm, random ones (default 1); prefix, the same "
                                  "ones in front of every prompt (default 0)")  # fmt: skip
    image_size: int = knob(64, "random-mm, prefix: image side in pixels")
    image_format: str = knob("png", "random-mm: how images are encoded", choices=("png", "jpeg"))
    num_frames: int | None = knob(None, "random-mm: frames of one mp4 video per prompt (default 0: none); "
                                  "long-video: frames per video (default 64)")  # fmt: skip
    video_size: int | None = knob(None, "video frame side in pixels (random-mm 112, long-video 224)")
    num_videos: int = knob(2, "long-video: videos arriving")
    video_interval_s: float = knob(2.0, "long-video: seconds between videos")
    compare_no_chunk: bool = knob(False, "long-video: run again on a server without chunked prefill or encoding "
                                  "(as vLLM without chunked prefill) and report the ratios")  # fmt: skip
    request_rate: float = knob(math.inf, "requests/s (inf: all at once)")
    burstiness: float = knob(1.0, "gamma shape of the gaps; 1 is Poisson")
    max_concurrency: int | None = knob(None, "closed loop: at most N in flight")
    goodput: tuple[str, ...] = knob((), "SLOs NAME:MS, e.g. ttft:500 tpot:50 e2el:5000", words=True)
    max_num_seqs: int = knob(64, "the server it starts, and --offline")
    max_num_batched_tokens: int = knob(2048, "the server it starts, and --offline")
    max_num_encoder_tokens: int | None = knob(None, "the server it starts (default: token budget)")
    server_process: bool = knob(False, "start the server as a child `mmserve serve` (its own GIL, as deployed) "
                                "instead of a thread")  # fmt: skip
    engine_process: bool = knob(True, "with --server-process: the child's engine core in its own process "
                                "(--no-engine-process: `serve --no-engine-process`)")  # fmt: skip
    api_server_count: int = knob(1, "with --server-process: API server processes of the child `mmserve serve`")
    peer: tuple[str, ...] = knob(
        (), "another OpenAI-compatible server, NAME=URL (or URL): the same requests over HTTP in the same report, "
        "interleaved with mmserve round by round; repeat for more", repeat=True)  # fmt: skip
    repeats: int = knob(1, "rounds of every server and transport in turn, each on a fresh draw of the workload; "
                        "each key's figures are its median round's", low=1)  # fmt: skip
    offline: bool = knob(False, "also run the same requests through the offline LLM.chat (same engine settings) "
                         "and report each transport's throughput over it")  # fmt: skip
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.workload not in WORKLOADS:  # slo-mix is an option value only: the CLI runs it with MixConfig
            raise ValueError(f"workload: choose from {', '.join(WORKLOADS)} (got {self.workload})")
        if self.compare_no_chunk and (self.url is not None or self.workload != "long-video" or self.peer):
            raise ValueError("--compare-no-chunk is for --workload long-video on servers it starts (no --url, no --peer)")
        starts = self.url is None and self.server_process
        if (self.api_server_count != 1 or not self.engine_process) and not starts:
            raise ValueError("--api-server-count and --no-engine-process are for the server --server-process starts")

    def resolved(self) -> ServeBenchConfig:
        """The workload's defaults filled in: images per prompt (random-mm 1, prefix 0, else none), video frames
        (long-video 64, else none) and frame side (long-video 224, else 112)."""
        long_video = self.workload == "long-video"
        images = {"random-mm": 1, "prefix": 0}.get(self.workload)
        num_images = 0 if images is None else images if self.num_images is None else self.num_images
        num_frames = self.num_frames if self.num_frames is not None else (64 if long_video else 0)
        return dataclasses.replace(self, num_images=num_images, num_frames=num_frames,
                                   video_size=self.video_size or (224 if long_video else 112))  # fmt: skip

    def quick(self) -> ServeBenchConfig:
        """8 short requests (long-video: texts long enough to outlast two small videos): a smoke run"""
        cfg = self.resolved()
        quick = dataclasses.replace(cfg, num_prompts=8, input_len=(8, 32), output_len=(4, 16),
                                    prefix_len=min(cfg.prefix_len, 128), video_interval_s=0.2)  # fmt: skip
        if self.workload != "long-video":
            return quick
        return dataclasses.replace(quick, output_len=(48, 64), num_frames=min(cfg.num_frames or 0, 8),
                                   video_size=min(cfg.video_size or 0, 56))  # fmt: skip


@dataclass(frozen=True)
class ThroughputBenchConfig(BenchConfig):
    """`mmserve bench throughput`: every system offline on the same requests."""

    systems: tuple[str, ...] = knob(("mmserve", "hf-static"), "comma-separated", choices=SYSTEMS)
    workload: str = knob("random", choices=WORKLOADS)
    num_prompts: int = 64
    input_len: tuple[int, int] = knob((16, 128), "MIN-MAX prompt tokens", parse=token_range)
    output_len: tuple[int, int] = knob((16, 256), "MIN-MAX output tokens", parse=token_range)
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = knob(None, "default 2048; long-video: 512")
    max_num_encoder_tokens: int | None = knob(None, "encoder budget per step (default: the token budget; "
                                              "long-video: 128)")  # fmt: skip
    encoder_token_cost: float = knob(0.0, "budget tokens each encoded embedding token takes (mmserve systems)")
    hf_batch_size: int = 16
    seed: int = 0
    repeats: int = knob(1, "run every system this many times, round-robin; each reports its median run", low=1)
    num_images: int = knob(1, "random-mm: images per prompt")
    image_size: int = knob(64, "random-mm: image side in pixels")
    num_frames: int | None = knob(None, "random-mm: frames of one video per prompt (default 0: none); "
                                  "long-video: frames per video (64)")  # fmt: skip
    video_size: int | None = knob(None, "frame side in pixels (random-mm 112, long-video 224)")
    num_videos: int = knob(2, "long-video: video requests arriving")
    video_interval_steps: int = knob(8, "long-video: engine steps between video arrivals (the first comes 4 "
                                     "steps after the text prompts could have prefilled)")  # fmt: skip
    prefix_len: int = knob(512, "prefix: shared prefix tokens")
    structured: bool = knob(False, "also run mmserve-structured: every request constrained by a grammar (its "
                            "per-step cost)")  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.workload in ("random-mm", "long-video") and "hf-cb" in self.systems:
            raise ValueError("hf-cb runs text workloads only (random, prefix)")

    def resolved(self) -> ThroughputBenchConfig:
        """The workload's defaults filled in: long-video has long videos under a small budget, so chunking
        shows; `structured` adds mmserve-structured to the systems."""
        long_video = self.workload == "long-video"
        systems = self.systems
        if self.structured and "mmserve-structured" not in systems:
            systems = (*systems, "mmserve-structured")
        return dataclasses.replace(
            self, systems=systems,
            num_frames=self.num_frames if self.num_frames is not None else (64 if long_video else 0),
            video_size=self.video_size or (224 if long_video else 112),
            max_num_batched_tokens=self.max_num_batched_tokens or (512 if long_video else 2048),
            max_num_encoder_tokens=self.max_num_encoder_tokens or (128 if long_video else None),
        )  # fmt: skip

    def quick(self) -> ThroughputBenchConfig:
        """16 short requests (long-video: 8 decodes, two 16-frame 112x112 videos, budgets 64/32): a smoke run"""
        cfg = dataclasses.replace(self.resolved(), num_prompts=16, input_len=(8, 32), output_len=(4, 32),
                                  prefix_len=min(self.prefix_len, 128))  # fmt: skip
        if self.workload != "long-video":
            return cfg
        # outputs then cover the videos, no more
        return dataclasses.replace(cfg, num_prompts=8, num_videos=min(self.num_videos, 2), num_frames=16,
                                   video_size=112, output_len=(2, 8), max_num_batched_tokens=64,
                                   max_num_encoder_tokens=32)  # fmt: skip


@dataclass(frozen=True)
class TensorParallelBenchConfig(BenchConfig):
    """`mmserve bench tensor-parallel`: what one run measures. Every (round, concurrency) draws fresh prompts
    that every TP size gets."""

    tensor_parallel_sizes: tuple[int, ...] = knob((1, 2), "every engine is built once", low=1)
    concurrency: tuple[int, ...] = knob((1, 16, 64), "requests decoding together", low=1)
    input_len: int = knob(32, "prompt tokens of every request", low=1)
    output_len: int = knob(128, "max_tokens (ignore_eos): output-len - 1 decode steps a run", low=2)
    rounds: int = knob(3, "each round runs every concurrency on every TP size, in turn", low=1)
    max_num_batched_tokens: int = knob(2048, low=1)
    block_size: int = knob(16, low=1)
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("tensor_parallel_sizes", "concurrency"):
            values = getattr(self, name)
            if not values or len(set(values)) != len(values):
                raise ValueError(f"{name}: distinct integers >= 1, got {list(values)}")

    @property
    def num_kv_blocks(self) -> int:
        """Room for every request of the largest concurrency, twice over (small: both engines live at once)."""
        per_request = math.ceil((self.input_len + self.output_len) / self.block_size) + 1
        return 2 * max(self.concurrency) * per_request


@dataclass(frozen=True)
class LongVideoBenchConfig(BenchConfig):
    """`mmserve bench long-video`: text requests decode while one long video prefills."""

    num_decodes: int = knob(16, low=1)
    num_frames: int = knob(64, low=1)
    frame_size: int = knob(224, low=1)
    max_num_batched_tokens: int = 512
    max_num_encoder_tokens: int = 128
    max_step_ms: tuple[float, ...] = knob((250.0,), "step-time targets, one chunked run each (0: fixed token "
                                          "budgets)", low=0.0)  # fmt: skip
    whole: bool = knob(True, "also run with the video encoded whole (--no-whole: skip it)")
    dtype: str | None = knob(None, choices=("float32", "bfloat16", "float16"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.max_step_ms:
            raise ValueError("max_step_ms: long-video needs a step-time target (0: fixed token budgets)")

    def quick(self) -> LongVideoBenchConfig:
        """4 decodes, a 16-frame 112x112 video, budgets 64/32: a smoke run"""
        return dataclasses.replace(self, num_decodes=4, num_frames=16, frame_size=112, max_num_batched_tokens=64,
                                   max_num_encoder_tokens=32)  # fmt: skip


SLO_POLICIES = ("fcfs", "priority", "slo")  # the scheduler policies slo-mix compares


def _zero_none(value: float | str) -> float | None:
    return float(value) or None


@dataclass(frozen=True)
class MixConfig(BenchConfig):
    """`mmserve bench serve --workload slo-mix`: one run. Loads are chat arrival rates (req/s); each load runs
    `duration_s` of chats over a fresh backlog of `num_batch` batch jobs sent at its start. The request shapes
    are not options; the engine sizes and the slo planner's settings are `bench serve`'s and `serve`'s options."""

    loads: tuple[float, ...] = knob((0.5, 1.0, 2.0), "comma-separated chat arrival rates (req/s)")
    duration_s: float = knob(20.0, "seconds of chats per load")
    num_batch: int = knob(6, "batch jobs per load, cycling text, multi-image, video (with --sweep: a backlog of "
                          "about half a phase's compute, measured)")  # fmt: skip
    policies: tuple[str, ...] = knob(SLO_POLICIES, "comma-separated", choices=SLO_POLICIES)
    ttft_ms: float = knob(1000.0, "interactive TTFT target: the server's class default and the attainment bar "
                          "(with --sweep: from a measurement at start)", flag="--slo-ttft-ms")  # fmt: skip
    tbt_ms: float = knob(100.0, "interactive TBT target, judged on TPOT (with --sweep: measured)",
                         flag="--slo-tbt-ms")  # fmt: skip
    admission_control: str = knob("off", "the slo policy's answer to a chat it predicts cannot make its TTFT",
                                  flag=("--slo-admission", "--admission-control"),
                                  choices=("off", "downgrade", "reject"))  # fmt: skip
    chat_input_len: tuple[int, int] = knob((16, 64), option="none")
    chat_output_len: tuple[int, int] = knob((16, 32), option="none")
    chat_image_share: float = knob(0.5, option="none")  # of chats, the share with one image
    batch_input_len: tuple[int, int] = knob((768, 1024), option="none")  # long-text jobs (approximate tokens)
    batch_output_len: tuple[int, int] = knob((32, 64), option="none")
    batch_images: int = knob(4, option="none")  # per multi-image job
    image_size: int = knob(112, option="none")  # chat and batch images (pixels per side)
    video_frames: int = knob(32, option="none")  # frames kept of each long video (2 fps sampling: a 16 s clip)
    video_size: int = knob(112, option="none")
    max_num_batched_tokens: int = knob(2048, option="shared")  # bench serve's options
    max_num_seqs: int = knob(64, option="shared")
    seed: int = knob(0, option="shared")
    # The slo planner's, as `mmserve serve` takes them (mmserve/slo_flags.py):
    step_time_model: str | None = knob(None, option="shared")  # `bench profile` JSON: a warm start for every policy
    max_step_ms: float | None = knob(250.0, option="shared", parse=_zero_none)  # while decodes run (None: fixed)
    step_time_headroom: float = knob(0.1, option="shared")  # steps are planned to (1 - this) x their time target
    tbt_slack_ms: float = knob(250.0, option="shared")  # the slo policy's lend of a stream's lead on its TBT pace
    batch_min_share: float = knob(0.1, option="shared")  # the slo policy's share of each step kept for batch work

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.loads or any(not (x > 0 and math.isfinite(x)) for x in self.loads):
            raise ValueError("slo-mix: loads must be positive finite chat rates (req/s)")

    def engine_kwargs(self, policy: str) -> dict[str, Any]:
        """The in-process server's `EngineArgs` fields for `policy` (the others ignore the slo-only ones)."""
        return dict(
            scheduler_policy=policy, max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs, interactive_ttft_ms=self.ttft_ms, interactive_tbt_ms=self.tbt_ms,
            step_time_model=self.step_time_model, max_step_ms=self.max_step_ms,
            step_time_headroom=self.step_time_headroom, tbt_slack_ms=self.tbt_slack_ms,
            batch_min_share=self.batch_min_share, admission_control=self.admission_control,
        )  # fmt: skip

    def quick(self) -> MixConfig:
        """`--quick`: a smoke run of the whole pipeline (each policy, one load, a few small requests, targets
        every chat meets) on the tiny model; the policies and the planner settings stay."""
        return dataclasses.replace(
            self, loads=(2.0,), duration_s=2.0, num_batch=3, chat_input_len=(8, 16), chat_output_len=(2, 4),
            batch_input_len=(48, 64), batch_output_len=(2, 4), batch_images=2, image_size=56, video_frames=4,
            video_size=56, ttft_ms=60_000.0, tbt_ms=60_000.0, max_num_batched_tokens=128, max_num_seqs=16,
        )  # fmt: skip


@dataclass(frozen=True)
class SweepConfig:
    """`--sweep`: chat rates start_load x factor^k, k = 0, 1, ... until every policy's attainment is below
    `attainment` (or `max_loads` rates ran); if none meets it at the start, start_load / factor^k instead until one
    does. None fields are calibrated at start (see `slo_mix.calibrate`)."""

    start_load: float | None = knob(None, "first chat rate (default: a quarter of a measured burst rate)",
                                    flag="--sweep-start")  # fmt: skip
    factor: float = knob(1.5, "rate step", flag="--sweep-factor")
    max_loads: int = knob(8, "most rates it runs", flag="--sweep-max-loads")
    attainment: float = knob(0.9, "the capacity bar", flag="--sweep-attainment")
    ttft_ms: float | None = knob(None, option="shared")  # None: from the chat TTFT measured alone
    tbt_ms: float | None = knob(None, option="shared")
    num_batch: int | None = knob(None, option="shared")  # None: a backlog of about half a phase's compute

    def __post_init__(self) -> None:
        if self.start_load is not None and not (self.start_load > 0 and math.isfinite(self.start_load)):
            raise ValueError("slo-mix --sweep: the start load must be a positive chat rate (req/s)")
        if not (self.factor > 1 and math.isfinite(self.factor)) or self.max_loads < 1:
            raise ValueError("slo-mix --sweep: the factor must be > 1 and at least one load must run")
        if not 0 < self.attainment <= 1:
            raise ValueError("slo-mix --sweep: the attainment bar must be in (0, 1]")

    def resolved(self, calibration: Calibration | None, duration_s: float) -> tuple[float, float, float, int]:
        """(first rate, TTFT ms, TBT ms, batch jobs per load): each as given, else derived from `calibration`
        (which must then be there)."""
        if calibration is None:
            given = (self.start_load, self.ttft_ms, self.tbt_ms, self.num_batch)
            assert None not in given, "a SweepConfig with a field left to calibrate needs a Calibration"
            return given  # type: ignore[return-value]
        ttft_ms, tbt_ms = calibration.targets()
        return (
            calibration.start_load() if self.start_load is None else self.start_load,
            ttft_ms if self.ttft_ms is None else self.ttft_ms,
            tbt_ms if self.tbt_ms is None else self.tbt_ms,
            calibration.num_batch(duration_s) if self.num_batch is None else self.num_batch,
        )

    def needs_calibration(self) -> bool:
        return None in (self.start_load, self.ttft_ms, self.tbt_ms, self.num_batch)


@dataclass(frozen=True)
class ProfileBenchConfig:
    """`mmserve bench profile`: the sweep of step shapes. Each (batch size, prompt length) pair with batch * length
    <= the token budget is one prefill step then `decode_steps` decode steps; `chunked_len` is prefilled in
    budget-sized chunks."""

    batch_sizes: tuple[int, ...] = (1, 4, 16)
    prompt_lens: tuple[int, ...] = (16, 128, 512)
    decode_steps: int = 6
    chunked_len: int = knob(2048, "tokens prefilled in chunks (at least two steps' worth)")
    image_sizes: tuple[int, ...] = (112, 224, 448)
    video_frames: tuple[int, ...] = (8, 32)
    video_size: int = 224
    max_num_batched_tokens: int = knob(2048, "largest step of the sweep")
    repeats: int = knob(2, "of the whole sweep (the first step of each shape may include one-off costs)")
    device: str | None = None

    def resolved(self) -> ProfileBenchConfig:
        """The chunked prefill spans at least two budgets."""
        return dataclasses.replace(self, chunked_len=max(self.chunked_len, 2 * self.max_num_batched_tokens))

    def quick(self) -> ProfileBenchConfig:
        """a few small shapes: a smoke run"""
        return dataclasses.replace(
            self, batch_sizes=(1, 4), prompt_lens=(8, 32), decode_steps=3, chunked_len=96, image_sizes=(56, 112),
            video_frames=(4,), video_size=56, max_num_batched_tokens=64, repeats=1,
        )  # fmt: skip


@dataclass(frozen=True)
class KernelsBenchConfig:
    """`mmserve bench kernels`: the Triton paged attention against SDPA."""

    smoke: bool = knob(False, "tiny shapes on the CPU in Triton's interpreter (checks the script only)")


# mmserve.quantize.FORMATS, repeated here so the CLI needs no torch (a test checks they agree).
BENCH_FORMATS = ("fp8-tensor", "fp8-dynamic", "fp8-block", "w8a8", "w4a16", "w4a16-asym", "awq", "qwen-fp8")
COMPUTE_PATHS = ("dequantized", "native")


@dataclass(frozen=True)
class QuantizationBenchConfig(BenchConfig):
    """`mmserve bench quantization`."""

    formats: tuple[str, ...] = knob(BENCH_FORMATS, choices=BENCH_FORMATS)
    paths: tuple[str, ...] = knob(COMPUTE_PATHS, choices=COMPUTE_PATHS)
    dtype: str = knob("bfloat16", "the compute dtype of every engine, the dense reference's included",
                      choices=("float32", "bfloat16", "float16"))  # fmt: skip
    group_size: int = knob(128, "the int4 formats' group (w4a16, w4a16-asym, awq)", low=1)
    accuracy_prompts: int = knob(16, low=1)
    accuracy_tokens: int = knob(16, "greedy tokens compared per prompt", low=1)
    prompt_len: int = knob(64, "tokens of each accuracy and decode prompt", low=1)
    prefill_prompts: int = knob(4, low=1)
    prefill_len: int = knob(512, "tokens of each prefill prompt (one output token)", low=1)
    decode_batch: int = knob(16, "sequences decoding together", low=1)
    decode_tokens: int = knob(32, "tokens each decodes (ignore_eos)", low=1)
    repeats: int = knob(3, "timed runs of each measurement; the median counts", low=1)
    seed: int = 0
    workdir: str = knob("", "where the quantized checkpoints go (default: a temporary directory)")
