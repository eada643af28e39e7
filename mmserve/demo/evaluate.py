"""`mmserve eval-demo`: the demo model's accuracy through mmserve's own engine.

Image questions are easy-vqa's **test** split (images the model never saw); video questions are about
held-out clips rendered with a seed training never used. Every question goes through `LLM.chat` as a
user would send it (the PNG or mp4 bytes and the question), greedy; an answer counts when it equals the
expected one after lower-casing and stripping.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path

from mmserve.demo.data import (
    COLORS,
    DIRECTIONS,
    SHAPES,
    easy_vqa_image_paths,
    easy_vqa_questions,
    make_clips,
    video_questions,
)
from mmserve.demo.train import HELD_OUT_CLIP_SEED
from mmserve.request import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def answer_kind(answer: str) -> str:
    if answer in ("yes", "no"):
        return "yes/no"
    if answer in SHAPES:
        return "shape"
    if answer in COLORS:
        return "color"
    if answer in DIRECTIONS:
        return "direction"
    return "other"


def names_what_is_shown(question: str, answer: str) -> bool:
    """Whether a yes/no question names what the picture shows ("is there a red shape?" over a red
    shape; "is there not a circle?" over a circle). Its answer is then "yes" unless it is negated: a
    model that answers from the wording alone ("no", or "yes" when negated) gets only the others right."""
    negated = " not " in f" {question} " or question.startswith("is no ")
    return (answer == "yes") != negated


def normalize(text: str) -> str:
    return text.strip().lower()


def image_conversation(png: bytes, question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": png}, {"type": "text", "text": question}]}]


def video_conversation(mp4: bytes, question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video", "video": mp4}, {"type": "text", "text": question}]}]


def evaluate_demo(
    model: str | Path = "demo",
    *,
    max_image_questions: int | None = None,
    num_clips: int = 250,
    seed: int = 0,
    use_tqdm: bool = True,
) -> dict:
    """Accuracy on easy-vqa test questions (all, or `max_image_questions` drawn with `seed`) and on four
    questions about each of `num_clips` held-out clips. Returns the figures and a few sample answers."""
    from mmserve.engine.llm import LLM

    started = time.monotonic()
    llm = LLM(model, max_num_seqs=256, max_num_batched_tokens=4096)
    questions = easy_vqa_questions("test")
    if max_image_questions is not None and max_image_questions < len(questions):
        questions = random.Random(seed).sample(questions, max_image_questions)
    paths = easy_vqa_image_paths("test")
    pngs = {i: Path(paths[i]).read_bytes() for i in {q.media_id for q in questions}}
    image_cases = [(image_conversation(pngs[q.media_id], q.text), q.text, q.answer) for q in questions]

    rng = random.Random(seed + 1)
    video_cases = []
    for clip in make_clips(num_clips, HELD_OUT_CLIP_SEED):
        for text, answer in video_questions(clip, rng):
            video_cases.append((video_conversation(clip.mp4, text), text, answer))

    report: dict = {"model": str(model)}
    for name, cases in (("image", image_cases), ("video", video_cases)):
        if not cases:
            continue
        outputs = llm.chat([c for c, _, _ in cases], GREEDY, use_tqdm=use_tqdm)
        right: Counter[str] = Counter()
        total: Counter[str] = Counter()
        yes_no: dict[str, list[int]] = {"names_what_is_shown": [0, 0], "names_something_else": [0, 0]}
        samples = []
        for (_, text, answer), out in zip(cases, outputs, strict=True):
            kind = answer_kind(answer)
            total[kind] += 1
            ok = normalize(out.text) == answer
            right[kind] += ok
            if kind == "yes/no":
                split = yes_no["names_what_is_shown" if names_what_is_shown(text, answer) else "names_something_else"]
                split[0] += ok
                split[1] += 1
            if len(samples) < 8:
                samples.append({"question": text, "expected": answer, "answer": out.text, "correct": ok})
        report[name] = {
            "questions": sum(total.values()),
            "accuracy": round(sum(right.values()) / sum(total.values()), 4),
            "by_kind": {k: {"questions": total[k], "accuracy": round(right[k] / total[k], 4)} for k in sorted(total)},
            # yes/no accuracy by whether the question names what is shown: both must be high for the
            # answers to come from the picture rather than from the question's wording.
            "yes_no": {k: {"questions": n, "accuracy": round(r / n, 4)} for k, (r, n) in yes_no.items() if n},
            "samples": samples,
        }
    stats = llm.stats()
    report["seconds"] = round(time.monotonic() - started, 1)
    report["prefix_cache_hit_rate"] = round(stats.prefix_cache_hits / max(1, stats.prefix_cache_queries), 3)
    return report
