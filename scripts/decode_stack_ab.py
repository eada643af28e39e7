"""In-process A/B of the one-call decode step: two LLMs over the bench checkpoint (fp32), one with
MMSERVE_CPU_DECODE_STACK=0, the same greedy requests in interleaved rounds; the median decode-only step per
stream count, and whether the tokens match.

  python scripts/decode_stack_ab.py 1 2 4 8 16
"""

from __future__ import annotations

import os
import statistics
import sys

from mmserve import LLM, SamplingParams
from mmserve.kernels import cpu_decoder


def main() -> None:
    llms = {}
    for setting in ("0", "1"):
        os.environ[cpu_decoder.ENV] = setting
        llms[setting] = LLM(os.path.expanduser("~/.cache/mmserve/bench-qwen2"), dtype="float32")
    params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    counts = [int(a) for a in sys.argv[1:]] or [1, 2, 4, 8, 16]
    steps: dict[tuple[str, int], list[float]] = {(s, n): [] for s in llms for n in counts}
    tokens = {}
    for _ in range(3):
        for n in counts:
            for setting, llm in llms.items():
                llm.step_records.clear()
                outputs = llm.generate([f"the {i} " * 30 for i in range(n)], params)
                tokens[setting, n] = [o.token_ids for o in outputs]
                decodes = [r for r in llm.step_records if r.num_prefill_tokens == 0][5:]
                steps[setting, n].append(statistics.median(r.duration_s for r in decodes) * 1e3)
    for n in counts:
        off, on = statistics.median(steps["0", n]), statistics.median(steps["1", n])
        print(f"streams {n:3d}: layer by layer {off:6.2f} ms, one call {on:6.2f} ms, ratio {off / on:.2f}; "
              f"rounds {[round(x, 2) for x in steps['0', n]]} / {[round(x, 2) for x in steps['1', n]]}; "
              f"same tokens: {tokens['0', n] == tokens['1', n]}")  # fmt: skip


if __name__ == "__main__":
    main()
