"""Tests for mmserve.tiny_model: the generated checkpoints load and behave like hub Qwen checkpoints."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

from mmserve.tiny_model import (
    ARCHS,
    PRESETS,
    QWEN3_ARCHS,
    QWEN3_EXTRA_TOKENS,
    SPECIAL_TOKENS,
    VL_ARCHS,
    build_config,
    make_tiny_model,
    model_class,
)

MULTIBYTE = "café naïve Straße — 你好，世界！ 😀🚀 ❤️ 𝔘 déjà vu 12345"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch=arch) for arch in ARCHS}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(("kwargs", "field"), [({"arch": "llama"}, "arch"), ({"preset": "huge"}, "preset")])
def test_bad_arguments_name_the_field(tmp_path: Path, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make_tiny_model(tmp_path, **kwargs)


@pytest.mark.parametrize("arch", ARCHS)
def test_files_and_special_token_ids(ckpts: dict[str, Path], arch: str) -> None:
    d = ckpts[arch]
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja"}  # fmt: skip
    if arch in VL_ARCHS:
        expected |= {"preprocessor_config.json", "video_preprocessor_config.json"}
    assert {p.name for p in d.iterdir()} == expected
    tok = AutoTokenizer.from_pretrained(d)
    assert tok.is_fast
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    bpe = PRESETS["tiny"].bpe_vocab
    extra = QWEN3_EXTRA_TOKENS if arch in QWEN3_ARCHS else ()
    assert list(ids.values()) == list(range(bpe, bpe + len(SPECIAL_TOKENS))) and len(tok) == bpe + 14 + len(extra)
    assert [tok.convert_tokens_to_ids(t) for t in extra] == list(range(bpe + 14, bpe + 14 + len(extra)))
    assert all(t not in tok.all_special_tokens for t in extra)  # Qwen3's <think> etc. are plain added tokens

    cfg = AutoConfig.from_pretrained(d)
    text = cfg.get_text_config()
    assert text.eos_token_id == ids["<|im_end|>"] and text.bos_token_id == ids["<|endoftext|>"]
    assert text.vocab_size % 64 == 0 and text.vocab_size >= len(tok)
    assert cfg.tie_word_embeddings is (arch in ("qwen2", "qwen3", "qwen3_vl"))
    if arch in QWEN3_ARCHS:  # head_dim set apart from hidden / heads, as the hub's Qwen3 configs do
        assert text.head_dim == 2 * text.hidden_size // text.num_attention_heads
    if arch in ("qwen3_moe", "qwen3_vl_moe"):
        assert text.num_experts == 8 and text.num_experts_per_tok == 2 and text.mlp_only_layers == [1]
    if arch in VL_ARCHS:
        assert cfg.image_token_id == ids["<|image_pad|>"] and cfg.video_token_id == ids["<|video_pad|>"]
        assert cfg.vision_start_token_id == ids["<|vision_start|>"]
        assert cfg.vision_end_token_id == ids["<|vision_end|>"]
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
        patch = 16 if arch in QWEN3_ARCHS else 14
        assert cfg.vision_config.spatial_merge_size == 2 and cfg.vision_config.patch_size == patch


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template(ckpts: dict[str, Path], arch: str) -> None:
    tok = AutoTokenizer.from_pretrained(ckpts[arch])
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    out = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    system = "" if arch in QWEN3_ARCHS else "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    assert out == system + (
        "<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids.count(tok.convert_tokens_to_ids("<|image_pad|>")) == 1

    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "video"},
                                     {"type": "video_url", "video_url": {"url": "y"}}, {"type": "text", "text": "?"}]},
        {"role": "assistant", "content": "ok"},
    ]  # fmt: skip
    out = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert out.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and "helpful" not in out
    assert out.count("<|image_pad|>") == 1 and out.count("<|video_pad|>") == 2
    assert out.endswith("<|im_start|>assistant\nok<|im_end|>\n")


@pytest.mark.parametrize("arch", VL_ARCHS)
def test_image_processor_loads(ckpts: dict[str, Path], arch: str) -> None:
    proc = AutoImageProcessor.from_pretrained(ckpts[arch])
    assert type(proc).__name__.startswith("Qwen2VLImageProcessor")
    out = proc(images=[Image.new("RGB", (150, 100))], return_tensors="pt")
    # 100x150 -> 112x140 pixels -> 8x10 patches of 14 px; Qwen3: 96x160 pixels -> 6x10 patches of 16 px
    assert out["image_grid_thw"].tolist() == [[1, 6, 10] if arch in QWEN3_ARCHS else [1, 8, 10]]


def test_multibyte_round_trip_and_split_characters(ckpts: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(ckpts["qwen2"])
    ids = tok.encode(MULTIBYTE)
    assert tok.decode(ids) == MULTIBYTE
    # Some characters span several tokens: decoding those tokens alone gives U+FFFD (detokenizer test food).
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    assert max(ids) < PRESETS["tiny"].bpe_vocab  # plain text never produces special tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_model_loads_and_generates(ckpts: dict[str, Path], arch: str) -> None:
    d = ckpts[arch]
    model, info = model_class(arch).from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert 300_000 <= sum(p.numel() for p in model.parameters()) <= 3_000_000
    tok = AutoTokenizer.from_pretrained(d)
    ids = tok("Hello world", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4)
    if arch not in VL_ARCHS:
        return
    # One image through the vision tower: 8x10 (Qwen3: 6x10) patches merge 2x2 into 20 (15) placeholder tokens.
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (100, 150, 3), dtype=np.uint8))
    px = AutoImageProcessor.from_pretrained(d)(images=[img], return_tensors="pt")
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    num_tokens = 15 if arch in QWEN3_ARCHS else 20
    ids = tok(text.replace("<|image_pad|>", "<|image_pad|>" * num_tokens), return_tensors="pt").input_ids
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=px["pixel_values"],
        image_grid_thw=px["image_grid_thw"], mm_token_type_ids=(ids == model.config.image_token_id).long(),
        max_new_tokens=4, min_new_tokens=4, do_sample=False,
    )  # fmt: skip
    assert out.shape == (1, ids.shape[1] + 4)
    assert int(out[0, ids.shape[1] :].max()) < PRESETS["tiny"].bpe_vocab  # markup / padded rows never win


def test_deterministic_per_seed(ckpts: dict[str, Path], tmp_path: Path) -> None:
    same = make_tiny_model(tmp_path / "same", arch="qwen2_vl", seed=0)
    other = make_tiny_model(tmp_path / "other", arch="qwen2_vl", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert _sha(same / name) == _sha(ckpts["qwen2_vl"] / name), name
    assert _sha(other / "model.safetensors") != _sha(same / "model.safetensors")
    assert _sha(other / "tokenizer.json") == _sha(same / "tokenizer.json")  # the tokenizer ignores the seed
    # A fresh process (new hash seeds in tokenizers' Rust maps) writes the same bytes too.
    code = f"from mmserve.tiny_model import make_tiny_model; make_tiny_model({str(tmp_path / 'proc')!r}, 'qwen2')"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    for name in ("model.safetensors", "tokenizer.json"):
        assert _sha(tmp_path / "proc" / name) == _sha(ckpts["qwen2"] / name), name


@pytest.mark.parametrize(("arch", "low", "high"), [("qwen2_vl", 50e6, 60e6), ("qwen2_5_vl", 50e6, 60e6),
                                                  ("qwen2", 45e6, 60e6), ("qwen3_vl_moe", 50e6, 80e6)])  # fmt: skip
def test_bench_parameter_count(arch: str, low: float, high: float) -> None:
    p = PRESETS["bench"]
    ids = {t: p.bpe_vocab + i for i, t in enumerate(SPECIAL_TOKENS)}
    with torch.device("meta"):  # shapes only: no memory, no init time
        model = model_class(arch)(build_config(arch, "bench", ids, vocab_size=8192))
    assert low <= sum(t.numel() for t in model.parameters()) <= high
    if arch == "qwen3_vl_moe":  # the bench MoE is one where the experts dominate the weights
        experts = sum(t.numel() for n, t in model.named_parameters() if ".experts." in n)
        assert experts > 0.5 * sum(t.numel() for t in model.parameters())
