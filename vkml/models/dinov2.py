"""DINOv2's ViT encoder (Hugging Face `Dinov2Model`), for a backbone that stays frozen while a
head learns on its features.

pixel_values (B, 3, H, W) -> patch embedding (a patch x patch convolution of stride patch) ->
[CLS] + patch tokens + position embeddings -> pre-LN layers (LayerNorm, self-attention, layer
scale, residual; LayerNorm, fc1-GELU-fc2, layer scale, residual) -> LayerNorm.

The position table is stored for `image_size` (DINOv2's checkpoints: 518, a 37 x 37 grid); an
image of another size reads it resized bicubically as Hugging Face does (in the graph, so the
table keeps the file's shape and `session.load` reads the file as it is). Parameter names are
`Dinov2Model`'s state-dict names under `prefix`, as transformers 5 spells them
(`encoder.layer.{i}.attention.q_proj`); files in the older spelling (`attention.attention.query`,
`attention.output.dense`: the checkpoints on the Hub) are renamed by `state_dict_names`.
The default config is DINOv2-small's (ViT-S/14: 12 layers, width 384, 6 heads).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from vkml.graph import Graph, Tensor
from vkml.models.common import heads, merge_heads
from vkml.nn import linear

# Older transformers' names of the attention's projections -> transformers 5's.
LEGACY_NAMES = (("attention.attention.query.", "attention.q_proj."),
                ("attention.attention.key.", "attention.k_proj."),
                ("attention.attention.value.", "attention.v_proj."),
                ("attention.output.dense.", "attention.o_proj."))


@dataclass(frozen=True)
class Dinov2Config:
    hidden_size: int = 384
    num_hidden_layers: int = 12
    num_attention_heads: int = 6
    mlp_ratio: int = 4
    patch_size: int = 14
    image_size: int = 518  # the position table's grid is image_size // patch_size square
    layer_norm_eps: float = 1e-6
    layerscale_value: float = 1.0
    initializer_range: float = 0.02

    @property
    def table_grid(self) -> int:
        return self.image_size // self.patch_size


def tiny() -> Dinov2Config:
    return replace(Dinov2Config(), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                   image_size=56)


def state_dict_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A Dinov2Model state dict in either transformers spelling -> this module's names."""
    renamed = {}
    for name, value in tensors.items():
        for old, new in LEGACY_NAMES:
            name = name.replace(old, new)
        renamed[name] = value
    return renamed


def config_of(tensors: dict[str, np.ndarray], num_heads: int | None = None) -> Dinov2Config:
    """The architecture a Dinov2Model state dict has (the file does not say how many heads:
    DINOv2's are 64 wide, so hidden_size // 64 unless given). Raises ValueError naming what
    is missing or not DINOv2's."""
    tensors = state_dict_names(tensors)
    needed = ("embeddings.cls_token", "embeddings.position_embeddings",
              "embeddings.patch_embeddings.projection.weight", "encoder.layer.0.mlp.fc1.weight")
    missing = [n for n in needed if n not in tensors]
    if missing:
        swiglu = any(".mlp.weights_in." in n or ".mlp.gate_proj." in n for n in tensors)
        raise ValueError("not a Dinov2Model state dict: no " + ", ".join(missing) + (
            " (a SwiGLU feed-forward, DINOv2-giant's, is not supported)" if swiglu else
            "; give the backbone's own tensors (Dinov2Model's names, no prefix)"))
    hidden = tensors["embeddings.cls_token"].shape[-1]
    patch = tensors["embeddings.patch_embeddings.projection.weight"].shape[-1]
    positions = tensors["embeddings.position_embeddings"].shape[1] - 1
    grid = int(round(positions ** 0.5))
    if grid * grid != positions:
        raise ValueError(f"embeddings.position_embeddings has {positions} patch positions, not "
                         "a square grid")
    layers = 1 + max(int(m.group(1)) for n in tensors
                     if (m := re.match(r"encoder\.layer\.(\d+)\.", n)))
    ratio = tensors["encoder.layer.0.mlp.fc1.weight"].shape[0] // hidden
    return Dinov2Config(hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=num_heads or max(1, hidden // 64), mlp_ratio=ratio,
                        patch_size=patch, image_size=grid * patch)


def layer_norm(g: Graph, cfg: Dinov2Config, name: str, trainable: bool = True
               ) -> Callable[[Tensor], Tensor]:
    """A LayerNorm `name` over the hidden size, its parameters made once, applied by calling."""
    d = cfg.hidden_size
    weight = g.param(f"{name}.weight", (d,), 1.0, trainable=trainable)
    bias = g.param(f"{name}.bias", (d,), "zeros", trainable=trainable)
    return lambda x: g.layer_norm(x, d, weight, bias, cfg.layer_norm_eps)


def position_embeddings(g: Graph, table: Tensor, grid: tuple[int, int], cfg: Dinov2Config
                        ) -> Tensor:
    """The table (1, 1 + G0*G0, D) for a grid of patches: as stored when it is the table's own
    square grid, else its patch part resized bicubically (torch's F.interpolate, align_corners
    False: Hugging Face's interpolate_pos_encoding), the [CLS] entry as is."""
    g0, d = cfg.table_grid, cfg.hidden_size
    if grid == (g0, g0):
        return table
    patches = g.reshape(g.slice(table, 1, 1, 1 + g0 * g0), (1, g0, g0, d))
    patches = g.interpolate(g.transpose(patches, (0, 3, 1, 2)), size=grid, mode="bicubic")
    patches = g.reshape(g.transpose(patches, (0, 2, 3, 1)), (1, grid[0] * grid[1], d))
    return g.concat([g.slice(table, 1, 0, 1), patches], 1)


def dinov2(g: Graph, pixel_values: Tensor, cfg: Dinov2Config, prefix: str = "",
           trainable: bool = True) -> list[Tensor]:
    """Hidden states of `pixel_values` (B, 3, H, W), H and W multiples of the patch: the
    embeddings' and each layer's (B, 1 + H/p * W/p, D), [CLS] first, as Hugging Face's
    `hidden_states`, before the final LayerNorm (`final_norm`). `trainable=False` builds every
    parameter frozen."""
    b, _, h, w = pixel_values.shape
    p, d, nh = cfg.patch_size, cfg.hidden_size, cfg.num_attention_heads
    if h % p or w % p:
        raise ValueError(f"DINOv2's input must be a multiple of its patch {p} each way, got "
                         f"{h} x {w}")
    grid = (h // p, w // p)
    std = cfg.initializer_range

    def param(name: str, shape: tuple[int, ...], init: str | float = "normal",
              scale: float = std) -> Tensor:
        return g.param(prefix + name, shape, init, scale, trainable=trainable)

    def dense(name: str, x: Tensor, n_in: int, n_out: int) -> Tensor:
        return linear(g, prefix + name, x, n_in, n_out, std=std, trainable=trainable)

    e = "embeddings."
    weight = param(e + "patch_embeddings.projection.weight", (d, 3, p, p))
    bias = param(e + "patch_embeddings.projection.bias", (d,), "zeros")
    x = g.conv2d(pixel_values, weight, bias, stride=p)  # (B, D, h/p, w/p)
    x = g.transpose(g.reshape(x, (b, d, grid[0] * grid[1])), (0, 2, 1))
    cls = g.broadcast_to(param(e + "cls_token", (1, 1, d)), (b, 1, d))
    param(e + "mask_token", (1, d), "zeros")  # masked pre-training only: in the file, unused
    table = param(e + "position_embeddings", (1, 1 + cfg.table_grid ** 2, d))
    x = g.concat([cls, x], 1) + position_embeddings(g, table, grid, cfg)
    hidden = [x]
    for i in range(cfg.num_hidden_layers):
        q = f"encoder.layer.{i}."
        a = layer_norm(g, cfg, prefix + q + "norm1", trainable)(x)
        qs, ks, vs = (heads(g, dense(q + f"attention.{n}_proj", a, d, d), nh, d // nh)
                      for n in "qkv")
        a = dense(q + "attention.o_proj", merge_heads(g, g.scaled_dot_product_attention(
            qs, ks, vs)), d, d)
        x = x + a * param(q + "layer_scale1.lambda1", (d,), cfg.layerscale_value)
        m = layer_norm(g, cfg, prefix + q + "norm2", trainable)(x)
        m = dense(q + "mlp.fc2", dense(q + "mlp.fc1", m, d, d * cfg.mlp_ratio).gelu(),
                  d * cfg.mlp_ratio, d)
        x = x + m * param(q + "layer_scale2.lambda1", (d,), cfg.layerscale_value)
        hidden.append(x)
    return hidden


def final_norm(g: Graph, cfg: Dinov2Config, prefix: str = "",
               trainable: bool = True) -> Callable[[Tensor], Tensor]:
    """Dinov2Model's last LayerNorm (`layernorm`): of the last hidden state it gives
    `last_hidden_state`; Dinov2Backbone applies it to every stage it returns."""
    return layer_norm(g, cfg, prefix + "layernorm", trainable)
