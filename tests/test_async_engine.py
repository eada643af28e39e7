"""AsyncEngine: concurrent streams equal the offline engine, early close and abort free memory,
bad input fails only its own request, a full queue is refused, shutdown drains."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mmserve import LLM, SamplingParams
from mmserve.config import EngineArgs
from mmserve.engine.async_engine import AsyncEngine, QueueFullError
from mmserve.errors import EngineDeadError, InvalidRequestError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["a red circle", "the quick brown fox jumps", "x", "hello " * 30]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("qwen2_vl")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> AsyncEngine:
    return AsyncEngine(EngineArgs(str(model_dir), max_num_batched_tokens=64))


async def collect(engine: AsyncEngine, prompt: object, params: SamplingParams = GREEDY) -> tuple[str, list]:
    text, outputs = "", []
    async for out in engine.generate(prompt, params):
        text += out.new_text
        outputs.append(out)
    return text, outputs


def wait_idle(engine: AsyncEngine) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks:
            return
        time.sleep(0.01)
    raise AssertionError(f"engine did not go idle: {engine.stats()}")


def test_concurrent_streams_equal_offline_generation(engine: AsyncEngine, model_dir: Path) -> None:
    async def main() -> list[tuple[str, list]]:
        return await asyncio.gather(*(collect(engine, p) for p in PROMPTS))

    results = asyncio.run(main())
    expected = LLM(model_dir, max_num_batched_tokens=64).generate(PROMPTS, GREEDY)
    for (text, outputs), exp in zip(results, expected, strict=True):
        final = outputs[-1]
        assert final.finish_reason == "length" and final.token_ids == exp.token_ids
        assert text == final.text == exp.text
        assert all(o.finish_reason is None for o in outputs[:-1])
    wait_idle(engine)


def test_closing_a_stream_early_aborts_the_request(engine: AsyncEngine) -> None:
    async def main() -> None:
        stream = engine.generate("keep going", SamplingParams(max_tokens=500, ignore_eos=True))
        async for out in stream:
            if len(out.token_ids) >= 3:
                break
        await stream.aclose()

    asyncio.run(main())
    wait_idle(engine)


def test_abort_by_id_ends_the_stream_with_abort(engine: AsyncEngine) -> None:
    async def main() -> str | None:
        last = None
        async for out in engine.generate(
            "abort me", SamplingParams(max_tokens=500, ignore_eos=True), "abort-1"
        ):
            if len(out.token_ids) == 2:
                engine.abort("abort-1")
            last = out
        return last.finish_reason if last else None

    assert asyncio.run(main()) == "abort"
    wait_idle(engine)


def test_bad_request_fails_alone(engine: AsyncEngine) -> None:
    async def main() -> None:
        good = asyncio.create_task(collect(engine, "fine"))
        with pytest.raises(InvalidRequestError):
            await collect(
                engine, {"prompt": "<|vision_start|><|image_pad|><|vision_end|>", "images": [b"junk"]}
            )
        _, outputs = await good
        assert outputs[-1].finish_reason == "length"

    asyncio.run(main())
    wait_idle(engine)


def test_full_queue_is_refused_with_retry_after(model_dir: Path) -> None:
    engine = AsyncEngine(EngineArgs(str(model_dir)), max_waiting_requests=0)

    async def main() -> None:
        with pytest.raises(QueueFullError) as info:
            await collect(engine, "hi")
        assert info.value.retry_after > 0
        await engine.shutdown(timeout=1)

    asyncio.run(main())


def test_shutdown_drains_then_refuses(model_dir: Path) -> None:
    engine = AsyncEngine(EngineArgs(str(model_dir)))

    async def main() -> None:
        task = asyncio.create_task(collect(engine, "drain me"))
        await asyncio.sleep(0)
        await asyncio.sleep(0.05)
        await engine.shutdown(timeout=10)
        _, outputs = await task
        assert outputs[-1].finish_reason == "length"
        with pytest.raises(EngineDeadError):
            await collect(engine, "too late")

    asyncio.run(main())
    assert not engine.is_running


def test_an_output_snapshot_copies_every_field_and_owns_its_lists() -> None:
    import dataclasses

    from mmserve.engine.async_engine import _snapshot
    from mmserve.engine.output_processor import RequestMetrics, RequestOutput

    for logprobs in (None, [{5: -0.1}]):
        out = RequestOutput("r", "p", [1, 2], token_ids=[5, 6], text="ab", logprobs=logprobs and list(logprobs),
                            metrics=RequestMetrics(1.0), new_text="b", new_token_ids=[6], index=2)  # fmt: skip
        copy = _snapshot(out)
        assert type(copy) is RequestOutput and dataclasses.asdict(copy) == dataclasses.asdict(out)
        out.token_ids.append(7)
        out.new_token_ids.append(7)
        if out.logprobs is not None:
            out.logprobs.append({7: -0.2})
        out.text = "abc"
        # What the output thread updates next does not reach the consumer's copy.
        assert copy.token_ids == [5, 6] and copy.new_token_ids == [6] and copy.text == "ab"
        assert copy.logprobs == logprobs and (logprobs is None or copy.logprobs is not out.logprobs)
