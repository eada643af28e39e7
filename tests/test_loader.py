"""Checkpoint loading: the older hub layout (flat config.json with `rope_scaling`, `model.*` /
`visual.*` keys) gives the same model as transformers 5.x's layout; broken checkpoints fail clearly."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from mmserve import LLM, SamplingParams
from mmserve.models.config import DecoderConfig

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(100, 160))]


def legacy_copy(src: Path, dst: Path) -> Path:
    """Rewrite a transformers-5 Qwen2-VL checkpoint the way the hub stored it before v5."""
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    for key in ("model_type", "layer_types", "dtype"):
        text.pop(key, None)
    legacy = {
        **config,
        **text,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
    }
    (dst / "config.json").write_text(json.dumps(legacy, indent=2))
    tensors = load_file(src / "model.safetensors")
    renamed = {}
    for key, tensor in tensors.items():
        key = key.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
        renamed[key] = tensor.contiguous()
    (dst / "model.safetensors").unlink()
    save_file(renamed, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_legacy_layout_and_config_load_the_same_model(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    src = tiny_model_dir("qwen2_vl")
    dst = legacy_copy(src, tmp_path / "legacy")
    assert "model.layers.0.self_attn.q_proj.weight" in load_file(dst / "model.safetensors")
    new_cfg, _ = DecoderConfig.from_pretrained(src)
    old_cfg, _ = DecoderConfig.from_pretrained(dst)
    assert old_cfg == new_cfg
    expected = [o.token_ids for o in LLM(src).generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in LLM(dst).generate(PROMPTS, GREEDY)] == expected


def test_missing_weights_fail_with_their_names(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    dst = tmp_path / "broken"
    shutil.copytree(tiny_model_dir("qwen2"), dst)
    tensors = load_file(dst / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.gate_up_proj\.weight#1"):
        LLM(dst)


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="not supported"):
        DecoderConfig.from_pretrained(tmp_path)
