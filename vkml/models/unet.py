"""The small diffusion U-Net of tools/PROTOCOL.md: 4 input channels, base width 64, three levels of
widths x1, x2, x4; ResBlocks of GroupNorm(16)-SiLU-Conv3x3 twice with a residual (a 1x1
`conv_shortcut` where the width changes); a stride-2 3x3 conv down between levels; nearest x2 up
followed by a 3x3 conv; the encoder's output at each level concatenated (channels) to the
decoder's input at that level; GroupNorm-SiLU-Conv3x3 out. Loss: MSE against `target` (e.g. the
noise added to `x`). No timestep conditioning (the protocol's workload has none).

Parameter names, PyTorch/diffusers style: `conv_in.*`, `down.{i}.res.{norm1,conv1,norm2,conv2,
conv_shortcut}.*`, `down.{i}.downsample.*`, `mid.res.*`, `up.{i}.upsample.*`, `up.{i}.res.*`,
`norm_out.*`, `conv_out.*` (`tests/torch_reference.py` has the same module tree in PyTorch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from vkml.graph import Graph, Tensor
from vkml.models.common import Built


@dataclass(frozen=True)
class UNetConfig:
    in_channels: int = 4
    out_channels: int = 4
    base: int = 64
    mults: tuple[int, ...] = (1, 2, 4)
    groups: int = 16
    eps: float = 1e-5
    batch: int = 2
    image_size: int = 32


def tiny() -> UNetConfig:
    return replace(UNetConfig(), base=8, groups=4, image_size=8)


def _conv(g: Graph, name: str, x: Tensor, out: int, k: int = 3, stride: int = 1) -> Tensor:
    bound = 1.0 / math.sqrt(x.shape[1] * k * k)  # torch.nn.Conv2d's default init
    w = g.param(f"{name}.weight", (out, x.shape[1], k, k), "uniform", bound)
    b = g.param(f"{name}.bias", (out,), "uniform", bound)
    return g.conv2d(x, w, b, stride, k // 2)


def _norm(g: Graph, name: str, x: Tensor, cfg: UNetConfig) -> Tensor:
    c = x.shape[1]
    return g.group_norm(x, cfg.groups, g.param(f"{name}.weight", (c,), 1.0),
                        g.param(f"{name}.bias", (c,)), cfg.eps)


def _res(g: Graph, p: str, x: Tensor, out: int, cfg: UNetConfig) -> Tensor:
    h = _conv(g, p + "conv1", _norm(g, p + "norm1", x, cfg).silu(), out)
    h = _conv(g, p + "conv2", _norm(g, p + "norm2", h, cfg).silu(), out)
    return h + (x if x.shape[1] == out else _conv(g, p + "conv_shortcut", x, out, 1))


def unet(g: Graph, x: Tensor, cfg: UNetConfig) -> Tensor:
    """(N, in, H, W) -> (N, out, H, W); H and W divisible by 2^(levels-1)."""
    widths = [cfg.base * m for m in cfg.mults]
    h = _conv(g, "conv_in", x, widths[0])
    skips = []
    for i, w in enumerate(widths):
        h = _res(g, f"down.{i}.res.", h, w, cfg)
        skips.append(h)
        if i < len(widths) - 1:
            h = _conv(g, f"down.{i}.downsample", h, w, 3, 2)
    h = _res(g, "mid.res.", h, widths[-1], cfg)
    for i in reversed(range(len(widths))):
        if i < len(widths) - 1:
            h = _conv(g, f"up.{i}.upsample", g.upsample_nearest(h, 2), h.shape[1])
        h = _res(g, f"up.{i}.res.", g.concat([h, skips[i]], 1), widths[i], cfg)
    h = _norm(g, "norm_out", h, cfg).silu()
    return _conv(g, "conv_out", h, cfg.out_channels)


def build(cfg: UNetConfig | None = None, seed: int = 0) -> Built:
    """Inputs `x` and `target` (N, C, H, W); output `prediction`; loss: MSE."""
    cfg = cfg or UNetConfig()
    g = Graph(seed=seed)
    shape = (cfg.batch, cfg.in_channels, cfg.image_size, cfg.image_size)
    x = g.input("x", shape)
    target = g.input("target", (cfg.batch, cfg.out_channels, cfg.image_size, cfg.image_size))
    prediction = g.output("prediction", unet(g, x, cfg))
    loss = g.mse(prediction, target)

    def sample(rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"x": rng.standard_normal(x.shape).astype(np.float32),
                "target": rng.standard_normal(target.shape).astype(np.float32)}

    return Built(g, {"x": x, "target": target}, {"prediction": prediction}, loss, sample)
