"""The depth network, in the spirit of DINOv2 + DPT ("DinoVision"): a small ViT encoder (patch
embedding, a few pre-norm attention blocks) and a convolutional decoder that upsamples the patch
tokens back to full resolution, with one full-resolution skip from the image, predicting per-pixel
depth (normalised to [0, 1] by the scene's far distance).

Parameters are named `encoder.*` and `decoder.*`. Live training is either the whole network or
the decoder only; in the latter case the encoder's parameters are built frozen
(`graph.param(..., trainable=False)`: no gradient, no optimizer state, saved and loaded like the
rest), as DinoVision freezes its pretrained backbone and adapts a light head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import vkml
from vkml.graph import Graph, Tensor

LIVE_MODES = ("decoder", "all")


@dataclass(frozen=True)
class NetConfig:
    resolution: int = 64  # input and output are resolution x resolution
    patch: int = 8  # patch size of the ViT's tokens
    dim: int = 48  # token width
    heads: int = 4
    blocks: int = 2
    mlp_ratio: int = 2
    tile_channels: int = 8  # features per pixel that each token projects to its patch
    skip_channels: int = 8  # full-resolution features straight from the image
    refine_channels: int = 8  # the full-resolution convolution between them and the head

    def __post_init__(self) -> None:
        if self.resolution % self.patch:
            raise ValueError(f"resolution {self.resolution} is not a multiple of the patch "
                             f"size {self.patch}")
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} is not a multiple of heads {self.heads}")

    @property
    def grid(self) -> int:
        return self.resolution // self.patch


def config_for(resolution: int) -> NetConfig:
    """The network for a resolution: the patch grows with it so the token count stays 64."""
    if resolution < 32 or resolution % 8:
        raise ValueError(f"resolution must be a multiple of 8, at least 32, got {resolution}")
    return NetConfig(resolution=resolution, patch=resolution // 8)


class _Params:
    """Creates parameters under one prefix, trainable or frozen, initialised as PyTorch's
    layers are (uniform within 1/sqrt(fan_in))."""

    def __init__(self, g: Graph, prefix: str, trainable: bool) -> None:
        self.g, self.prefix, self.trainable = g, prefix, trainable

    def __call__(self, name: str, shape: tuple[int, ...], init: str | float = "uniform",
                 scale: float = 1.0) -> Tensor:
        return self.g.param(f"{self.prefix}.{name}", shape, init, scale,
                            trainable=self.trainable)

    def linear(self, name: str, x: Tensor, n_in: int, n_out: int) -> Tensor:
        """x (..., n_in) @ W^T + b, a batched product (the weight gradient's sum over a batch
        of 1 is a reshape in vkml, no kernel)."""
        bound = 1.0 / math.sqrt(n_in)
        w = self(f"{name}.weight", (n_out, n_in), "uniform", bound)
        b = self(f"{name}.bias", (n_out,), "uniform", bound)
        return self.g.bias_add(self.g.matmul(x, w, transpose_b=True), b)

    def conv(self, name: str, x: Tensor, c_in: int, c_out: int, k: int, stride: int = 1,
             padding: int = 0) -> Tensor:
        bound = 1.0 / math.sqrt(c_in * k * k)
        w = self(f"{name}.weight", (c_out, c_in, k, k), "uniform", bound)
        b = self(f"{name}.bias", (c_out,), "uniform", bound)
        return self.g.conv2d(x, w, b, stride=stride, padding=padding)

    def norm(self, name: str, x: Tensor, dim: int) -> Tensor:
        return self.g.layer_norm(x, dim, self(f"{name}.weight", (dim,), 1.0),
                                 self(f"{name}.bias", (dim,), "zeros"))


def encoder(g: Graph, cfg: NetConfig, image: Tensor, trainable: bool) -> Tensor:
    """(B, 3, R, R) -> tokens (B, T, D)."""
    p = _Params(g, "encoder", trainable)
    b = image.shape[0]
    t, d, h = cfg.grid * cfg.grid, cfg.dim, cfg.heads
    x = p.conv("patch_embed", image, 3, d, cfg.patch, stride=cfg.patch)  # (B, D, G, G)
    x = g.transpose(g.reshape(x, (b, d, t)), (0, 2, 1))  # (B, T, D)
    x = g.add(x, p("pos_embed", (t, d), "normal", 0.02))
    for i in range(cfg.blocks):
        y = p.norm(f"blocks.{i}.norm1", x, d)

        def heads(name: str, y: Tensor = y, i: int = i) -> Tensor:
            z = p.linear(f"blocks.{i}.attn.{name}", y, d, d)
            return g.transpose(g.reshape(z, (b, t, h, d // h)), (0, 2, 1, 3))  # (B, H, T, hd)

        a = g.scaled_dot_product_attention(heads("q"), heads("k"), heads("v"))
        a = g.reshape(g.transpose(a, (0, 2, 1, 3)), (b, t, d))
        x = g.add(x, p.linear(f"blocks.{i}.attn.proj", a, d, d))
        y = p.norm(f"blocks.{i}.norm2", x, d)
        y = g.gelu(p.linear(f"blocks.{i}.mlp.fc1", y, d, d * cfg.mlp_ratio))
        x = g.add(x, p.linear(f"blocks.{i}.mlp.fc2", y, d * cfg.mlp_ratio, d))
    return p.norm("norm", x, d)


def decoder(g: Graph, cfg: NetConfig, image: Tensor, tokens: Tensor) -> Tensor:
    """Tokens (B, T, D) and the image -> depth (B, 1, R, R) in [0, 1].

    Each token is projected to a patch x patch tile of C-channel features (a "pixel shuffle":
    a reshape and a transpose, no interpolation), then two 3x3 convolutions at full resolution
    over those features and a skip from the image sharpen the edges that the 8x8 tiles cannot.
    Upsampling by stages (nearest x2 + conv) was 4x dearer to train on a CPU driver, where the
    gradient of each upsampling is a strided block sum."""
    p = _Params(g, "decoder", True)
    b, t, d = tokens.shape
    c, k, n = cfg.tile_channels, cfg.patch, cfg.grid
    x = p.linear("project", tokens, d, k * k * c)  # (B, T, k*k*C)
    x = g.reshape(x, (b, n, n, k, k, c))
    x = g.reshape(g.transpose(x, (0, 5, 1, 3, 2, 4)), (b, c, n * k, n * k))  # (B, C, R, R)
    skip = g.relu(p.conv("skip", image, 3, cfg.skip_channels, 3, padding=1))
    x = g.concat([x, skip], 1)
    x = g.relu(p.conv("refine", x, c + cfg.skip_channels, cfg.refine_channels, 3, padding=1))
    x = p.conv("head", x, cfg.refine_channels, 1, 3, padding=1)
    return g.sigmoid(x)


@dataclass
class Built:
    graph: Graph
    image: Tensor
    depth: Tensor  # the prediction
    target: Tensor | None
    loss: Tensor | None


def build(cfg: NetConfig, batch: int = 1, train: bool = True, live: str = "decoder",
          seed: int = 0) -> Built:
    """The graph: inputs "image" (B, 3, R, R) and, for training, "target" (B, 1, R, R); output
    "depth"; MSE loss. `live`: "decoder" freezes the encoder, "all" trains everything."""
    if live not in LIVE_MODES:
        raise ValueError(f"live must be one of {LIVE_MODES}, got {live!r}")
    g = vkml.Graph(seed=seed)
    r = cfg.resolution
    image = g.input("image", (batch, 3, r, r))
    tokens = encoder(g, cfg, image, trainable=live == "all")
    depth = g.output("depth", decoder(g, cfg, image, tokens))
    if not train:
        return Built(g, image, depth, None, None)
    target = g.input("target", (batch, 1, r, r))
    return Built(g, image, depth, target, g.mse(depth, target))
