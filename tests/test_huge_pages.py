"""CPU parameters moved into one MADV_HUGEPAGE region (`engine/huge_pages.py`): values and ties kept, every
parameter inside the region, and the switch that leaves them where they are."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from mmserve.engine import huge_pages


def _advice_taken() -> bool:
    """Whether this kernel takes MADV_HUGEPAGE (built without THP it refuses it, and the weights stay put)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    region = mmap.mmap(-1, 1 << 21, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
        return True
    except OSError:
        return False
    finally:
        region.close()


pytestmark = pytest.mark.skipif(not _advice_taken(), reason="no MADV_HUGEPAGE on this platform or kernel")


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.Linear(32, 50, bias=False))
    model[2].weight = model[0].weight  # tied, as an lm_head to its embeddings ([50, 16]: shapes match)
    return model.to(torch.bfloat16)


def test_parameters_move_into_one_region_with_their_values_and_ties() -> None:
    model = _model()
    before = {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}
    ids = torch.tensor([3, 7, 49])
    expected = model[2](model[1](model[0](ids)).float()[:, :16].to(torch.bfloat16))
    region = huge_pages.move_to_huge_pages(model)
    assert region is not None
    start = ctypes.addressof(ctypes.c_char.from_buffer(region))
    for name, p in model.named_parameters(remove_duplicate=False):
        assert torch.equal(p, before[name]) and p.dtype == torch.bfloat16, name
        assert start <= p.data_ptr() < start + len(region) and p.data_ptr() % 4096 == 0, name
    assert model[2].weight is model[0].weight
    assert model[2].weight.data_ptr() == model[0].weight.data_ptr()
    assert torch.equal(model[2](model[1](model[0](ids)).float()[:, :16].to(torch.bfloat16)), expected)


def test_the_switch_leaves_them_where_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    addresses = [p.data_ptr() for p in model.parameters()]
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert huge_pages.move_to_huge_pages(model) is None
    assert [p.data_ptr() for p in model.parameters()] == addresses
    assert huge_pages.move_to_huge_pages(nn.Sequential()) is None  # nothing to move


def test_an_engine_on_the_cpu_runs_on_them(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner keeps the region and every decoder weight lives in it; the greedy tokens equal an engine's
    whose weights stay where torch put them."""
    from mmserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (6, 19)]
    tokens = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(huge_pages.ENV, setting)
        llm = LLM(str(tiny_model_dir("qwen2")), max_step_ms=0)
        weights = list({id(p): p for p in llm.engine.executor.local_model().parameters()}.values())
        sizes = [-(-p.numel() * p.element_size() // 4096) * 4096 for p in weights]
        span = max(p.data_ptr() + n for p, n in zip(weights, sizes, strict=True)) - min(p.data_ptr() for p in weights)
        assert (span == sum(sizes)) == (setting == "1")  # packed back to back in the region, page by page
        tokens[setting] = [o.token_ids for o in llm.generate(prompts, params)]
        llm.close()
    assert tokens["1"] == tokens["0"]
