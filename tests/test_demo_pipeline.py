"""The demo model's pipeline on a small scale: rendered clips and their questions, `train_demo` writing a
checkpoint that mmserve loads and serves, `evaluate_demo` through `LLM.chat`, the model card, and how the
name "demo" resolves (and falls back in the CLI) when no trained checkpoint is committed."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

import mmserve.cli as cli
import mmserve.demo as demo
from mmserve.demo.card import write_model_card
from mmserve.demo.data import (
    CLIP_FRAMES,
    COLORS,
    DIRECTIONS,
    SHAPES,
    balanced_yes_no,
    direction_yes_no,
    easy_vqa_questions,
    make_clips,
    video_questions,
)
from mmserve.demo.evaluate import answer_kind, evaluate_demo, names_what_is_shown
from mmserve.demo.train import TrainConfig, train_demo
from mmserve.encoders.media import load_video
from mmserve.errors import InvalidRequestError


def test_clips_decode_to_every_frame_and_move_the_way_their_label_says() -> None:
    for clip in make_clips(6, seed=11):
        assert clip.frames.shape == (CLIP_FRAMES, 64, 64, 3)
        np.testing.assert_array_equal(load_video(clip.mp4).frames, clip.frames)  # what the server sees
        # The shape's centre of mass (pixels far from the light background) moves along the label.
        dark = clip.frames.astype(int).min(-1) < 200
        ys, xs = zip(*(np.argwhere(f).mean(0) for f in dark), strict=True)
        dx, dy = xs[-1] - xs[0], ys[-1] - ys[0]
        want_x, want_y = DIRECTIONS[clip.direction]
        moved = (dx if want_x else dy) * (want_x or want_y)
        assert moved > 10, (clip.direction, dx, dy)
        pairs = video_questions(clip, random.Random(0))
        kinds = [answer_kind(a) for _, a in pairs]
        assert kinds == ["shape", "color", "direction", "yes/no"]
        assert pairs[0][1] == clip.shape in SHAPES and pairs[1][1] == clip.color in COLORS


def test_generated_yes_no_questions_are_balanced_and_phrased_as_easy_vqa() -> None:
    phrasings = {_template(q.text) for q in easy_vqa_questions("train") if q.answer in ("yes", "no")}
    pairs = balanced_yes_no("triangle", "teal", random.Random(0), 2000)
    assert {_template(q) for q, _ in pairs} <= phrasings  # no wording the test split does not use
    assert 0.45 < sum(a == "yes" for _, a in pairs) / len(pairs) < 0.55
    for question, answer in pairs:
        names_it = "teal shape" in question or "triangle" in question
        negated = " not " in question or question.startswith("is no ")
        assert answer == ("yes" if names_it != negated else "no"), question
    clip = make_clips(1, seed=4)[0]
    yes, no = direction_yes_no(clip, random.Random(1))
    assert yes[1] == "yes" and clip.direction in yes[0]
    assert no[1] == "no" and clip.direction not in no[0]


def test_yes_no_curriculum_forms() -> None:
    rng = random.Random(0)
    color = balanced_yes_no("circle", "red", rng, 400, form="color")
    assert {q for q, _ in color} == {f"is there a {c} shape?" for c in COLORS}
    assert all(a == ("yes" if "red" in q else "no") for q, a in color)
    shape = balanced_yes_no("circle", "red", rng, 400, form="shape")
    assert {q for q, _ in shape} == {f"is there a {s}?" for s in SHAPES}
    assert all(a == ("yes" if "circle" in q else "no") for q, a in shape)
    assert 0.4 < sum(a == "yes" for _, a in color + shape) / 800 < 0.6
    # "all": colour or shape, in each of the eight phrasings; "color-plain": colour, the four un-negated.
    assert len({_template(q) for q, _ in balanced_yes_no("circle", "red", rng, 400)}) == 16
    plain = balanced_yes_no("circle", "red", rng, 400, form="color-plain")
    assert len({_template(q) for q, _ in plain}) == 4 and all(" not " not in q and "shape" in q for q, _ in plain)
    with pytest.raises(ValueError, match="unknown forms"):
        TrainConfig(yes_no_phases=(("negated", 10),))


def test_yes_no_questions_split_by_whether_they_name_what_is_shown() -> None:
    assert names_what_is_shown("is there a red shape?", "yes")
    assert names_what_is_shown("is there not a circle in the image?", "no")
    assert names_what_is_shown("is no triangle present?", "no")
    assert names_what_is_shown("does the circle move left?", "yes")
    assert not names_what_is_shown("does the image contain a green shape?", "no")
    assert not names_what_is_shown("does the image not contain a black shape?", "yes")
    assert not names_what_is_shown("is the shape moving up?", "no")


def _template(question: str) -> str:
    for word in (*COLORS, *SHAPES):
        question = question.replace(word, "X")
    return question


def test_train_demo_writes_a_checkpoint_mmserve_serves_and_evaluates(tmp_path: Path) -> None:
    cfg = TrainConfig(vision_steps=2, vision_items_per_step=4, grounding_steps=2, grounding_items_per_step=4,
                      epochs=0.5, items_per_step=4, warmup_steps=1, max_images=8, num_clips=4,
                      balanced_yes_no_per_image=2, yes_no_phases=(("shape", 1), ("all", 2), ("color-all+own", 2)),
                      yes_no_images_per_step=2, yes_no_clip_every=2)  # fmt: skip
    summary = train_demo(tmp_path, cfg)
    assert summary["num_items"] == 12 and summary["num_steps"] == 2 + 2
    assert [(h["form"], h["step"]) for h in summary["yes_no_history"]] == [("shape", 1), ("all", 3), ("color-all+own", 5)]
    by_image: dict[int, list[str]] = {}
    for q in easy_vqa_questions("train"):
        by_image.setdefault(q.media_id, []).append(q.answer)
    first = [by_image[i] for i in sorted(by_image)[:8]]
    labelled = sum(bool(set(a) & set(SHAPES)) and bool(set(a) & set(COLORS)) for a in first)
    expected = sum(map(len, first)) + cfg.balanced_yes_no_per_image * labelled + 5 * 4  # clips: 4 + 1 balancing
    assert summary["num_questions"] == expected
    assert {"vision_history", "history", "train_seconds"} <= summary.keys()
    report = evaluate_demo(tmp_path, max_image_questions=6, num_clips=1, use_tqdm=False)
    assert report["image"]["questions"] == 6 and report["video"]["questions"] == 4
    assert 0.0 <= report["image"]["accuracy"] <= 1.0
    split = report["image"]["yes_no"]
    assert sum(v["questions"] for v in split.values()) == report["image"]["by_kind"]["yes/no"]["questions"]
    (tmp_path / "eval_results.json").write_text(json.dumps(report), encoding="utf-8")
    card = write_model_card(tmp_path).read_text(encoding="utf-8")
    assert "easy-vqa test images | 6 |" in card and "mmserve train-demo" in card


def test_demo_name_without_a_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "DEMO_MODEL_DIR", tmp_path / "missing")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidRequestError, match="train-demo"):
        demo.resolve_model("demo")
    assert demo.resolve_model("other/dir") == Path("other/dir")
    # The CLI serves the generated tiny model instead, so `make serve` always runs.
    monkeypatch.setattr(cli, "FALLBACK_MODEL_DIR", tmp_path / "tiny")
    assert cli._model_or_fallback("demo") == str(tmp_path / "tiny")
    assert (tmp_path / "tiny" / "config.json").is_file()
    assert cli._model_or_fallback("some/dir") == "some/dir"
