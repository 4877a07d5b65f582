"""ResNet in torchvision's layout: ResNet-18/34 (basic blocks) and ResNet-50/101/152
(bottleneck blocks, stride on the 3x3 conv as torchvision's "v1.5"). Parameter names are
torchvision's (`conv1.weight`, `bn1.weight`, `bn1.bias`, `layer1.0.conv1.weight`,
`layer2.0.downsample.0.weight`, `layer2.0.downsample.1.*`, `fc.weight`, `fc.bias`), so a
torchvision `state_dict` loads by name.

Batch norm comes in two forms, `ResNetConfig.bn`:
- "train" (the default, what a training step uses): statistics of the current batch, as
  torchvision's model.train() normalises with. The running statistics are neither used nor
  updated (the graph has no state writes), so they are not in the graph: a torchvision file
  loads with `load(path, strict=False)`, which skips them (and a file saved from this form has
  none, rather than stale ones).
- "eval": torchvision's model.eval(): `bnX.running_mean` / `running_var` are frozen graph
  parameters (so a checkpoint's running statistics load by name; training leaves them alone),
  and each `bnX.num_batches_tracked` counter (int64, which nothing here computes with) is a
  checkpoint extra (`Graph.extra`): loaded and saved back unchanged, so a torchvision file
  loads with strict=True and what vkml saves loads back into torchvision.
The default config is ResNet-50 at the benchmark's batch 4 x 3 x 224 x 224, 1000 classes; loss:
cross-entropy against i32 class labels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from vkml.errors import GraphError
from vkml.graph import Graph, Tensor
from vkml.models.common import Built
from vkml.nn import linear


@dataclass(frozen=True)
class ResNetConfig:
    block: str = "bottleneck"  # "basic" (ResNet-18/34) or "bottleneck" (ResNet-50 and up)
    layers: tuple[int, ...] = (3, 4, 6, 3)
    widths: tuple[int, ...] = (64, 128, 256, 512)
    stem_width: int = 64
    num_classes: int = 1000
    in_channels: int = 3
    bn: str = "train"  # "train" (batch statistics) or "eval" (running statistics)
    bn_eps: float = 1e-5
    batch: int = 4
    image_size: int = 224


def resnet50() -> ResNetConfig:
    return ResNetConfig()


def resnet18() -> ResNetConfig:
    return ResNetConfig(block="basic", layers=(2, 2, 2, 2))


def tiny(block: str = "bottleneck") -> ResNetConfig:
    """The same code at test size: one block per stage, narrow, 64 x 64 images (the last
    stage at 2 x 2, so batch statistics there are over 8 values, not a degenerate 2)."""
    return replace(ResNetConfig(), block=block, layers=(1, 1, 1, 1), widths=(4, 8, 8, 16),
                   stem_width=8, num_classes=10, batch=2, image_size=64)


def _conv(g: Graph, name: str, x: Tensor, out: int, k: int, stride: int = 1) -> Tensor:
    # torchvision's init: kaiming_normal_(mode="fan_out", nonlinearity="relu")
    w = g.param(f"{name}.weight", (out, x.shape[1], k, k), "normal", math.sqrt(2.0 / (out * k * k)))
    return g.conv2d(x, w, None, stride, k // 2)


def _bn(g: Graph, name: str, x: Tensor, cfg: ResNetConfig) -> Tensor:
    c = x.shape[1]
    weight = g.param(f"{name}.weight", (c,), 1.0)
    bias = g.param(f"{name}.bias", (c,))
    if cfg.bn == "train":
        return g.batch_norm(x, weight=weight, bias=bias, training=True, eps=cfg.bn_eps)
    mean = g.param(f"{name}.running_mean", (c,), trainable=False)
    var = g.param(f"{name}.running_var", (c,), 1.0, trainable=False)
    g.extra(f"{name}.num_batches_tracked", np.int64(0))
    return g.batch_norm(x, mean, var, weight, bias, training=False, eps=cfg.bn_eps)


def _block(g: Graph, p: str, x: Tensor, width: int, stride: int, cfg: ResNetConfig) -> Tensor:
    if cfg.block == "basic":
        out_c = width
        h = _bn(g, p + "bn1", _conv(g, p + "conv1", x, width, 3, stride), cfg).relu()
        h = _bn(g, p + "bn2", _conv(g, p + "conv2", h, width, 3), cfg)
    else:
        out_c = width * 4
        h = _bn(g, p + "bn1", _conv(g, p + "conv1", x, width, 1), cfg).relu()
        h = _bn(g, p + "bn2", _conv(g, p + "conv2", h, width, 3, stride), cfg).relu()
        h = _bn(g, p + "bn3", _conv(g, p + "conv3", h, out_c, 1), cfg)
    if stride != 1 or x.shape[1] != out_c:
        x = _bn(g, p + "downsample.1", _conv(g, p + "downsample.0", x, out_c, 1, stride), cfg)
    return (h + x).relu()


def resnet(g: Graph, x: Tensor, cfg: ResNetConfig) -> Tensor:
    """Logits (N, classes) of images `x` (N, C, H, W)."""
    if cfg.block not in ("basic", "bottleneck") or cfg.bn not in ("train", "eval"):
        raise GraphError(f"resnet: block {cfg.block!r} / bn {cfg.bn!r}: use 'basic' or "
                         "'bottleneck' / 'train' or 'eval'")
    h = _bn(g, "bn1", _conv(g, "conv1", x, cfg.stem_width, 7, 2), cfg).relu()
    h = g.max_pool2d(h, 3, 2, 1)
    for stage, (n, width) in enumerate(zip(cfg.layers, cfg.widths), start=1):
        for i in range(n):
            stride = 2 if stage > 1 and i == 0 else 1
            h = _block(g, f"layer{stage}.{i}.", h, width, stride, cfg)
    n, c = h.shape[:2]
    h = g.reshape(g.global_avg_pool2d(h), (n, c))
    return linear(g, "fc", h, c, cfg.num_classes)


def build(cfg: ResNetConfig | None = None, seed: int = 0) -> Built:
    """Inputs `x` (N, C, H, W) and `labels` (N,) i32; output `logits`; loss: cross-entropy."""
    cfg = cfg or ResNetConfig()
    g = Graph(seed=seed)
    x = g.input("x", (cfg.batch, cfg.in_channels, cfg.image_size, cfg.image_size))
    labels = g.input("labels", (cfg.batch,), "i32")
    logits = g.output("logits", resnet(g, x, cfg))
    loss = g.cross_entropy(logits, labels)

    def sample(rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"x": rng.standard_normal(x.shape).astype(np.float32),
                "labels": rng.integers(0, cfg.num_classes, cfg.batch).astype(np.int32)}

    return Built(g, {"x": x, "labels": labels}, {"logits": logits}, loss, sample,
                 {"batch_norm": "batch statistics (training form)" if cfg.bn == "train"
                  else "running statistics as parameters (inference form)"})
