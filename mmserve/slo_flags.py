"""argparse flags of how the `slo` scheduler policy plans steps, defined once for `mmserve serve` (mmserve/cli.py)
and `mmserve bench serve --workload slo-mix` (mmserve/bench/cli.py), so the two always take the same flags."""

from __future__ import annotations

import argparse


def add_slo_planner_flags(g: argparse._ArgumentGroup) -> None:
    """How the `slo` policy plans steps: shared by `serve` and `bench serve --workload slo-mix`."""
    g.add_argument("--max-step-ms", type=float, default=250.0,
                   help="every chunking policy (fcfs, priority, slo) sizes a step that carries running decodes "
                        "to stay within this, by the online step-time model; 0: fixed token budgets only")  # fmt: skip
    g.add_argument("--step-time-model", default=None,
                   help="a warm start for the online step-time model: JSON written by `mmserve bench profile` "
                        "(without it: a slow built-in prior, refitted from the first steps on)")  # fmt: skip
    g.add_argument("--batch-min-share", type=float, default=0.1,
                   help="share of each step kept for batch work when there is some")  # fmt: skip
    g.add_argument("--step-time-headroom", type=float, default=0.1,
                   help="steps are planned to (1 - this) x their time target (--max-step-ms, or the tightest "
                        "interactive TBT), further divided by the step-time model's measured error")  # fmt: skip
    g.add_argument("--tbt-slack-ms", type=float, default=250.0,
                   help="a stream ahead of its TBT pace may lend up to this much of its lead to one step (TPOT "
                        "is a mean; a step stays within --max-step-ms regardless); 0: every step fits the TBT "
                        "target")  # fmt: skip
