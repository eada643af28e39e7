"""The runner's persistent step-input buffers: each write's values land in the views of its layout, a repeated
layout reuses its views (no new tensors), and growing the buffer or a layout of another size is handled."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.engine.model_runner import ModelRunner, step_input_views
from mmserve.engine.step_inputs import StepInputBuffer
from mmserve.models.config import DecoderConfig
from mmserve.request import Request, SamplingParams
from mmserve.scheduler.scheduler import Scheduler


def _split(layout: tuple[int, int], device: torch.Tensor, host: torch.Tensor) -> tuple[torch.Tensor, ...]:
    first, second = layout
    return (*device.split([first, second]), host)


def test_values_land_in_their_layout_views_and_a_repeated_layout_reuses_them() -> None:
    buffer = StepInputBuffer(torch.device("cpu"), _split, capacity=8)
    a, b, host = buffer.write([1, 2, 3, 9], num_device=3, layout=(2, 1))
    assert a.tolist() == [1, 2] and b.tolist() == [3] and host.tolist() == [9]
    again = buffer.write([4, 5, 6, 7], num_device=3, layout=(2, 1))
    assert all(x is y for x, y in zip(again, (a, b, host), strict=True))  # the same tensors, rewritten
    assert a.tolist() == [4, 5] and b.tolist() == [6] and host.tolist() == [7]
    other = buffer.write([8, 9, 10], num_device=3, layout=(1, 2))
    assert [t.tolist() for t in other] == [[8], [9, 10], []]
    assert buffer.num_layouts == 2


def test_a_write_past_the_capacity_grows_the_buffers_and_drops_the_old_views() -> None:
    buffer = StepInputBuffer(torch.device("cpu"), _split, capacity=4)
    buffer.write([1, 2, 3], num_device=3, layout=(1, 2))
    values = list(range(10))
    a, b, host = buffer.write(values, num_device=6, layout=(5, 1))
    assert buffer.capacity >= 10 and buffer.num_layouts == 1
    assert a.tolist() == values[:5] and b.tolist() == [5] and host.tolist() == values[6:]
    small = buffer.write([7, 8, 9], num_device=3, layout=(1, 2))  # made again, over the new buffers
    assert [t.tolist() for t in small] == [[7], [8, 9], []]


def test_a_layout_written_with_another_count_is_an_error() -> None:
    buffer = StepInputBuffer(torch.device("cpu"), _split)
    buffer.write([1, 2, 3], num_device=3, layout=(1, 2))
    with pytest.raises(ValueError, match="was 3 values, now 4"):
        buffer.write([1, 2, 3, 4], num_device=3, layout=(1, 2))


def _run(runner: ModelRunner, requests: list[Request], block_size: int) -> tuple[dict[str, list[int]], int]:
    """Every request to the end through a real scheduler and `runner`; -> each one's sampled token ids, and
    the number of steps."""
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=24, max_step_ms=None), CacheConfig(block_size, 64))
    for request in requests:
        scheduler.add_request(request)
    sampled: dict[str, list[int]] = {r.request_id: [] for r in requests}
    num_steps = 0
    while scheduler.has_unfinished_requests():
        num_steps += 1
        plan = scheduler.schedule()
        output = runner.execute(plan)
        for request_id, token_id in zip(output.request_ids, output.sampled_token_ids, strict=True):
            sampled[request_id].append(token_id)
        scheduler.update(plan, output)
    return sampled, num_steps


class _FreshInputs:
    """A step-input buffer that makes new tensors at every step: the reference the reused views must equal."""

    def write(self, values: list[int], num_device: int, layout: tuple[int, int, int, int, int]) -> object:
        return StepInputBuffer(torch.device("cpu"), step_input_views).write(values, num_device, layout)


def test_the_runner_reuses_a_decode_layout_and_its_tokens_equal_unbuffered_inputs(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps of an unchanged batch repeat a layout: the runner makes views only when the batch's shape
    changes (a prefill chunk, a request joining or leaving, a new KV block), and samples exactly what a runner
    that builds fresh tensors every step samples."""
    model_dir = tiny_model_dir("qwen2")
    cfg, hf_config = DecoderConfig.from_pretrained(model_dir)
    block_size = 4

    def requests() -> list[Request]:
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        return [Request(f"r{i}", list(range(3 + i, 20 + 3 * i)), params) for i in range(3)]

    runner = ModelRunner(model_dir, cfg, torch.device("cpu"), torch.float32, 64, block_size, hf_config)
    buffered, num_steps = _run(runner, requests(), block_size)
    # A layout a step would be num_steps; the batch changes shape at each prefill chunk, join, finish and new
    # KV block (every 4 tokens of a request), so its decode steps share layouts in runs.
    assert num_steps >= 40 and runner.step_inputs.num_layouts < num_steps / 2

    unbuffered = ModelRunner(model_dir, cfg, torch.device("cpu"), torch.float32, 64, block_size, hf_config)
    monkeypatch.setattr(unbuffered, "step_inputs", _FreshInputs())
    assert _run(unbuffered, requests(), block_size)[0] == buffered
