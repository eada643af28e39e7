"""`mmserve train-demo` and `mmserve eval-demo`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mmserve.demo import DEMO_MODEL_DIR, resolve_model
from mmserve.demo.card import write_model_card

DEMO_COMMANDS = ("train-demo", "eval-demo")


def add_demo_parsers(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser(
        "train-demo", help="train the demo model (Qwen2-VL, ~2.6 M parameters) on easy-vqa, on the CPU"
    )
    train.add_argument("--out-dir", type=Path, default=DEMO_MODEL_DIR)
    train.add_argument("--epochs", type=float, default=None, help="passes over all questions after grounding (default: 1.25)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")

    ev = sub.add_parser("eval-demo", help="the demo model's accuracy through mmserve's engine")
    ev.add_argument("--model", default="demo")
    ev.add_argument(
        "--max-image-questions", type=int, default=None, help="a seeded sample (default: all 9,673)"
    )
    ev.add_argument("--num-clips", type=int, default=250, help="held-out clips, four questions each")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--json", type=Path, default=None, help="write the report here")
    ev.add_argument(
        "--write-card", action="store_true",
        help="save the report as the model's eval_results.json and rewrite its README.md (the model card)",
    )  # fmt: skip


def run_demo_command(args: argparse.Namespace) -> int:
    if args.command == "train-demo":
        from mmserve.demo.train import TrainConfig, train_demo

        cfg = TrainConfig(seed=args.seed, num_threads=args.threads)
        if args.epochs is not None:
            cfg = TrainConfig(epochs=args.epochs, seed=args.seed, num_threads=args.threads)
        summary = train_demo(args.out_dir, cfg)
        write_model_card(args.out_dir)
        last = summary["history"][-1]
        print(f"wrote the demo model to {args.out_dir} in {summary['train_seconds']} s ({summary['num_steps']} "
              f"steps; teacher-forced accuracy at the end: yes/no {last['acc_yes/no']:.3f}, "
              f"other {last['acc_other']:.3f})")  # fmt: skip
        return 0
    from mmserve.demo.evaluate import evaluate_demo

    report = evaluate_demo(
        args.model, max_image_questions=args.max_image_questions, num_clips=args.num_clips, seed=args.seed
    )
    for name in ("image", "video"):
        if name in report:
            r = report[name]
            kinds = ", ".join(f"{k} {v['accuracy']:.1%} of {v['questions']}" for k, v in r["by_kind"].items())
            print(f"{name}: {r['accuracy']:.1%} of {r['questions']} questions ({kinds})")
            for k, v in r.get("yes_no", {}).items():
                print(f"  yes/no, question {k.replace('_', ' ')}: {v['accuracy']:.1%} of {v['questions']}")
    text = json.dumps(report, indent=2) + "\n"
    if args.json is not None:
        args.json.write_text(text, encoding="utf-8")
    if args.write_card:
        model_dir = resolve_model(args.model)
        (model_dir / "eval_results.json").write_text(text, encoding="utf-8")
        print(f"wrote {write_model_card(model_dir)}")
    return 0
