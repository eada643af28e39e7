"""The command line: make-tiny-model, the offline generate demo behind `make serve`, and a quick
`bench throughput` run on a tiny model with every system."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from mmserve.bench import SYSTEMS
from mmserve.cli import main


def test_make_tiny_model_writes_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-tiny-model", str(tmp_path / "m"), "--arch", "qwen2", "--seed", "3"]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in (tmp_path / "m").iterdir()
    }
    assert "wrote qwen2" in capsys.readouterr().out


def test_generate_prints_one_json_object_per_prompt(
    tiny_model_dir: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_model_dir("qwen2_vl")
    code = main(
        [
            "generate",
            "--model",
            str(model),
            "--prompt",
            "hi",
            "--prompt",
            "there",
            "--max-tokens",
            "5",
            "--json",
        ]
    )
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["hi", "there"]
    assert all(1 <= line["num_tokens"] <= 5 for line in lines)


def test_generate_shows_images_and_videos_with_every_prompt(
    tiny_model_dir: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model, assets = str(tiny_model_dir("qwen2_vl")), Path(__file__).parent.parent / "assets"
    assert main(["generate", "--model", model, "--prompt", "hi", "--max-tokens", "2", "--json"]) == 0
    text_only = json.loads(capsys.readouterr().out)["num_prompt_tokens"]
    argv = ["generate", "--model", model, "--prompt", "hi", "--prompt", "yo", "--max-tokens", "2", "--json",
            "--image", str(assets / "sample.jpg"), "--video", str(assets / "sample_clip.mp4")]  # fmt: skip
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["hi", "yo"]
    # Both prompts carry the image's and the video's embedding placeholders.
    assert all(line["num_prompt_tokens"] > text_only + 10 for line in lines)


def test_bench_throughput_quick_run(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = [
        "bench",
        "throughput",
        "--model",
        str(tiny_model_dir("qwen2_vl")),
        "--systems",
        ",".join(SYSTEMS),
        "--num-prompts",
        "6",
        "--input-len",
        "4-40",
        "--output-len",
        "2-12",
        "--hf-batch-size",
        "4",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report["systems"]) == set(SYSTEMS)
    assert report["systems"]["hf-static"]["ratio_to_hf_static"] == pytest.approx(1.0)
    for result in report["systems"].values():
        assert result["output_tokens_per_s"] > 0 and result["efficiency"] > 0
    # Every mmserve policy computes the same greedy tokens as the first system (plain mmserve).
    assert all(
        report["outputs_differing_from_first_system"][s] == 0
        for s in SYSTEMS
        if s.startswith("mmserve") and s != "mmserve-structured"  # constrained: other tokens by design
    )
    # mmserve-eager against mmserve: no decode graphs off CUDA either way, so the bench says so and times both.
    graphs = {s: report["systems"][s]["decode_graphs"] for s in ("mmserve", "mmserve-eager")}
    assert graphs["mmserve"] == graphs["mmserve-eager"] == {"mode": "off", "sizes": [], "replayed_steps": 0}
    assert report["decode_graphs_speedup"] > 0
