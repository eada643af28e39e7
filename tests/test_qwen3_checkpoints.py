"""Qwen3-family checkpoints as they are on the hub: the config shapes of Qwen3-VL-2B/4B/8B-Instruct and
Qwen3-VL-30B-A3B-Instruct parse into the decoder mmserve builds (same parameter count as transformers'
model of that config), and every key layout a checkpoint may have loads to the same model: the current
and the older prefixes, experts per expert, fused, or fused and transposed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmserve import LLM, SamplingParams
from mmserve.engine.core import _approx_weight_bytes
from mmserve.kernels.dispatch import AttentionBackend
from mmserve.kernels.moe import fused_moe
from mmserve.models.config import DecoderConfig
from mmserve.models.decoder import Decoder

_TOKENS = {"bos_token_id": 151643, "eos_token_id": 151645}
_VISION_SMALL = {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "deepstack_visual_indexes": [5, 11, 17]}
_VISION_LARGE = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "deepstack_visual_indexes": [8, 16, 24]}


def _hub_config(text: dict, vision: dict, tie: bool, moe: bool = False) -> dict:
    """A config.json with the fields the hub's Qwen3-VL files carry (rope as `rope_scaling` + `rope_theta`)."""
    text = {
        "attention_bias": False, "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02,
        "max_position_embeddings": 262144, "model_type": "qwen3_vl_moe_text" if moe else "qwen3_vl_text",
        "rms_norm_eps": 1e-6, "rope_theta": 5000000, "tie_word_embeddings": tie, "vocab_size": 151936,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        **_TOKENS, **text,
    }  # fmt: skip
    vision = {
        "hidden_act": "gelu_pytorch_tanh", "in_channels": 3, "num_heads": 16, "num_position_embeddings": 2304,
        "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "model_type": "qwen3_vl_moe" if moe else "qwen3_vl", **vision,
    }  # fmt: skip
    return {
        "architectures": ["Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl_moe" if moe else "qwen3_vl", "image_token_id": 151655, "video_token_id": 151656,
        "vision_start_token_id": 151652, "vision_end_token_id": 151653, "tie_word_embeddings": tie,
        "text_config": text, "vision_config": vision,
    }  # fmt: skip


HUB_CONFIGS = {
    "Qwen3-VL-2B-Instruct": _hub_config(
        {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
         "num_key_value_heads": 8}, {**_VISION_SMALL, "out_hidden_size": 2048}, tie=True),
    "Qwen3-VL-4B-Instruct": _hub_config(
        {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
         "num_key_value_heads": 8}, {**_VISION_SMALL, "out_hidden_size": 2560}, tie=True),
    "Qwen3-VL-8B-Instruct": _hub_config(
        {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
         "num_key_value_heads": 8}, {**_VISION_LARGE, "out_hidden_size": 4096}, tie=False),
    "Qwen3-VL-30B-A3B-Instruct": _hub_config(
        {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
         "num_key_value_heads": 4, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
         "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
        {**_VISION_LARGE, "out_hidden_size": 2048}, tie=False, moe=True),
}  # fmt: skip


@pytest.mark.parametrize("name", list(HUB_CONFIGS))
def test_hub_config_builds_the_decoder_transformers_builds(name: str, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForImageTextToText

    (tmp_path / "config.json").write_text(json.dumps(HUB_CONFIGS[name]))
    cfg, hf = DecoderConfig.from_pretrained(tmp_path)
    text = HUB_CONFIGS[name]["text_config"]
    assert (cfg.head_dim, cfg.qk_norm, cfg.mrope_interleaved, cfg.qkv_bias) == (128, True, True, False)
    assert cfg.mrope_section == [24, 20, 20] and cfg.rope_theta == 5e6
    assert cfg.num_deepstack_levels == 3 and cfg.tie_word_embeddings is text["tie_word_embeddings"]
    if "A3B" in name:
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (128, 8, 768)
        assert cfg.norm_topk_prob and cfg.moe_layers == tuple(range(48))
    else:
        assert cfg.moe_layers == ()
    backend = AttentionBackend("none", lambda *a: None, lambda *a: None)
    with torch.device("meta"):
        ours = Decoder(cfg, backend, fused_moe=fused_moe if cfg.moe_layers else None)
        theirs = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(tmp_path))
    ours_count = sum(p.numel() for p in {id(p): p for p in ours.parameters()}.values())
    text_model = theirs.model.language_model
    theirs_count = sum(p.numel() for p in text_model.parameters())
    if not cfg.tie_word_embeddings:
        theirs_count += theirs.lm_head.weight.numel()
    assert ours_count == theirs_count
    # What the engine reserves for the weights before sizing a GPU KV pool: the experts included.
    assert _approx_weight_bytes(cfg, torch.bfloat16) == pytest.approx(2 * ours_count, rel=0.01)
    assert hf.vision_config.out_hidden_size == cfg.hidden_size


# ------------------------------------------------------------------------------------------- key layouts

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 17, 300, 42, 9, 1000, 77], list(range(100, 160))]


def _rewrite(src: Path, dst: Path, rename: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    save_file(rename(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _older_prefixes(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """model.language_model.* -> model.*, model.visual.* -> visual.* (the pre-5.x hub layout)."""
    out = {}
    for key, t in tensors.items():
        key = key.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1)
        out[key] = t
    return out


def _fuse_experts(tensors: dict[str, torch.Tensor], transposed: bool) -> dict[str, torch.Tensor]:
    """Per-expert projections -> transformers 5.x's fused [E, 2I, H] / [E, H, I] (transposed: the hub's
    Qwen3-VL-MoE [E, H, 2I] / [E, I, H])."""
    out, experts = {}, {}
    for key, t in tensors.items():
        parts = key.split(".")
        if ".mlp.experts." in key and parts[-2] in ("gate_proj", "up_proj", "down_proj"):
            prefix = key.split(".mlp.experts.")[0] + ".mlp.experts"
            experts.setdefault(prefix, {}).setdefault(parts[-2], {})[int(parts[-3])] = t
        else:
            out[key] = t
    for prefix, projs in experts.items():
        n = len(projs["gate_proj"])
        gate_up = torch.stack([torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in range(n)])
        down = torch.stack([projs["down_proj"][e] for e in range(n)])
        if transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        out[f"{prefix}.gate_up_proj"], out[f"{prefix}.down_proj"] = gate_up.contiguous(), down.contiguous()
    return out


def _split_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused experts as transformers 5.x saves them ([E, 2I, H], [E, H, I]) -> one tensor per expert and
    projection (the hub's Qwen3-MoE layout)."""
    out = {}
    for key, t in tensors.items():
        if key.endswith(".mlp.experts.gate_up_proj"):
            base = key.removesuffix(".gate_up_proj")
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}.{e}.gate_proj.weight"] = t[e, :half].contiguous()
                out[f"{base}.{e}.up_proj.weight"] = t[e, half:].contiguous()
        elif key.endswith(".mlp.experts.down_proj"):
            base = key.removesuffix(".down_proj")
            for e in range(t.shape[0]):
                out[f"{base}.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[key] = t
    return out


def _outputs(model_dir: Path) -> list[tuple[list[int], list[float]]]:
    outs = LLM(model_dir).generate(PROMPTS, GREEDY)
    return [(o.token_ids, [lp[t] for lp, t in zip(o.logprobs, o.token_ids, strict=True)]) for o in outs]


@pytest.mark.parametrize(
    ("arch", "rename"),
    [
        ("qwen3_vl", _older_prefixes),
        ("qwen3_moe", lambda t: _fuse_experts(t, transposed=False)),
        ("qwen3_vl_moe", lambda t: _fuse_experts(_split_experts(t), transposed=True)),
        ("qwen3_vl_moe", _split_experts),
        ("qwen3_vl_moe", _older_prefixes),
    ],
    ids=["vl-older-prefixes", "moe-fused", "vl-moe-hub-transposed", "vl-moe-per-expert", "vl-moe-older-prefixes"],
)
def test_every_key_layout_loads_the_same_model(
    arch: str, rename: Callable, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    original = tiny_model_dir(arch)
    rewritten = _rewrite(original, tmp_path / "rewritten", rename)
    before = load_file(str(original / "model.safetensors"))
    after = load_file(str(rewritten / "model.safetensors"))
    assert set(before) != set(after) or any(before[k].shape != after[k].shape for k in before)
    expected, got = _outputs(original), _outputs(rewritten)
    for (tokens, lps), (got_tokens, got_lps) in zip(expected, got, strict=True):
        assert got_tokens == tokens and got_lps == pytest.approx(lps, abs=1e-5)


def test_a_missing_expert_is_named(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    def drop(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: t for k, t in tensors.items() if "experts.3.up_proj" not in k}

    broken = _rewrite(tiny_model_dir("qwen3_moe"), tmp_path / "broken", drop)
    with pytest.raises(ValueError, match=r"experts\.up_proj#3"):
        LLM(broken)
