"""The decoder's decode rows in one C call (`kernels/cpu_decoder.py`) against the composed path, layer by layer
through the same kernels: bit-identical hidden states and KV writes (both dtypes, qkv bias and Qwen3's q/k norms,
ragged contexts over shuffled blocks), the steps it must leave to the composed path, its refusals, and the whole
engine's greedy tokens and logprobs with it on and off."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mmserve.kernels import cpu_decoder, reference
from mmserve.kernels.cpu_linear import LinearPaths
from mmserve.kernels.dispatch import get_attention_backend, get_elementwise_ops, get_moe_backend
from mmserve.models.config import DecoderConfig
from mmserve.models.decoder import Decoder, rotary_embedding
from mmserve.models.forward_batch import ForwardBatch
from mmserve.models.loader import load_decoder
from tests.test_kernels import python_with_kernel_cache

pytestmark = pytest.mark.skipif(not cpu_decoder.load(), reason="no C compiler")

BLOCK_SIZE, NUM_BLOCKS = 4, 64


def _decoder(model_dir: Path, dtype: torch.dtype, stack: bool, paths: str = "c") -> Decoder:
    cfg, _ = DecoderConfig.from_pretrained(model_dir)
    cpu = torch.device("cpu")
    fused_moe = get_moe_backend(cpu).fused_moe if cfg.moe_layers else None
    model = load_decoder(model_dir, cfg, get_attention_backend(cpu), fused_moe=fused_moe)
    model = model.to(dtype=dtype).eval().requires_grad_(False)
    model.rotary = rotary_embedding(cfg)  # as the model runner does: fp32 frequencies, built after the cast
    model.set_linear_paths(LinearPaths.uniform(paths))
    model.set_elementwise_ops(get_elementwise_ops(cpu))
    if stack:
        assert model.enable_decode_stack(dtype) is None
    return model


def _kv_caches(cfg: DecoderConfig, dtype: torch.dtype) -> list[torch.Tensor]:
    """Caches full of earlier tokens' K/V (random values), so every context length reads real data."""
    g = torch.Generator().manual_seed(1)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(cfg.num_layers)]


def _decode_batch(context_lens: list[int], prefill: int = 0) -> ForwardBatch:
    """One decode row per context (its token the context's last) over shuffled, disjoint blocks; `prefill` > 0
    adds a sequence whose first chunk has that many rows."""
    g = torch.Generator().manual_seed(len(context_lens))
    blocks = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    # (context length, positions of its rows in this step)
    seqs = [(n, [n - 1]) for n in context_lens] + ([(prefill, list(range(prefill)))] if prefill else [])
    max_blocks = max(-(-n // BLOCK_SIZE) for n, _ in seqs)
    tables, slots, positions, starts = [], [], [], [0]
    for n, rows in seqs:
        table = [blocks.pop() for _ in range(-(-n // BLOCK_SIZE))]
        tables.append(table + [0] * (max_blocks - len(table)))
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in rows]
        positions += rows
        starts.append(starts[-1] + len(rows))
    block_tables = torch.tensor(tables, dtype=torch.int64)
    lens = [n for n, _ in seqs]
    return ForwardBatch(
        input_ids=torch.randint(3, 200, (starts[-1],), generator=g),
        positions=torch.tensor(positions).expand(3, -1).contiguous(),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=block_tables,
        logits_indices=torch.tensor([s - 1 for s in starts[1:]]),
        query_start_loc=starts,
        seq_lens=lens,
        attention_metadata=reference.decode_rows(block_tables, starts, lens),
    )


def _run(model: Decoder, batch: ForwardBatch, caches: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    caches = [c.clone() for c in caches]
    with torch.inference_mode():
        return model(batch, caches), caches


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # qkv bias; per-head q/k norms
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_equals_the_composed_layers_bit_for_bit(
    tiny_model_dir: Callable[[str], Path], arch: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    composed, stacked = (_decoder(tiny_model_dir(arch), dtype, stack) for stack in (False, True))
    calls = []
    forward = cpu_decoder.DecodeStack.forward
    monkeypatch.setattr(cpu_decoder.DecodeStack, "forward", lambda *a: calls.append(1) or forward(*a))
    caches = _kv_caches(composed.cfg, dtype)
    for lens in ([1], [7], [5, 33, 1, 18, 64, 9, 12, 2, 40]):  # 9 rows: the linear kernel's tiles of 8 and 1
        batch = _decode_batch(lens)
        expected, expected_caches = _run(composed, batch, caches)
        got, got_caches = _run(stacked, batch, caches)
        assert torch.equal(got, expected)
        assert all(torch.equal(a, b) for a, b in zip(got_caches, expected_caches, strict=True))
        assert not all(torch.equal(a, b) for a, b in zip(got_caches, caches, strict=True))  # it wrote K/V
    assert len(calls) == 3


def test_steps_it_leaves_to_the_composed_layers(tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill chunk beside decodes, and a row count whose products are not on the C kernel, run layer by layer
    (same results as a model without the stack)."""
    composed = _decoder(tiny_model_dir("qwen2"), torch.float32, stack=False, paths="mm_t")
    stacked = _decoder(tiny_model_dir("qwen2"), torch.float32, stack=True, paths="mm_t")
    stacked.set_linear_paths(LinearPaths(("c",) * 3 + ("mm_t",) * 11))  # rows 1-3 on the C kernel
    monkeypatch.setattr(cpu_decoder.DecodeStack, "forward", lambda *a: pytest.fail("the stack ran"))
    caches = _kv_caches(composed.cfg, torch.float32)
    for batch in (_decode_batch([5, 9], prefill=6), _decode_batch([3, 8, 13, 21])):
        expected, _ = _run(composed, batch, caches)
        got, _ = _run(stacked, batch, caches)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_slot_outside_the_cache_writes_nothing(tiny_model_dir: Callable[[str], Path]) -> None:
    model = _decoder(tiny_model_dir("qwen2"), torch.float32, stack=True)
    caches = _kv_caches(model.cfg, torch.float32)
    batch = _decode_batch([3, 6])
    bad = ForwardBatch(**{**batch.__dict__, "slot_mapping": torch.tensor([5, NUM_BLOCKS * BLOCK_SIZE])})
    before = [c.clone() for c in caches]
    with pytest.raises(IndexError, match="slot outside"), torch.inference_mode():
        model(bad, caches)
    assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))


def test_what_it_refuses(tiny_model_dir: Callable[[str], Path]) -> None:
    model = _decoder(tiny_model_dir("qwen2"), torch.float32, stack=False)
    assert "KV cache" in str(model.enable_decode_stack(torch.float8_e4m3fn))
    assert model.decode_stack is None
    moe = _decoder(tiny_model_dir("qwen3_moe"), torch.float32, stack=False)
    assert "MoE" in str(moe.enable_decode_stack(torch.float32))
    shape = cpu_decoder.DecoderShape(hidden=4, num_heads=2, num_kv_heads=1, head_dim=2, intermediate=4, eps=1e-6)
    weights = _weights(shape)
    assert isinstance(cpu_decoder.DecodeStack.create([weights], torch.ones(4), shape), cpu_decoder.DecodeStack)
    assert "dtype" in str(cpu_decoder.DecodeStack.create([weights], torch.ones(4, dtype=torch.float16), shape))
    assert "heads" in str(cpu_decoder.DecodeStack.create([weights], torch.ones(4), dataclasses.replace(shape, num_heads=3, num_kv_heads=2)))
    wrong = dataclasses.replace(weights, down=torch.ones(4, 5))  # the C would read past it
    assert "down is (4, 5), not (4, 4)" in str(cpu_decoder.DecodeStack.create([wrong], torch.ones(4), shape))
    assert "q/k norms" in str(cpu_decoder.DecodeStack.create([dataclasses.replace(weights, k_norm=None)], torch.ones(4), shape))


def _weights(s: cpu_decoder.DecoderShape) -> cpu_decoder.LayerWeights:
    qkv, q = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim, s.num_heads * s.head_dim
    return cpu_decoder.LayerWeights(torch.ones(s.hidden), torch.ones(qkv, s.hidden), torch.ones(qkv),
                                    torch.ones(s.head_dim), torch.ones(s.head_dim), torch.ones(s.hidden, q),
                                    torch.ones(s.hidden), torch.ones(2 * s.intermediate, s.hidden),
                                    torch.ones(s.hidden, s.intermediate))  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_decodes_the_same_tokens_and_logprobs_with_it_off(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """Chunked prefills beside decodes, batches shrinking as requests finish: exactly the same outputs. Fixed
    token budgets (max_step_ms=0): budgets from measured step times would chunk the two runs differently."""
    from mmserve import LLM, SamplingParams

    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 40, 9)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=2) for m in (14, 6, 11, 3)]
    outputs, calls = {}, []
    forward = cpu_decoder.DecodeStack.forward
    monkeypatch.setattr(cpu_decoder.DecodeStack, "forward", lambda *a: calls.append(1) or forward(*a))
    for setting in ("0", "1"):
        monkeypatch.setenv(cpu_decoder.ENV, setting)
        llm = LLM(str(tiny_model_dir("qwen3")), dtype=dtype, max_num_batched_tokens=32, max_step_ms=0)
        assert llm.info().decode_stack == (setting == "1")
        assert ("decode steps: one C call" in llm.info().banner()) == (setting == "1")
        outputs[setting] = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
        llm.close()
        assert (len(calls) > 10) == (setting == "1")  # the decode-only steps, once it is on
    assert outputs["1"] == outputs["0"]


def test_built_once_per_machine_and_without_a_compiler_the_layers_stay_composed(tmp_path: Path) -> None:
    """A second start loads the cached library (no recompilation: sizes are arguments, so no row count ever
    rebuilds it); with no compiler the stack refuses and says why."""
    code = (
        "import torch\n"
        "from mmserve.kernels import cpu_decoder\n"
        "from tests.test_cpu_decoder import _weights\n"
        "shape = cpu_decoder.DecoderShape(4, 2, 1, 2, 4, 1e-6)\n"
        "made = cpu_decoder.DecodeStack.create([_weights(shape)], torch.ones(4), shape)\n"
        "print(cpu_decoder.load(), made if isinstance(made, str) else 'built')\n"
    )
    built = python_with_kernel_cache(code, tmp_path / "a", cpu_decoder.ENV)
    assert built.stdout.split() == ["True", "built"], built.stderr
    (library,) = (tmp_path / "a").glob("decoder_decode-*.so")
    stamp = library.stat().st_mtime_ns
    assert python_with_kernel_cache(code, tmp_path / "a", cpu_decoder.ENV).stdout.split() == ["True", "built"]
    assert library.stat().st_mtime_ns == stamp
    refused = python_with_kernel_cache(code, tmp_path / "b", cpu_decoder.ENV, CC="false")
    assert refused.stdout.startswith("False the C kernels could not be built"), refused.stderr
