"""One request's prefill in-process: `generate()` with max_tokens=1 over random token ids (a fresh prompt each time, so
no prefix-cache hit), the median of 5 per prompt length, as the wall time (the in-process first token) and the
summed forward time of its steps. The bench checkpoint (`$MODEL` overrides), the default engine settings.

  python scripts/prefill_time.py bfloat16|float32 [lengths, default 96,512,2048]

A/B against another revision: `PYTHONPATH=<worktree> python <worktree or this>/scripts/prefill_time.py ...`.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

from mmserve import LLM, SamplingParams


def main() -> None:
    dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
    lengths = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "96,512,2048").split(",")]
    llm = LLM(os.environ.get("MODEL", os.path.expanduser("~/.cache/mmserve/bench-qwen2")), dtype=dtype)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    llm.generate([{"prompt_token_ids": [rng.randrange(8000) for _ in range(64)]}], params)  # warm-up
    line = []
    for n in lengths:
        walls, forwards = [], []
        for _ in range(5):
            llm.step_records.clear()
            ids = [rng.randrange(8000) for _ in range(n)]
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], params)
            walls.append(time.perf_counter() - start)
            forwards.append(sum(r.forward_duration_s for r in llm.step_records))
        line.append(f"{n}: {statistics.median(walls) * 1e3:.1f} ms (forward {statistics.median(forwards) * 1e3:.1f})")
    print(dtype, "  ".join(line))


if __name__ == "__main__":
    main()
