"""The vision tower: transformers' own module for the checkpoint's architecture, loaded with the
checkpoint's weights (either key layout), encoding one or more temporal groups of one item at a time.

Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision attention never crosses a temporal group (cu_seqlens per t),
and Qwen3-VL's learned position embeddings are interpolated per (h, w) grid, the same for every t; so
encoding groups separately gives exactly the embeddings of encoding the item whole.

Qwen3-VL's DeepStack: the tower also emits one merged feature per `deepstack_visual_indexes` layer;
`encode` returns them beside the main embeddings as extra column blocks (see `encode`).

A quantized tower (any quantized layer's tensors under the vision prefixes) is refused with the layer named.

Under tensor parallelism the tower is replicated (data mode: ranks encode different items), or, in
weights mode, each block is sharded like the decoder (`shard_tower`): qkv and the MLP's first layer
column-parallel by heads / features, the attention output and the MLP's last layer row-parallel with
one all-reduce each; the patch embedding and the merger stay whole. Every rank then encodes every item.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig
from transformers.utils.generic import get_max_seqlen
from transformers.vision_utils import (
    get_vision_attention_seqlens,
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
    get_vision_window_index,
)

from mmserve.distributed.group import TensorParallelGroup
from mmserve.models.parallel import ColumnParallelLinear, RowParallelLinear, split_evenly

_PREFIXES = ("model.visual.", "visual.")


def _tower_class(model_type: str) -> type[torch.nn.Module]:
    if model_type == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        return Qwen2VisionTransformerPretrainedModel
    if model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        return Qwen2_5_VisionTransformerPretrainedModel
    if model_type == "qwen3_vl":
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return Qwen3VLVisionModel
    if model_type == "qwen3_vl_moe":
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

        return Qwen3VLMoeVisionModel
    raise ValueError(f"model_type {model_type!r} has no vision tower mmserve knows")


class VisionTower:
    def __init__(
        self,
        hf_config: PretrainedConfig,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        shard_over: TensorParallelGroup | None = None,
    ):
        """`shard_over`: the group whose ranks each hold a shard of every block (weights mode);
        None: the whole tower here."""
        vision_config = hf_config.vision_config
        vision_config._attn_implementation = "sdpa"  # what transformers picks for the reference model
        self.model = _tower_class(hf_config.model_type)(vision_config)
        state = {}
        for file in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    prefix = next((p for p in _PREFIXES if key.startswith(p)), None)
                    if prefix is not None:
                        _refuse_quantized(key, f.get_slice(key).get_dtype())
                        state[key[len(prefix) :]] = f.get_tensor(key)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("inv_freq")]
        if missing or unexpected:
            raise ValueError(
                f"vision tower weights do not match: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        if shard_over is not None and shard_over.world_size > 1:
            shard_tower(self.model, shard_over)  # on the host, before the shard alone goes to the device
        self.model.to(device=device, dtype=dtype).eval()
        self.device, self.dtype = device, dtype
        self.spatial_merge_size: int = vision_config.spatial_merge_size
        # Qwen2-VL names the merger's output width `hidden_size`; Qwen2.5-VL and Qwen3-VL `out_hidden_size`.
        self.out_hidden: int = getattr(vision_config, "out_hidden_size", None) or vision_config.hidden_size
        self._num_deepstack = len(getattr(vision_config, "deepstack_visual_indexes", None) or ())

    @property
    def num_deepstack_levels(self) -> int:
        """L: DeepStack features per token beside the main embedding (Qwen3-VL; 0 for Qwen2/2.5-VL)."""
        return self._num_deepstack

    @property
    def embed_width(self) -> int:
        """Columns of `encode`'s output: out_hidden * (1 + L)."""
        return self.out_hidden * (1 + self._num_deepstack)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """pixel_values: [t * h * w, patch_dim] patches of `grid_thw` -> [t * h * w / merge**2, embed_width].

        Columns [0, out_hidden) hold the merged embeddings (what replaces the placeholder tokens);
        columns [(1 + i) * out_hidden, (2 + i) * out_hidden) DeepStack level i, the feature added to the
        decoder's hidden states after its layer i (Qwen3-VL only; L = 0 otherwise, the width out_hidden).
        """
        grid = torch.tensor([grid_thw], device=self.device)
        out = self.model(pixel_values.to(self.device, self.dtype), grid_thw=grid)
        if not self._num_deepstack:
            return out.pooler_output  # [tokens, out_hidden]
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)  # [tokens, out_hidden * (1 + L)]

    # -- encoding in slices of blocks ------------------------------------------------------------------------
    # One temporal group of a large tower (Qwen2-VL-2B: 32 blocks over 1,156 patches) can take seconds; the
    # scheduler spreads it over several steps, a slice of blocks each, so the decodes beside it keep their pace.
    # `begin` + `advance` (any slices) + `finish` compute what `encode` does, op for op (tests/test_vision.py).

    @property
    def depth(self) -> int:
        """Blocks in the tower: the units `advance` runs."""
        return len(self.model.blocks)  # type: ignore[arg-type]

    @torch.inference_mode()
    def begin(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> PartialEncode:
        """The tower's input stage (patch embedding, positions, attention spans) for `encode`'s arguments."""
        m: Any = self.model
        grid = torch.tensor([grid_thw], device=self.device)
        position_ids = get_vision_position_ids(grid, m.spatial_merge_size)
        cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid, m.config)
        hidden = m.patch_embed(pixel_values.to(self.device, self.dtype))
        if hasattr(m, "pos_embed"):  # Qwen3-VL: learned positions, interpolated
            indices, weights = get_vision_interpolation_indices_and_weights(
                grid, num_grid_per_side=m.num_grid_per_side, mode=m.interpolation_mode,
                align_corners=m.interpolation_align_corners, spatial_merge_size=m.config.spatial_merge_size,
            )  # fmt: skip
            hidden = hidden + (m.pos_embed(indices) * weights[:, :, None]).sum(1).to(hidden.dtype)
        windows = None
        if hasattr(m, "fullatt_block_indexes"):  # Qwen2.5-VL: window attention in most blocks, in window order
            window_index, cu_window = get_vision_window_index(
                grid, spatial_merge_size=m.spatial_merge_size, window_size=m.window_size, patch_size=m.patch_size
            )
            windows = (window_index, cu_window, get_max_seqlen(cu_window, m.config, kwarg_name="max_window_seqlen"))
            seq_len = hidden.shape[0]
            hidden = m.permute_input_for_window_attn(hidden, window_index, seq_len=seq_len)
            rotary = tuple(
                m.permute_input_for_window_attn(f, window_index, seq_len=seq_len)
                for f in m.rotary_pos_emb(hidden, position_ids)
            )
        else:
            rotary = m.rotary_pos_emb(hidden, position_ids)
        return PartialEncode(hidden.reshape(hidden.shape[0], -1), 0, rotary, (cu_seqlens, max_seqlen), windows, [])

    @torch.inference_mode()
    def advance(self, state: PartialEncode, num_blocks: int) -> None:
        """Run the next `num_blocks` blocks (at most to the tower's end) over `state`, in place."""
        m: Any = self.model
        full_attention = getattr(m, "fullatt_block_indexes", None)
        deepstack = list(getattr(m, "deepstack_visual_indexes", None) or ())
        for index in range(state.blocks_done, min(self.depth, state.blocks_done + num_blocks)):
            cu_seqlens, max_seqlen = state.spans
            if state.windows is not None and index not in full_attention:
                _, cu_seqlens, max_seqlen = state.windows
            state.hidden = m.blocks[index](
                state.hidden, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, position_embeddings=state.rotary
            )
            if index in deepstack:
                state.deepstack.append(m.deepstack_merger_list[deepstack.index(index)](state.hidden))
            state.blocks_done = index + 1

    @torch.inference_mode()
    def finish(self, state: PartialEncode) -> torch.Tensor:
        """`encode`'s result from a state every block has run over."""
        if state.blocks_done != self.depth:
            raise ValueError(f"{state.blocks_done} of the tower's {self.depth} blocks have run")
        merged = self.model.merger(state.hidden)  # type: ignore[operator]
        if state.windows is not None:  # back from window order
            merged = merged[torch.argsort(state.windows[0]), :]
        return torch.cat([merged, *state.deepstack], dim=-1) if state.deepstack else merged


@dataclass(eq=False)
class PartialEncode:
    """A media run part-way through the tower: its hidden states after blocks [0, blocks_done).

    hidden: [patches, vision hidden] (Qwen2.5-VL: in window order); rotary: the blocks' position embeddings;
    spans: (cu_seqlens, max_seqlen) of full attention; windows: Qwen2.5-VL's (window_index, cu_window_seqlens,
    max_window_seqlen), else None; deepstack: the DeepStack features of the levels already passed (Qwen3-VL).
    """

    hidden: torch.Tensor
    blocks_done: int
    rotary: Any
    spans: tuple[torch.Tensor, Any]
    windows: tuple[torch.Tensor, torch.Tensor, Any] | None
    deepstack: list[torch.Tensor]


# Tensors of a quantized layer (compressed-tensors, AWQ, block-wise FP8), and the dtypes of unquantized weights.
_QUANTIZED_TENSORS = ("weight_scale", "weight_packed", "weight_zero_point", "weight_shape", "weight_scale_inv",
                      "input_scale", "qweight", "qzeros", "scales", "g_idx")  # fmt: skip
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def _refuse_quantized(key: str, dtype: str) -> None:
    """ValueError if checkpoint tensor `key` of the vision tower belongs to a quantized layer: the tower is
    transformers' module, which mmserve loads with plain weights only."""
    if key.rpartition(".")[2] in _QUANTIZED_TENSORS or dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"the vision tower is quantized ({key}, {dtype}): mmserve serves quantized decoders only; keep the vision "
            "tower unquantized (compressed-tensors `ignore`, AWQ / FP8 `modules_to_not_convert`)"
        )


def _column(linear: nn.Linear, num_parts: int, tp: TensorParallelGroup, what: str) -> ColumnParallelLinear:
    """This rank's output rows of `linear`, whose rows are `num_parts` equal parts (qkv: 3)."""
    part = split_evenly(linear.out_features // num_parts, tp.rank, tp.world_size, what)
    layer = ColumnParallelLinear(linear.in_features, [part] * num_parts, bias=linear.bias is not None)
    return _loaded_from(linear, layer)


def _row(linear: nn.Linear, tp: TensorParallelGroup) -> RowParallelLinear:
    return _loaded_from(linear, RowParallelLinear(linear.in_features, linear.out_features, linear.bias is not None, tp))


def _loaded_from(linear: nn.Linear, layer: ColumnParallelLinear | RowParallelLinear) -> Any:
    """`layer` holding its slice of `linear`'s weight and bias."""
    for name in ("weight", "bias"):
        tensor = getattr(linear, name)
        if tensor is not None:
            tensor = tensor.detach()
            layer.load_weight(name, tuple(tensor.shape), lambda d, a, n, t=tensor: t.narrow(d, a, n), None)
    return layer


def shard_tower(model: nn.Module, tp: TensorParallelGroup) -> None:
    """Replace each block's projections by this rank's shards (weights mode), in place."""
    for block in model.blocks:  # type: ignore[union-attr]
        attn, mlp = block.attn, block.mlp
        if attn.num_heads % tp.world_size:
            raise ValueError(
                f"{attn.num_heads} vision attention heads do not split over {tp.world_size} tensor-parallel ranks"
            )
        attn.qkv = _column(attn.qkv, 3, tp, "vision attention width")  # [q | k | v], each by heads
        attn.proj = _row(attn.proj, tp)
        attn.num_heads //= tp.world_size  # the forward reshapes qkv's output by it; head_dim is unchanged
        if hasattr(mlp, "fc1"):  # Qwen2-VL
            mlp.fc1 = _column(mlp.fc1, 1, tp, "vision MLP width")
            mlp.fc2 = _row(mlp.fc2, tp)
        elif hasattr(mlp, "linear_fc1"):  # Qwen3-VL (its attention reshapes qkv by num_heads as well)
            mlp.linear_fc1 = _column(mlp.linear_fc1, 1, tp, "vision MLP width")
            mlp.linear_fc2 = _row(mlp.linear_fc2, tp)
        else:  # Qwen2.5-VL's gated MLP
            mlp.gate_proj = _column(mlp.gate_proj, 1, tp, "vision MLP width")
            mlp.up_proj = _column(mlp.up_proj, 1, tp, "vision MLP width")
            mlp.down_proj = _row(mlp.down_proj, tp)


@dataclass(frozen=True, eq=False)
class EncoderInput:
    """Preprocessed pixels of one media item (or of some of its temporal groups), patch rows in
    (t, h, w) order; `grid_thw` is the whole item's grid.

    pixel_values: [groups held * h * w, patch_dim]; temporal group g (first_group <= g) owns rows
    [(g - first_group) * h * w, (g - first_group + 1) * h * w). A tensor-parallel rank is sent only
    the groups it encodes (`first_group` > 0 then).
    """

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    first_group: int = 0

    def groups(self, first: int, last: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Patch rows and grid of temporal groups first..last (inclusive)."""
        _, h, w = self.grid_thw
        held = self.pixel_values.shape[0] // (h * w)
        if first < self.first_group or last >= self.first_group + held:
            raise ValueError(
                f"temporal groups {first}..{last} are not held (groups {self.first_group}.."
                f"{self.first_group + held - 1} are)"
            )
        a, b = (first - self.first_group) * h * w, (last + 1 - self.first_group) * h * w
        return self.pixel_values[a:b], (last - first + 1, h, w)
