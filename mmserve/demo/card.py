"""The demo model's card (README.md in the checkpoint), written from the training log and the last
eval-demo report that sit beside the weights, so the card states only measured figures."""

from __future__ import annotations

import json
from pathlib import Path


def write_model_card(model_dir: str | Path) -> Path:
    model_dir = Path(model_dir)
    train = json.loads((model_dir / "train_log.json").read_text(encoding="utf-8"))
    eval_path = model_dir / "eval_results.json"
    report = json.loads(eval_path.read_text(encoding="utf-8")) if eval_path.is_file() else None
    cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    text, vision = cfg["text_config"], cfg["vision_config"]
    tc = train["train_config"]
    balanced = tc.get("balanced_yes_no_per_image", 0)
    lines = [
        "---",
        "license: apache-2.0",
        "library_name: transformers",
        "pipeline_tag: image-text-to-text",
        "datasets: [easy-vqa]",
        "---",
        "",
        "# mmserve demo model: a tiny Qwen2-VL that answers questions about shapes",
        "",
        "A Qwen2-VL (transformers' `Qwen2VLForConditionalGeneration`) of "
        f"{train['num_parameters'] / 1e6:.2f} M parameters, trained from scratch on the CPU by "
        "`mmserve train-demo` so that `make serve` shows the whole pipeline giving right answers without "
        "downloading anything. It knows easy-vqa's world only: one circle, rectangle or triangle in one of "
        "eight colours; in a video, also which way it moves. Anything else gets one of those words back.",
        "",
        "## Architecture",
        "",
        f"- Decoder: {text['num_hidden_layers']} layers, hidden {text['hidden_size']}, "
        f"{text['num_attention_heads']} query / {text['num_key_value_heads']} KV heads, MLP "
        f"{text['intermediate_size']}, M-RoPE sections {text['rope_parameters']['mrope_section']}, vocabulary "
        f"{text['vocab_size']} (a byte-level BPE trained here, with Qwen2-VL's special tokens and chat template).",
        f"- Vision tower: {vision['depth']} blocks of width {vision['embed_dim']}, patches of 14 px, 2x2 merge. "
        "Every image and frame is resized to 84x84 (`min_pixels` = `max_pixels` = 7056): 9 tokens per image, "
        "9 per pair of video frames.",
        "",
        "## Training",
        "",
        "```bash",
        f"mmserve train-demo --epochs {tc['epochs']:g} --seed {tc['seed']}",
        "```",
        "",
        "- Data: easy-vqa's train split (4,000 64x64 images, 38,575 questions, 13 answers)"
        + (
            f" with {balanced} generated yes/no questions per image in easy-vqa's phrasings, right half the time"
            if balanced
            else ""
        )
        + f", and {train['num_items'] - 4000} rendered clips (8 frames at 2 fps, H.264) of one shape moving "
        f"left, right, up or down, {5 if balanced else 4} questions each (shape, colour, direction, yes/no "
        f"about a direction). {train['num_questions']:,} question/answer pairs in all.",
        f"- Stage 1, {tc['vision_steps']} steps of {tc['vision_items_per_step']} items: the vision tower alone, "
        "with linear heads on the max over each item's output tokens predicting its shape, colour and "
        "direction (cosine learning rate; the heads are discarded). The tower is then frozen.",
        f"- Stages 2 and 3, {train['num_steps']} steps: the decoder (the frozen tower's outputs computed once); the "
        f"first {tc['grounding_steps']} on the questions whose answer names what is shown (no yes/no), then "
        f"{tc['epochs']:g} passes over all questions, {tc['items_per_step']} media items per step; AdamW "
        f"lr {tc['lr']:g} (warmup {tc['warmup_steps']}, cosine to 5%), weight decay {tc['weight_decay']:g}, "
        "loss on the answer tokens and `<|im_end|>` only.",
        *_yes_no_stage_lines(tc),
        f"- Took {train['train_seconds'] / 60:.1f} min with {train['torch_threads']} torch threads "
        "(this repository's 2-core CPU machine).",
        "",
        "## Accuracy (greedy, through mmserve's engine: `mmserve eval-demo`)",
        "",
    ]
    if report is None:
        lines.append("Not measured yet: run `mmserve eval-demo --json <this dir>/eval_results.json`.")
    else:
        lines += ["| split | questions | accuracy | by answer kind |", "| --- | --- | --- | --- |"]
        for name, label in (("image", "easy-vqa test images"), ("video", "held-out clips")):
            if name in report:
                r = report[name]
                kinds = ", ".join(f"{k} {v['accuracy']:.1%}" for k, v in r["by_kind"].items())
                lines.append(f"| {label} | {r['questions']:,} | {r['accuracy']:.1%} | {kinds} |")
        lines += ["", "An answer counts when it equals the expected one after lower-casing and stripping."]
        for name, label in (("image", "test images"), ("video", "held-out clips")):
            split = report.get(name, {}).get("yes_no", {})
            if {"names_what_is_shown", "names_something_else"} <= split.keys():
                shown, other = split["names_what_is_shown"], split["names_something_else"]
                lines.append("")
                lines.append(
                    f"On {label}, yes/no questions that name what is shown: {shown['accuracy']:.1%} right "
                    f"({shown['questions']:,}); that name something else: {other['accuracy']:.1%} "
                    f"({other['questions']:,}). A model reading the picture gets both right; one answering "
                    "from the wording (\"no\", or \"yes\" when negated) only the second."
                )
    lines += [
        "",
        "## Licences",
        "",
        "- easy-vqa (Victor Zhou), MIT: the images and questions ship inside its PyPI wheel (`pip install "
        "easy-vqa`); nothing was downloaded from elsewhere.",
        "- The clips are rendered by `mmserve/demo/data.py`; the weights, tokenizer and this card are "
        "Apache-2.0, as mmserve.",
        "",
    ]
    out = model_dir / "README.md"
    out.write_text("\n".join(lines), encoding="utf-8")
    return out


def _yes_no_stage_lines(tc: dict) -> list[str]:
    from mmserve.demo.data import YES_NO_FORMS

    phases = tc.get("yes_no_phases") or []
    if not phases:
        return []

    def describe(form: str) -> str:
        about, num_phrasings = YES_NO_FORMS[form.removesuffix("+own")]
        text = {"color": "colour", "shape": "shape", "both": "colour or shape"}[about] + {
            1: ' in one phrasing ("is there a ...?")', 4: " in easy-vqa's four un-negated phrasings",
            8: " in all eight of easy-vqa's phrasings, negation included",
        }[num_phrasings]  # fmt: skip
        if form.endswith("+own"):
            text += (f", {tc['yes_no_mix_fraction']:.0%} swapped for the image's own easy-vqa questions, its "
                     f"naming questions kept and every {tc['yes_no_clip_every']}th step clips")  # fmt: skip
        return text

    return [
        f"- Stage 4, {sum(n for _, n in phases)} steps of the decoder on generated yes/no questions that name "
        "what the picture shows half the time, one form at a time: "
        + "; ".join(f"{n} steps of {describe(form)}" for form, n in phases)
        + f". {tc['yes_no_images_per_step']} images x {tc['yes_no_questions_per_image']} generated questions "
        f"per step, AdamW lr {tc['yes_no_lr']:g} (warmup 50, cosine to 5%), weight decay "
        f"{tc['yes_no_weight_decay']:g}. Trained on easy-vqa's own questions alone, the decoder answered "
        "yes/no from the wording and almost never right where the question names what is shown; all eight "
        "phrasings at once never left that plateau, one form at a time does (`docs/demo_model.md` in mmserve).",
    ]
