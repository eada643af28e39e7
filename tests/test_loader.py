"""Checkpoint loading: transformers 5.x's key layout (`model.language_model.*`, `model.visual.*`) and
the older hub one (`model.*`, `visual.*`, which `save_pretrained` still writes), current and legacy
(flat, `rope_scaling`) config.json, all give the same model; broken checkpoints fail clearly."""

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


def rename_keys(model_dir: Path, rename: Callable[[str], str]) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    renamed = {rename(key): tensor.contiguous() for key, tensor in tensors.items()}
    (model_dir / "model.safetensors").unlink()
    save_file(renamed, model_dir / "model.safetensors", metadata={"format": "pt"})


def v5_layout(key: str) -> str:
    if key.startswith("visual."):
        return "model." + key
    if key.startswith("model."):
        return "model.language_model." + key.removeprefix("model.")
    return key


def legacy_config_copy(src: Path, dst: Path) -> Path:
    """Rewrite a Qwen2-VL config.json the way the hub stored it before transformers 5."""
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
    return dst


def test_both_key_layouts_and_config_formats_load_the_same_model(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    src = tiny_model_dir("qwen2_vl")
    assert "model.layers.0.self_attn.q_proj.weight" in load_file(src / "model.safetensors")  # hub layout
    v5 = tmp_path / "v5"
    shutil.copytree(src, v5)
    rename_keys(v5, v5_layout)
    keys = load_file(v5 / "model.safetensors").keys()
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in keys
    assert any(k.startswith("model.visual.") for k in keys)
    legacy = legacy_config_copy(src, tmp_path / "legacy")
    assert DecoderConfig.from_pretrained(legacy)[0] == DecoderConfig.from_pretrained(src)[0]
    expected = [o.token_ids for o in LLM(src).generate(PROMPTS, GREEDY)]
    for other in (v5, legacy):
        assert [o.token_ids for o in LLM(other).generate(PROMPTS, GREEDY)] == expected


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
