"""`mmserve bench serve --quick` against an in-process server on the tiny model: both transports, the
text, image + video (data URLs and uploads) and prefix workloads (text only, and behind a repeated image whose
repeats hit the server's caches), arrivals and closed loop; the JSON has every metric."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from mmserve.cli import main
from tests.test_engine_process import free_port, wait_healthy

METRICS = [
    f"{stat}_{name}_ms"
    for name in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "std", "p50", "p90", "p99")
] + [
    "completed",
    "failed",
    "duration_s",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "request_goodput",
]

# The prefix workload's TTFT of request 0 (sent alone) against the other requests'.
FIRST_VS_REPEATS = [
    "ttft_first_ms",
    "ttft_repeats_median_ms",
    "ttft_repeats_p90_ms",
    "ttft_repeats_over_first",
]


@pytest.mark.parametrize(
    "extra",
    [
        ["--transport", "ws,http"],
        [
            "--transport",
            "ws",
            "--workload",
            "random-mm",
            "--request-rate",
            "40",
            "--burstiness",
            "0.5",
            "--max-concurrency",
            "3",
            "--num-frames",  # an image and a 4-frame mp4 per prompt, as data URLs
            "4",
            "--video-size",
            "56",
        ],
        # Two images and a video, uploaded once and sent by file id.
        [
            "--transport",
            "http",
            "--workload",
            "random-mm",
            "--media-source",
            "upload",
            "--num-images",
            "2",
            "--num-frames",
            "4",
            "--video-size",
            "56",
        ],
        ["--transport", "http", "--workload", "prefix", "--prefix-len", "64"],
    ],
    ids=["text-ws-http", "mm-ws-gamma-closed-loop", "mm-upload-http", "prefix-http"],
)
def test_bench_serve_quick(tiny_model_dir: Callable[[str], Path], tmp_path: Path, extra: list[str]) -> None:
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--model", str(tiny_model_dir("qwen2_vl")), "--quick", "--no-progress"]
    argv += ["--json", str(out), "--goodput", "ttft:600000", "e2el:600000", *extra]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    transports = extra[1].split(",")
    assert list(report["results"]) == transports
    for transport in transports:
        m = report["results"][transport]
        assert set(METRICS) <= set(m), set(METRICS) - set(m)
        assert m["failed"] == 0, m["errors"]
        assert m["completed"] == report["config"]["num_prompts"] == 8
        assert m["total_output_tokens"] >= 8 * 4  # ignore_eos: every request runs to its max_tokens
        assert m["output_throughput"] > 0 and m["mean_ttft_ms"] > 0 and m["mean_itl_ms"] > 0
        assert m["request_goodput"] == pytest.approx(m["request_throughput"])  # generous SLOs
        assert len(report["requests"][transport]) == 8
        # The in-process server's /metrics was scraped around the run.
        assert m["server_prefix_cache_queries"] > 0 and m["server_prefix_cache_hit_rate"] is not None
        if "prefix" in extra:
            assert set(FIRST_VS_REPEATS) <= set(m) and None not in [m[k] for k in FIRST_VS_REPEATS], m


@pytest.mark.parametrize("media_source", ["data-url", "upload"])
def test_bench_serve_prefix_with_a_repeated_image(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path, media_source: str
) -> None:
    """One image and a shared text in front of every prompt, request 0 sent alone: every request succeeds,
    request 0 is a cold miss on each transport (each gets a prefix of its own), and the repeats find its
    prefix, image tokens included, in the prefix cache. No timing is asserted (shared, noisy machine)."""
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--model", str(tiny_model_dir("qwen2_vl")), "--quick", "--no-progress"]
    argv += ["--json", str(out), "--workload", "prefix", "--prefix-len", "64", "--num-images", "1"]
    argv += ["--media-source", media_source, "--transport", "ws,http"]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["config"]["num_images"] == 1 and report["config"]["first_request_alone"] is True
    for transport in ("ws", "http"):
        m = report["results"][transport]
        assert m["failed"] == 0 and m["completed"] == 8, m["errors"]
        assert None not in [m[k] for k in FIRST_VS_REPEATS], m
        assert m["ttft_repeats_over_first"] == pytest.approx(m["ttft_repeats_median_ms"] / m["ttft_first_ms"])
        # Each of the 7 repeats shares at least the image and the 64-token text with request 0, and
        # finds them cached: whole 16-token blocks of it, so at least 64 tokens per repeat.
        assert m["server_prefix_cache_hits"] >= 7 * 64, m
        assert m["server_prefix_cache_hit_rate"] > 0.5, m


def test_bench_serve_server_process_against_offline(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """A child `mmserve serve` takes the requests over the WebSocket; the same requests then run through
    the offline `LLM.chat`: the same prompts (chat-templated alike), the same output tokens, and the
    throughput ratios are the online figures over the offline ones. The child is gone afterwards."""
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--model", str(tiny_model_dir("qwen2_vl")), "--quick", "--no-progress"]
    argv += ["--json", str(out), "--server-process", "--offline", "--transport", "ws"]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["config"]["server_process"] is True
    m, offline = report["results"]["ws"], report["offline"]
    assert m["failed"] == 0 and m["completed"] == 8, m["errors"]
    assert m["server_prefix_cache_queries"] > 0  # /metrics of the child was scraped
    assert report["config"]["in_process_server"] is False
    assert offline["total_input_tokens"] == m["total_input_tokens"]
    assert offline["total_output_tokens"] == m["total_output_tokens"]
    for key in ("output_throughput", "total_token_throughput"):
        assert m[f"{key}_over_offline"] == pytest.approx(m[key] / offline[key])
    # The child server was stopped: no `mmserve serve` process of ours is left, also none an exit re-parented
    # (to init: no longer our child) and none of its engine core or decode workers.
    model = str(tiny_model_dir("qwen2_vl"))
    left = []
    for proc in psutil.process_iter(["pid", "ppid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if proc.pid != os.getpid() and cmdline[1:4] == ["-m", "mmserve", "serve"] and model in cmdline:
            left.append(proc)
    children = psutil.Process().children(recursive=True)
    assert not left and not [c for c in children if c.cmdline()[1:4] == ["-m", "mmserve", "serve"]], (left, children)


def test_bench_serve_long_video_chunked_against_no_chunk(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """Text requests stream, then two videos arrive; run on a chunking `mmserve serve` child and again on
    a no-chunk one (whole prefills, whole-video encoding; its budget raised to the longest prompt, or the
    videos would be refused): every request succeeds on both, text tokens arrived while the videos were
    in, and the chunked / no-chunk ratios are reported. No timing is asserted (shared, noisy machine)."""
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--model", str(tiny_model_dir("qwen2_vl")), "--quick", "--no-progress"]
    argv += ["--json", str(out), "--workload", "long-video", "--compare-no-chunk", "--transport", "ws"]
    # Child servers, so the serve flags are real; a budget of 32 is below the longest prompt, so the
    # no-chunk server's budget must have been raised for its whole prefills to be admitted.
    argv += ["--server-process", "--max-num-encoder-tokens", "16", "--max-num-batched-tokens", "32"]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    config = report["config"]
    assert config["num_videos"] == 2 and config["num_frames"] == 8
    assert config["no_chunk_max_num_batched_tokens"] > config["max_num_batched_tokens"] == 32
    for key in ("ws", "ws/no-chunk"):
        m = report["results"][key]
        assert m["failed"] == 0 and m["completed"] == 10, m["errors"]
        assert m["video_window_s"] > 0 and m["video_ttft_median_ms"] > 0
        assert m["text_itl_in_window_gaps"] > 0, m  # the videos arrived while the texts streamed
    comparison = report["chunk_vs_no_chunk"]
    assert None not in comparison.values(), comparison
    assert comparison["p99_text_itl_in_window_chunk_over_no_chunk"] == pytest.approx(
        report["results"]["ws"]["text_itl_in_window_p99_ms"]
        / report["results"]["ws/no-chunk"]["text_itl_in_window_p99_ms"]
    )


@contextlib.contextmanager
def transformers_serve(model: Path) -> Iterator[str]:
    """`transformers serve` (transformers' own OpenAI-compatible server, a child process) preloading `model`
    on loopback; yields its base URL; the child is reaped on leaving."""
    port = free_port()
    entry = "from transformers.cli.transformers import main; main()"
    child = subprocess.Popen([sys.executable, "-c", entry, "serve", "--host", "127.0.0.1", "--port", str(port),
                              "--device", "cpu", str(model)],
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(child, url, 180)
        yield url
    finally:
        child.terminate()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(30)


def test_bench_serve_runs_a_peer_server_beside_mmserve_round_by_round(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """`--peer NAME=URL --repeats 2` against `transformers serve` on the same checkpoint: the peer takes the same
    requests over HTTP as the mmserve the bench starts, in each round; each key's figures are its median
    round's, every round is listed, and the ratios are mmserve's figures over the peer's. transformers serve
    refuses vLLM's `ignore_eos`, so the bench forces its lengths through transformers' `min_new_tokens`: both
    servers generate exactly the tokens asked for."""
    model = tiny_model_dir("qwen2")
    out = tmp_path / "serve.json"
    with transformers_serve(model) as peer_url:
        argv = ["bench", "serve", "--model", str(model), "--quick", "--no-progress", "--json", str(out)]
        argv += ["--transport", "ws", "--peer", f"hf={peer_url}", "--repeats", "2"]
        assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["config"]["peer_length_forcing"] == {"hf": "generation_config"}
    assert set(report["results"]) == {"ws", "http", "hf/http"}  # mmserve runs HTTP too, beside its ws
    for m in report["results"].values():
        assert m["failed"] == 0 and m["completed"] == 8, m["errors"]
        assert len(m["rounds"]) == 2
        assert m["output_throughput"] in sorted(r["output_throughput"] for r in m["rounds"])[:1]  # lower middle
    assert {r["round"] for r in report["requests"]["hf/http"]} == {0, 1}
    # The same requests, each of exactly its forced length, on both servers.
    ours = [r["output_tokens"] for r in report["requests"]["http"]]
    assert [r["output_tokens"] for r in report["requests"]["hf/http"]] == ours and sum(ours) > 8
    ratios = report["peers"]["hf"]
    assert ratios["output_tokens_equal"] is True
    ours, theirs = report["results"]["http"]["rounds"], report["results"]["hf/http"]["rounds"]
    per_round = [a["output_throughput"] / b["output_throughput"] for a, b in zip(ours, theirs, strict=True)]
    assert ratios["output_throughput_mmserve_over_peer_rounds"] == pytest.approx(per_round)
    assert ratios["output_throughput_mmserve_over_peer"] == pytest.approx(sum(per_round) / 2)


def test_bench_serve_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--transport", "grpc"]) == 2
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--goodput", "ttft"]) == 2
    no_media = ["--workload", "random-mm", "--num-images", "0"]
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", *no_media]) == 2
    url = ["bench", "serve", "--url", "http://127.0.0.1:9"]
    assert main([*url, "--workload", "long-video", "--num-videos", "0"]) == 2
    # The offline baseline must run the server's own checkpoint: with --url it has to be named.
    assert main([*url, "--offline"]) == 2
    assert main([*url, "--compare-no-chunk", "--workload", "long-video"]) == 2  # it starts its own servers
    assert main([*url, "--peer", "not-a-url"]) == 2
    assert main([*url, "--repeats", "0"]) == 2
    assert "goodput" in capsys.readouterr().err
