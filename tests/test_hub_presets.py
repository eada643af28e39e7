"""Hub-scale presets of mmserve.tiny_model (`qwen2-vl-2b`): the config has the hub model's shapes, and the
meta-device build path, run on a reduced variant of the preset (the full one is a 4.4 GB checkpoint), writes
deterministic bf16 safetensors shards that transformers and mmserve's engine both load."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from mmserve import LLM, SamplingParams
from mmserve.cli import main
from mmserve.models.config import DecoderConfig
from mmserve.tiny_model import (
    HUB_PRESETS,
    PRESETS,
    SPECIAL_TOKENS,
    build_config,
    get_preset,
    make_tiny_model,
    model_class,
    preprocessor_configs,
)

PRESET = "qwen2-vl-2b"
# The preset's code path at a size a test can write: every block kind once, head_dim 64, padded embedding rows.
SMALL = dict(
    bpe_vocab=4032, hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256, vocab_rows=16384,
    vision_depth=1, vision_dim=64, vision_heads=2,
)  # fmt: skip
SHARD = 1_000_000  # bytes: forces several shards (the 16384 x 128 bf16 embedding alone is 4 MB)


def _ids(bpe_vocab: int) -> dict[str, int]:
    return {t: bpe_vocab + i for i, t in enumerate(SPECIAL_TOKENS)}


def _shas(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("hub") / "m", preset=PRESET, max_shard_size=SHARD, **SMALL)


def test_config_has_the_hub_shapes(tmp_path: Path) -> None:
    p = get_preset(PRESET)
    config = build_config("qwen2_vl", PRESET, _ids(p.bpe_vocab), vocab_size=p.vocab_rows)
    text, vision = config.get_text_config(), config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (
        1536, 28, 12, 2,
    )  # fmt: skip
    assert (text.intermediate_size, text.vocab_size, text.max_position_embeddings) == (8960, 151936, 32768)
    assert text.rms_norm_eps == 1e-6 and text.rope_parameters["rope_theta"] == 1e6
    assert text.rope_parameters["mrope_section"] == [16, 24, 24]
    assert config.tie_word_embeddings is True and text.dtype == config.dtype == torch.bfloat16
    assert (vision.depth, vision.embed_dim, vision.num_heads, vision.mlp_ratio) == (32, 1280, 16, 4)
    assert (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size) == (14, 2, 2)
    assert vision.hidden_size == 1536  # the merger's output: the decoder's width
    with torch.device("meta"):  # shapes only
        model = model_class("qwen2_vl")(config)
    assert 2.20e9 <= sum(t.numel() for t in model.parameters()) <= 2.22e9  # the hub's 2.21 B, tied
    # The engine reads the same shapes from config.json.
    config.save_pretrained(tmp_path)
    cfg, _ = DecoderConfig.from_pretrained(tmp_path)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.vocab_size, cfg.tie_word_embeddings) == (128, 2, 151936, True)
    image, video = preprocessor_configs("qwen2_vl", p)
    assert (image["min_pixels"], image["max_pixels"]) == (56 * 56, 28 * 28 * 1280)
    assert (video["max_frames"], video["fps"]) == (768, 2.0)
    assert PRESET not in PRESETS  # PRESETS stays small enough to build in tests


def test_other_archs_are_refused_naming_the_preset(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=PRESET):
        make_tiny_model(tmp_path / "m", arch="qwen2", preset=PRESET)
    with pytest.raises(ValueError, match=PRESET):
        build_config("qwen2_5_vl", PRESET, _ids(4032), vocab_size=4096)
    assert not (tmp_path / "m").exists()  # refused before anything is written
    with pytest.raises(SystemExit):
        main(["make-tiny-model", str(tmp_path / "m"), "--arch", "qwen3", "--preset", PRESET])
    assert set(HUB_PRESETS) == {PRESET}


def test_small_variant_is_sharded_bf16_and_loads_in_transformers(small: Path) -> None:
    shards = sorted(small.glob("*.safetensors"))
    assert len(shards) > 1 and (small / "model.safetensors.index.json").exists()
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118
    assert AutoConfig.from_pretrained(small).dtype == torch.bfloat16
    model, info = model_class("qwen2_vl").from_pretrained(small, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.bfloat16
    emb = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()  # tied, as the hub's 2B
    tok = AutoTokenizer.from_pretrained(small)
    assert emb.shape == (16384, 128) and len(tok) == 4032 + len(SPECIAL_TOKENS)
    assert not emb[len(tok) :].any() and emb[: len(tok)].float().std() > 0.01  # padding rows are zero
    norm = model.model.language_model.layers[0].input_layernorm.weight.float()
    assert 0.05 < norm.std() < 0.2 and abs(norm.mean() - 1) < 0.05  # gains ~ 1 + noise, not left at 1
    ids = tok("Hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0, -1, : len(tok)].float()
    assert 2.5 < logits.std() < 6.0  # the final norm's gain targets logit_std 4 over the live rows
    out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert int(out[0, ids.shape[1] :].max()) < len(tok)


def test_same_seed_same_bytes_whatever_the_threads(small: Path, tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        same = make_tiny_model(tmp_path / "same", preset=PRESET, max_shard_size=SHARD, **SMALL)
    finally:
        torch.set_num_threads(threads)
    assert _shas(same) == _shas(small)
    other = make_tiny_model(tmp_path / "other", preset=PRESET, seed=1, max_shard_size=SHARD, **SMALL)
    weights = [n for n in _shas(small) if n.endswith(".safetensors")]
    assert all(_shas(other)[n] != _shas(small)[n] for n in weights)


def test_engine_loads_the_shards_and_generates(small: Path) -> None:
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    # The vision tower's weights come from the shards too: one 56 x 56 image is 4 x 4 patches, 4 merged tokens.
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (56, 56, 3), dtype=np.uint8))
    messages = [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Hi"}]}
    ]
    with LLM(small, device="cpu", dtype="bfloat16", max_model_len=512, num_kv_blocks=64) as llm:
        (text,) = llm.generate(["Hello world"], params)
        (chat,) = llm.chat(messages, params)
    assert len(text.token_ids) == len(chat.token_ids) == 4
    image_pad = llm.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert chat.prompt_token_ids.count(image_pad) == 4  # the image's placeholders, filled by the tower
