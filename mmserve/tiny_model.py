"""Writes small random-weight checkpoints in the Hugging Face hub layout: Qwen2-VL, Qwen2.5-VL, Qwen2, and the
Qwen3 family (Qwen3, Qwen3-MoE, Qwen3-VL, Qwen3-VL-MoE); and hub-scale ones (`HUB_PRESETS`: a hub model's shapes
with random bf16 weights, built on the meta device and written in shards) for benchmarks at real scale.

Owns the presets, a locally trained byte-level BPE tokenizer and the chat template; knows nothing of the engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import random
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen2", "qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe")
QWEN3_ARCHS = ("qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe")
VL_ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# Qwen2-VL's added tokens, in Qwen's id order (they follow the BPE vocab, as 151643.. do in Qwen).
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip
# Qwen3's further added tokens (tool calls and thinking), after Qwen2-VL's as in Qwen's own id order.
QWEN3_EXTRA_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
# Qwen2's pre-tokenizer split (same regex as transformers' Qwen2Tokenizer, which rebuilds from it on load).
PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# Qwen2-VL's template semantics, written from scratch: default system prompt, text/image/video parts; with `tools`,
# Qwen2.5's hermes tool calling (tools in the system turn, <tool_call> JSON in assistant turns, tool results as
# <tool_response> in a user turn). Without tools, tool_calls or tool messages it renders as it always did.
CHAT_TEMPLATE = r"""{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- macro tools_block() %}
    {{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' }}{{- tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        '<args-json-object>}\n</tool_call>' }}
{%- endmacro %}
{%- for message in messages %}
    {%- if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful assistant.' }}
        {%- if tools %}{{- tools_block() }}{%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
    {%- if message['role'] == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\n' }}
    {%- endif %}
    {%- if message['content'] is string %}
        {{- message['content'] }}
    {%- elif message['content'] is not none %}
        {%- for part in message['content'] %}
            {%- set kind = part.get('type', '') %}
            {%- if kind in ('image', 'image_url') or 'image' in part or 'image_url' in part %}
                {%- set image_count.value = image_count.value + 1 %}
                {%- if add_vision_id %}{{- 'Picture ' + image_count.value|string + ': ' }}{%- endif %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif kind in ('video', 'video_url') or 'video' in part or 'video_url' in part %}
                {%- set video_count.value = video_count.value + 1 %}
                {%- if add_vision_id %}{{- 'Video ' + video_count.value|string + ': ' }}{%- endif %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif 'text' in part %}
                {{- part['text'] }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {%- if message['role'] == 'tool' %}
        {{- '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {%- if loop.first and message['role'] == 'system' and tools %}
            {{- tools_block() }}
        {%- endif %}
        {%- if message['role'] == 'assistant' and message.get('tool_calls') %}
            {%- for tool_call in message['tool_calls'] %}
                {%- if tool_call.get('function') is not none %}
                    {%- set tool_call = tool_call['function'] %}
                {%- endif %}
                {%- if not loop.first or message['content'] %}
                    {{- '\n' }}
                {%- endif %}
                {{- '<tool_call>\n{"name": ' + (tool_call['name'] | tojson) + ', "arguments": ' }}
                {%- if tool_call['arguments'] is string %}
                    {{- tool_call['arguments'] }}
                {%- else %}
                    {{- tool_call['arguments'] | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Qwen3's: no default system prompt (a system turn only for tools or when given); otherwise the same parts.
QWEN3_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    r"""    {%- if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful assistant.' }}
        {%- if tools %}{{- tools_block() }}{%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}""",
    r"""    {%- if loop.first and message['role'] != 'system' and tools %}
        {{- '<|im_start|>system' }}{{- tools_block() }}{{- '<|im_end|>\n' }}
    {%- endif %}""",
)
assert QWEN3_CHAT_TEMPLATE != CHAT_TEMPLATE


@dataclass(frozen=True)
class Preset:
    bpe_vocab: int  # merges + 256 byte symbols; the 14 special tokens come after
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int
    vision_depth: int
    vision_dim: int
    vision_heads: int
    vision_intermediate: int  # Qwen2.5-VL's gated MLP; Qwen2-VL uses mlp_ratio 4 instead
    window_size: int  # Qwen2.5-VL window in pixels (window_size // 28 merged patches per side)
    min_pixels: int
    max_pixels: int
    max_frames: int
    # initializer_range; init_std * sqrt(hidden) ~ 1.1-1.6 keeps each layer's output above the input embedding,
    # else greedy decoding of a random model mostly repeats the last token.
    init_std: float
    logit_std: float  # the final norm's gain is set so logits have about this std: top-1/top-2 gaps stay wide
    # Qwen3-MoE / Qwen3-VL-MoE: experts per MoE layer, experts per token, each expert's width, and the layers
    # that keep the dense MLP (`mlp_only_layers`, so a checkpoint mixes both layouts as the config allows).
    num_experts: int = 8
    experts_per_token: int = 2
    moe_intermediate: int = 24  # 2 * 24 != hidden: a gate_up stored transposed cannot pass for the other layout
    dense_layers: tuple[int, ...] = (1,)
    # Hub-scale presets set these (the defaults keep the small presets as they were): the embedding rows (0: the
    # tokenizer's, padded to `vocab_multiple`), tied embeddings (None: tied for `tiny`'s qwen2, qwen3 and
    # qwen3_vl only) and the dtype the weights are made and written in.
    vocab_rows: int = 0
    tie_embeddings: bool | None = None
    dtype: str = "float32"


PRESETS = {
    # 0.34 M (qwen2, tied) to 0.69 M (VL) parameters: for tests on the CPU.
    "tiny": Preset(
        bpe_vocab=4032, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, max_positions=4096,
        vision_depth=2, vision_dim=32, vision_heads=2, vision_intermediate=96, window_size=56,
        min_pixels=56 * 56, max_pixels=28 * 28 * 64, max_frames=16, init_std=0.2, logit_std=4.0,
    ),
    # 53 M (VL; 5 M of it vision) / 48 M (qwen2) parameters: for `mmserve bench`.
    "bench": Preset(
        bpe_vocab=8128, hidden=512, layers=8, heads=8, kv_heads=2, intermediate=2816, max_positions=8192,
        vision_depth=4, vision_dim=256, vision_heads=4, vision_intermediate=688, window_size=112,
        min_pixels=56 * 56, max_pixels=28 * 28 * 256, max_frames=64, init_std=0.05, logit_std=4.0,
        num_experts=16, experts_per_token=4, moe_intermediate=192, dense_layers=(),
    ),
}  # fmt: skip
# Hub-scale presets: name -> (the one arch it is for, its shapes). `make_tiny_model` builds these on the meta
# device and fills them chunk by chunk (`_random_model_on_meta`); they are kept out of PRESETS, whose entries
# are small enough to build and run in tests.
HUB_PRESETS: dict[str, tuple[str, Preset]] = {
    # Qwen2-VL-2B-Instruct's config.json: 1.54 B text parameters (tied embeddings) + 0.67 B vision, head_dim 128
    # (so M-RoPE [16, 24, 24]). All 151936 embedding rows are kept; the BPE is small, the rows past it padding.
    # Pixel bounds: the hub's min, a max well under its 28*28*16384 so that one image stays <= 1280 tokens.
    "qwen2-vl-2b": ("qwen2_vl", Preset(
        bpe_vocab=8128, hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, max_positions=32768,
        vision_depth=32, vision_dim=1280, vision_heads=16, vision_intermediate=5120, window_size=112,
        min_pixels=56 * 56, max_pixels=28 * 28 * 1280, max_frames=768, init_std=0.02, logit_std=4.0,
        vocab_rows=151936, tie_embeddings=True, dtype="bfloat16",
    )),
}  # fmt: skip
PRESET_NAMES = (*PRESETS, *HUB_PRESETS)
# Qwen3's patches are 16 px, so one merged token covers 32 x 32 px; the presets' pixel bounds (in 28 px tokens)
# are carried over as token counts.
QWEN3_PATCH = 16


def english_like_corpus(n_lines: int) -> list[str]:
    """Deterministic English-like text with digits, punctuation, accents, CJK and emoji."""
    rng = random.Random(1234)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ou", "ea")]
    common = (
        "the of and to in is that it for you was with on as have be at by this from or an are not but what all "
        "were when we there can said which do their if will each about how up out them then she many some so "
        "these would other into has more her two like him see time could no make than first been its who now "
        "people my made over did down only way find use may water long little very after words called just "
        "where most know get through back much before go good new write our used me man too any day same right "
        "look think also around another came come work three word must because does part even place well such "
        "hello world user assistant system image video picture frame model token question answer describe"
    ).split()
    coined = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(12000)]
    words = common + coined + ["café", "naïve", "résumé", "señor", "über", "Straße", "garçon", "déjà"]
    cum = list(itertools.accumulate(1.0 / (rank + 10) for rank in range(len(words))))  # Zipf-like weights
    # Many rare CJK/emoji code points: they stay split into several byte-level tokens.
    rare = [chr(0x4E00 + rng.randrange(0x5000)) for _ in range(400)] + [chr(0x1F600 + i) for i in range(64)]
    phrases = ["你好", "世界", "模型", "图像", "视频", "こんにちは", "😀", "🚀", "👍", "❤️", "—", "…"]
    puncts = [",", ".", "!", "?", ";", ":", " -", " (", ")", '"', "'s", "'re"]
    lines = []
    for _ in range(n_lines):
        parts = []
        for w in rng.choices(words, cum_weights=cum, k=rng.randint(4, 16)):
            r = rng.random()
            parts.append(
                w.capitalize() if r < 0.1 else str(rng.randrange(10 ** rng.randint(1, 5))) if r < 0.15 else w
            )
            if r > 0.9:
                parts.append(rng.choice(puncts))
            elif r > 0.87:
                parts.append(" " + rng.choice(phrases if r > 0.88 else rare))
        lines.append(" ".join(parts) + rng.choice([".", "!", "?", "\n", " 123.", "\n\n"]))
    return lines


def build_tokenizer(
    bpe_vocab: int, corpus: Iterable[str] | None = None, extra_tokens: tuple[str, ...] = ()
) -> Tokenizer:
    """Qwen2's byte-level BPE pipeline trained on `corpus` (default `english_like_corpus`); special tokens get ids
    bpe_vocab.. in order, then `extra_tokens` (added but not special, as Qwen3's <tool_call> and <think>)."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(english_like_corpus(20000) if corpus is None else corpus, trainer=trainer)
    if tok.get_vocab_size() != bpe_vocab:  # the corpus must be rich enough to reach the target exactly
        raise RuntimeError(f"BPE trained {tok.get_vocab_size()} tokens, wanted {bpe_vocab}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if extra_tokens:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra_tokens])
    return tok


def tokenizer_config(tok: Tokenizer, extra_tokens: tuple[str, ...] = ()) -> dict:
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": t in SPECIAL_TOKENS}
        for t in SPECIAL_TOKENS + extra_tokens
    }  # fmt: skip
    return {
        "add_prefix_space": False, "added_tokens_decoder": added, "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": None, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
        "model_max_length": 32768, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }  # fmt: skip


def get_preset(name: str) -> Preset:
    """The preset called `name`, small (PRESETS) or hub-scale (HUB_PRESETS)."""
    if name in HUB_PRESETS:
        return HUB_PRESETS[name][1]
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {PRESET_NAMES}, got {name!r}")
    return PRESETS[name]


def _check_hub_arch(arch: str, preset: str | Preset) -> None:
    if isinstance(preset, str) and preset in HUB_PRESETS and arch != HUB_PRESETS[preset][0]:
        raise ValueError(f"preset {preset!r} has the shapes of a {HUB_PRESETS[preset][0]} model, not {arch!r}")


def build_config(
    arch: str, preset: str | Preset, tok_ids: dict[str, int], vocab_size: int, **preset_fields: int
) -> PreTrainedConfig:
    """The transformers config for (arch, preset); `tok_ids` maps special token -> id."""
    _check_hub_arch(arch, preset)
    p = dataclasses.replace(get_preset(preset) if isinstance(preset, str) else preset, **preset_fields)
    tie = preset == "tiny" if p.tie_embeddings is None else p.tie_embeddings
    head_dim = p.hidden // p.heads
    text = dict(
        vocab_size=vocab_size, hidden_size=p.hidden, intermediate_size=p.intermediate, num_hidden_layers=p.layers,
        num_attention_heads=p.heads, num_key_value_heads=p.kv_heads, max_position_embeddings=p.max_positions,
        max_window_layers=p.layers, rms_norm_eps=1e-6, initializer_range=p.init_std,
        bos_token_id=tok_ids["<|endoftext|>"], eos_token_id=tok_ids["<|im_end|>"], dtype=p.dtype,
    )  # fmt: skip
    if arch == "qwen2":
        rope = {"rope_type": "default", "rope_theta": 1e6}
        return Qwen2Config(**text, rope_parameters=rope, tie_word_embeddings=tie)
    if arch in QWEN3_ARCHS:
        return _qwen3_config(arch, p, tie, text, tok_ids)
    # M-RoPE splits head_dim/2 frequencies over (t, h, w) as Qwen's [16, 24, 24] does for head_dim 128.
    section = [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": section}
    ids = {k: tok_ids[f"<|{k}|>"] for k in ("image_pad", "video_pad", "vision_start", "vision_end")}
    common = dict(
        image_token_id=ids["image_pad"], video_token_id=ids["video_pad"], vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"], tie_word_embeddings=p.tie_embeddings is True,
    )  # fmt: skip
    if p.dtype != "float32":  # else left to save_pretrained, which writes float32 there (kept byte-identical)
        common["dtype"] = p.dtype
    vision: dict = dict(depth=p.vision_depth, num_heads=p.vision_heads, patch_size=14, temporal_patch_size=2,
                        spatial_merge_size=2, in_channels=3, initializer_range=p.init_std)  # fmt: skip
    if arch == "qwen2_vl":
        vision.update(embed_dim=p.vision_dim, hidden_size=p.hidden, mlp_ratio=4)
        return Qwen2VLConfig(text_config=text, vision_config=vision, **common)
    # Qwen2.5-VL: window attention everywhere except the last block of each half (e.g. [1] for depth 2).
    d = p.vision_depth
    full = [d - 1] if d <= 2 else [d // 2 - 1, d - 1]
    vision.update(hidden_size=p.vision_dim, intermediate_size=p.vision_intermediate, out_hidden_size=p.hidden,
                  window_size=p.window_size, fullatt_block_indexes=full, tokens_per_second=2)  # fmt: skip
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)


def _qwen3_config(arch: str, p: Preset, tie: bool, text: dict, tok_ids: dict[str, int]) -> PreTrainedConfig:
    """Qwen3's shapes as the hub's: head_dim set apart from hidden / heads (here twice it, so q is wider than the
    residual stream), per-head q/k norms, no qkv bias; MoE layers with `mlp_only_layers` dense; VL models with
    16 px patches, learned position embeddings, DeepStack levels and interleaved M-RoPE."""
    head_dim = 2 * p.hidden // p.heads
    text = {**text, "head_dim": head_dim, "attention_bias": False}
    text.pop("max_window_layers")
    rope = {"rope_type": "default", "rope_theta": 1e6}
    moe = dict(
        num_experts=p.num_experts, num_experts_per_tok=p.experts_per_token, moe_intermediate_size=p.moe_intermediate,
        decoder_sparse_step=1, mlp_only_layers=list(p.dense_layers),
    )  # fmt: skip
    if arch == "qwen3":
        return Qwen3Config(**text, rope_parameters=rope, tie_word_embeddings=tie)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**text, **moe, norm_topk_prob=True, rope_parameters=rope, tie_word_embeddings=False)
    # Interleaved M-RoPE: of head_dim/2 frequencies, h and w take every third from 1 and 2 (Qwen's [24, 20, 20]).
    half = head_dim // 2
    section = [half - 2 * (half * 5 // 16), half * 5 // 16, half * 5 // 16]
    text["rope_parameters"] = {**rope, "rope_type": "default", "mrope_section": section, "mrope_interleaved": True}
    if arch == "qwen3_vl_moe":
        text.update(moe)
    # DeepStack: features after each of the first vision blocks feed the first decoder layers.
    levels = list(range(min(p.vision_depth, p.layers, 3)))
    vision = dict(
        depth=p.vision_depth, hidden_size=p.vision_dim, intermediate_size=p.vision_intermediate,
        num_heads=p.vision_heads, out_hidden_size=p.hidden, patch_size=QWEN3_PATCH, temporal_patch_size=2,
        spatial_merge_size=2, in_channels=3, num_position_embeddings=144, deepstack_visual_indexes=levels,
        hidden_act="gelu_pytorch_tanh", initializer_range=p.init_std,
    )  # fmt: skip
    ids = {k: tok_ids[f"<|{k}|>"] for k in ("image_pad", "video_pad", "vision_start", "vision_end")}
    common = dict(
        image_token_id=ids["image_pad"], video_token_id=ids["video_pad"], vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"], tie_word_embeddings=tie and arch == "qwen3_vl",
    )  # fmt: skip
    text["tie_word_embeddings"] = common["tie_word_embeddings"]  # the top-level value rules; keep them agreeing
    cls = Qwen3VLConfig if arch == "qwen3_vl" else Qwen3VLMoeConfig
    return cls(text_config=text, vision_config=vision, **common)


def model_class(arch: str) -> type[PreTrainedModel]:
    """The transformers class whose `from_pretrained` loads `arch`'s checkpoints."""
    return {"qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
            "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM,
            "qwen3_vl": Qwen3VLForConditionalGeneration,
            "qwen3_vl_moe": Qwen3VLMoeForConditionalGeneration}[arch]  # fmt: skip


@torch.no_grad()
def _spread_weights(model: PreTrainedModel, p: Preset, never: list[int]) -> None:
    """Make biases / norm gains non-trivial and logits well spread; rows `never` get logit 0 (never greedy)."""
    for name, param in model.named_parameters():  # fixed order, so the same seed gives the same bytes
        if param.ndim == 1:  # transformers inits these to 0 / 1, which would hide a bias or gain never loaded
            param.copy_(torch.randn_like(param) * 0.1 + (0.0 if name.endswith("bias") else 1.0))
    _zero_rows_and_spread_logits(model, p, never, std_of_live_rows=False)


@torch.no_grad()
def _zero_rows_and_spread_logits(model: PreTrainedModel, p: Preset, never: list[int], std_of_live_rows: bool) -> None:
    """Zero lm_head's rows `never` (the top logit of thousands with std 4 is ~ +13, so they never win), then set
    the final norm's gain so logits have about `p.logit_std`. Normed hidden entries are ~1, so logit std ~ gain *
    std(lm_head) * sqrt(hidden). The gain is scaled rather than lm_head: with tied weights that would grow the
    input embeddings too (greedy then just repeats the last token, since the residual stream is mostly that
    token's embedding). `std_of_live_rows`: measure lm_head's std over the rows left (a hub-size vocabulary is
    mostly zeroed padding); the small presets measure all rows, which their bytes were made with."""
    lm_head = model.get_output_embeddings().weight  # [vocab_size, hidden]
    lm_head[never] = 0.0
    if std_of_live_rows:
        live = torch.ones(lm_head.shape[0], dtype=torch.bool)
        live[never] = False
        lm_head_std = lm_head[live].float().std()
    else:
        lm_head_std = lm_head.std()
    model.get_decoder().norm.weight.mul_(p.logit_std / (p.hidden**0.5 * lm_head_std))


# Elements drawn per generator: each chunk has its own seed, so threads may fill the chunks in any order.
FILL_CHUNK = 1 << 24


def _chunk_seed(seed: int, index: int) -> int:
    """The generator seed of chunk `index` (counted over all parameters in `named_parameters` order). A hash
    of both, 32 bits: torch's CPU generator (mt19937) keeps only a seed's low 32 bits."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=4).digest(), "little")


@torch.no_grad()
def _random_model_on_meta(
    arch: str, config: PreTrainedConfig, p: Preset, never: list[int], seed: int
) -> PreTrainedModel:
    """`arch`'s model with random weights in `p.dtype`, for `save_pretrained` only (non-persistent buffers such as
    rotary `inv_freq` are left uninitialised). Built on the meta device, so there is no float32 copy and no
    transformers init pass; then every tensor is filled from `seed`, chunk by chunk, each chunk from its own
    torch.Generator: the same bytes whatever the thread count. Matrices (and the patch conv) get normal(0,
    init_std); 1-D gains 1 and biases 0 plus normal(0, 0.1) noise, as `_spread_weights`; rows `never` of lm_head
    are zeroed and the final norm's gain sets the logits' std to about `logit_std`, as there."""
    with torch.device("meta"):
        model = model_class(arch)(config)
    model = model.to(getattr(torch, p.dtype)).to_empty(device="cpu").eval()
    model.tie_weights()  # to_empty gives each module a new tensor, so tied embeddings must be tied again
    params = dict(model.named_parameters())  # tied tensors once
    unfilled = set(model.state_dict()) - set(params) - set(getattr(model, "_tied_weights_keys", None) or ())
    if unfilled:  # a persistent buffer would be saved as uninitialised memory
        raise RuntimeError(f"{arch} has persistent buffers this fill does not cover: {sorted(unfilled)[:4]}")
    chunks: list[tuple[torch.Tensor, float, float]] = []  # (flat slice, mean, std)
    for name, param in params.items():
        mean, std = (0.0 if name.endswith("bias") else 1.0, 0.1) if param.ndim == 1 else (0.0, p.init_std)
        flat = param.view(-1)
        chunks += [(flat[i : i + FILL_CHUNK], mean, std) for i in range(0, flat.numel(), FILL_CHUNK)]

    def fill(index: int) -> None:
        view, mean, std = chunks[index]
        with torch.no_grad():  # grad mode is per thread
            view.normal_(mean, std, generator=torch.Generator().manual_seed(_chunk_seed(seed, index)))

    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:  # normal_ releases the GIL
        list(pool.map(fill, range(len(chunks))))
    _zero_rows_and_spread_logits(model, p, never, std_of_live_rows=True)
    return model


def preprocessor_configs(arch: str, p: Preset) -> tuple[dict, dict]:
    if arch in QWEN3_ARCHS:
        return _qwen3_preprocessor_configs(p)
    processor = "Qwen2VLProcessor" if arch == "qwen2_vl" else "Qwen2_5_VLProcessor"
    image = {
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "rescale_factor": 1 / 255, "resample": 3,
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "min_pixels": p.min_pixels, "max_pixels": p.max_pixels,
        "size": {"shortest_edge": p.min_pixels, "longest_edge": p.max_pixels},
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": processor,
    }  # fmt: skip
    video = {k: v for k, v in image.items() if k != "image_processor_type"}
    video.update(video_processor_type="Qwen2VLVideoProcessor", fps=2.0, min_frames=4, max_frames=p.max_frames,
                 do_sample_frames=False)  # fmt: skip
    return image, video


def _qwen3_preprocessor_configs(p: Preset) -> tuple[dict, dict]:
    """As Qwen3-VL's hub files: 16 px patches, mean and std 0.5; the video `size` bounds the pixels of the whole
    clip (frames x height x width), not of one frame. The preset's bounds, in merged tokens, carry over."""
    token = (QWEN3_PATCH * 2) ** 2  # pixels per merged token
    min_pixels, max_pixels = p.min_pixels // (28 * 28) * token, p.max_pixels // (28 * 28) * token
    half = [0.5, 0.5, 0.5]
    image = {
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": half, "image_std": half, "rescale_factor": 1 / 255, "resample": 3,
        "patch_size": QWEN3_PATCH, "temporal_patch_size": 2, "merge_size": 2,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
    }  # fmt: skip
    video = {k: v for k, v in image.items() if k != "image_processor_type"}
    video.update(
        size={"shortest_edge": 2 * min_pixels, "longest_edge": 4 * max_pixels}, video_processor_type="Qwen3VLVideoProcessor",
        fps=2.0, min_frames=4, max_frames=p.max_frames, do_sample_frames=True,
    )  # fmt: skip
    return image, video


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "qwen2_vl",
    preset: str = "tiny",
    seed: int = 0,
    vocab_multiple: int = 64,
    max_shard_size: int | str = "2GB",
    **preset_fields: int,
) -> Path:
    """Write a random-weight checkpoint of `arch` to `out_dir` and return the path; same seed -> same bytes.

    `vocab_multiple`: the embedding rows are the tokenizer's padded to a multiple of this (Qwen pads;
    1 keeps an odd vocabulary), unless the preset fixes them (`vocab_rows`). `preset_fields` override the
    preset's (e.g. kv_heads=1, bpe_vocab=4031). A hub-scale preset (`HUB_PRESETS`, e.g. "qwen2-vl-2b") is for
    its one arch; its model is built on the meta device and filled in its dtype (`_random_model_on_meta`).
    The weights are written in safetensors shards of at most `max_shard_size` (the small presets fit in one)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if preset not in PRESET_NAMES:
        raise ValueError(f"preset must be one of {PRESET_NAMES}, got {preset!r}")
    _check_hub_arch(arch, preset)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    p = dataclasses.replace(get_preset(preset), **preset_fields)

    extra = QWEN3_EXTRA_TOKENS if arch in QWEN3_ARCHS else ()
    tok = build_tokenizer(p.bpe_vocab, extra_tokens=extra)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tok.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", tokenizer_config(tok, extra))
    template = QWEN3_CHAT_TEMPLATE if arch in QWEN3_ARCHS else CHAT_TEMPLATE
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")

    vocab_size = p.vocab_rows or -(-tok.get_vocab_size() // vocab_multiple) * vocab_multiple  # padded, as Qwen
    if vocab_size < tok.get_vocab_size():
        raise ValueError(f"vocab_size {vocab_size} is less than the tokenizer's {tok.get_vocab_size()} tokens")
    config = build_config(arch, preset, ids, vocab_size, **preset_fields)
    # Padded ids cannot be detokenized and a generated <|image_pad|> would read as a placeholder, so of the rows
    # past the BPE vocab only the stop tokens may win. Tied rows are input embeddings too: zero padding only.
    stops = {ids["<|im_end|>"], ids["<|endoftext|>"]}
    first = tok.get_vocab_size() if config.tie_word_embeddings else p.bpe_vocab
    never = [i for i in range(first, vocab_size) if i not in stops]
    if preset in HUB_PRESETS:
        model = _random_model_on_meta(arch, config, p, never, seed)
    else:
        torch.manual_seed(seed)
        model = model_class(arch)(config).eval()
        _spread_weights(model, p, never)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    gen = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], do_sample=False,
    )  # fmt: skip
    gen.save_pretrained(out)
    if arch in VL_ARCHS:
        image, video = preprocessor_configs(arch, p)
        write_json(out / "preprocessor_config.json", image)
        write_json(out / "video_preprocessor_config.json", video)
    return out
