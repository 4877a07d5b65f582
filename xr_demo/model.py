"""The depth networks, in the spirit of DINOv2 + DPT ("DinoVision"), predicting per-pixel depth
(normalised to [0, 1] by the scene's far distance) from the rendered image. Two scales:

- "small" (`NetConfig`, the CPU default): a small ViT encoder (patch embedding, a few pre-norm
  attention blocks) and a convolutional decoder that projects each token to its patch's pixels,
  with one full-resolution skip from the image.
- "vits14" (`DptConfig`): DINOv2-small's ViT-S/14 (vkml/models/dinov2.py: 12 layers, width 384,
  6 heads, patch 14; its weights from a Dinov2Model safetensors file, or seeded; or the encoder
  imported from an ONNX export of Dinov2Backbone) and a DPT-style decoder: the tokens of four
  layers reassembled into maps at 4, 2, 1 and 1/2 times the 1/14 grid, fused upward from the
  coarsest with residual convolution units, and a head that predicts depth at the input size.

Parameters are named `encoder.*` and `decoder.*` (vits14's encoder: `encoder.` + Dinov2Model's
names; an imported one keeps the ONNX file's names). Live training is either the whole network
or the decoder only; in the latter case the encoder's parameters are built frozen
(`graph.param(..., trainable=False)`: no gradient, no optimizer state, saved and loaded like the
rest; the app also compiles with `trainable=` the decoder's, which freezes an imported
encoder), as DinoVision freezes its pretrained backbone and adapts a light head.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

import vkml
from vkml.graph import Graph, Tensor
from vkml.models import dinov2

LIVE_MODES = ("decoder", "all")
MODELS = ("small", "vits14")
VITS14 = dinov2.Dinov2Config()  # DINOv2-small's encoder
DEFAULT_RESOLUTION = {"small": 64, "vits14": 224}


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

    @property
    def normalisation(self) -> tuple[float, float]:
        """(mean, std) of the pixels in [0, 1] the network takes."""
        return 0.5, 0.25

    def describe(self) -> str:
        return (f"small: ViT ({self.blocks} blocks, width {self.dim}, {self.heads} heads, patch "
                f"{self.patch}) + pixel-shuffle decoder at {self.resolution}x{self.resolution}")


@dataclass(frozen=True)
class DptConfig:
    """ViT-S/14 (or the encoder given) and a DPT-style decoder whose widths follow the
    encoder's width D as Depth Anything's do: reassembly D/8, D/4, D/2, D; the fusion narrower
    than its (D/12: 32 for ViT-S, where Depth Anything small has 64), as the training step runs
    every frame and the decoder should stay a fraction of the encoder's cost."""
    resolution: int = 224
    encoder: dinov2.Dinov2Config = VITS14
    # the encoder imported from an ONNX export of Dinov2Backbone instead (its feature maps)
    encoder_onnx: str | None = None

    def __post_init__(self) -> None:
        p = self.encoder.patch_size
        if self.resolution % p or self.resolution < 2 * p:
            raise ValueError(f"the vits14 model's resolution must be a multiple of its patch "
                             f"{p}, at least {2 * p} (default 224), got {self.resolution}")

    @property
    def grid(self) -> int:
        return self.resolution // self.encoder.patch_size

    @property
    def reassemble(self) -> tuple[int, int, int, int]:
        """Channels of the maps at 4, 2, 1 and 1/2 times the grid."""
        d = self.encoder.hidden_size
        return d // 8, d // 4, d // 2, d

    @property
    def features(self) -> int:
        """The fusion stages' width."""
        return max(8, self.encoder.hidden_size // 12)

    @property
    def head(self) -> int:
        """The full-resolution convolution's width."""
        return self.features // 2

    @property
    def taps(self) -> tuple[int, ...]:
        """The hidden states (1-based layers) the decoder reads: four spread evenly, the
        last one last (ViT-S/14: 3, 6, 9, 12)."""
        n = self.encoder.num_hidden_layers
        return tuple(max(1, round(n * (i + 1) / 4)) for i in range(4))

    @property
    def normalisation(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        return (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's, as DINOv2 was trained

    def describe(self) -> str:
        e, n = self.encoder, self.grid
        if self.encoder_onnx:
            encoder = (f"ViT-S/14 encoder from {self.encoder_onnx} (its four feature maps, width "
                       f"{e.hidden_size}, {n}x{n})")
            layers = ""
        else:
            encoder = (f"ViT-S/14 encoder ({e.num_hidden_layers} layers, width {e.hidden_size}, "
                       f"{e.num_attention_heads} heads, patch {e.patch_size}, {n}x{n} tokens + "
                       "[CLS])")
            layers = f"layers {', '.join(map(str, self.taps))}; "
        return (f"vits14: {encoder} + DPT decoder ({layers}{self.features} features) at "
                f"{self.resolution}x{self.resolution}")


Config = NetConfig | DptConfig


def config(model: str, resolution: int, encoder: dinov2.Dinov2Config | None = None,
           encoder_onnx: str | None = None) -> Config:
    """The network `model` ("small" or "vits14") at `resolution`; vits14's encoder may be
    given (e.g. read from a weights file by dinov2.config_of), or imported from an ONNX file
    (`onnx_backbone`)."""
    if model == "small":
        return config_for(resolution)
    if model == "vits14":
        return DptConfig(resolution, encoder or VITS14, encoder_onnx)
    raise ValueError(f"model must be one of {MODELS}, got {model!r}")


class WeightsError(ValueError):
    """Encoder weights that do not fit the model (the message names the file and why)."""


def checked_vits14(tensors: dict[str, np.ndarray], path: str) -> dinov2.Dinov2Config:
    """The encoder of a Dinov2Model state dict read from `path`, if it is ViT-S/14 (its
    position table may be for any image size); else WeightsError naming what differs."""
    try:
        found = dinov2.config_of(tensors, num_heads=VITS14.num_attention_heads)
    except ValueError as e:
        raise WeightsError(f"--encoder-weights {path}: {e}") from None
    if replace(found, image_size=VITS14.image_size) != VITS14:
        raise WeightsError(f"--encoder-weights {path}: not ViT-S/14's weights (DINOv2-small: "
                           f"width {VITS14.hidden_size}, {VITS14.num_hidden_layers} layers, "
                           f"patch {VITS14.patch_size}), but width {found.hidden_size}, "
                           f"{found.num_hidden_layers} layers, patch {found.patch_size}")
    return found


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

    def conv_transpose(self, name: str, x: Tensor, c_in: int, c_out: int, k: int) -> Tensor:
        """Upsampling by k with a k x k transposed convolution of stride k (DPT's)."""
        bound = 1.0 / math.sqrt(c_out * k * k)  # torch's fan_in of a transposed weight
        w = self(f"{name}.weight", (c_in, c_out, k, k), "uniform", bound)
        b = self(f"{name}.bias", (c_out,), "uniform", bound)
        return self.g.conv_transpose2d(x, w, b, stride=k)

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


def feature_maps(g: Graph, cfg: DptConfig, hidden: list[Tensor],
                 norm: Callable[[Tensor], Tensor]) -> list[Tensor]:
    """Dinov2Backbone's feature maps of the tapped layers: each one's tokens through the
    encoder's final LayerNorm, without [CLS], as a (B, D, G, G) map."""
    b, n, d = hidden[0].shape[0], cfg.grid, cfg.encoder.hidden_size
    maps = []
    for tap in cfg.taps:
        x = g.slice(norm(hidden[tap]), 1, 1, 1 + n * n)  # the patch tokens
        maps.append(g.reshape(g.transpose(x, (0, 2, 1)), (b, d, n, n)))
    return maps


def onnx_backbone(cfg: DptConfig, batch: int, seed: int) -> tuple[Graph, Tensor, list[Tensor]]:
    """The encoder imported by vkml.import_onnx from an ONNX export of transformers'
    Dinov2Backbone with four out_features (ViT-S/14: stage3, stage6, stage9, stage12): the
    graph, its one input renamed "image" (B, 3, R, R), and its four feature maps
    (B, D, R/14, R/14). Raises WeightsError for a file that is not such an export."""
    import onnx  # the `onnx` extra

    path = str(cfg.encoder_onnx)
    proto = onnx.load(path)
    stored = {t.name for t in proto.graph.initializer}
    names = [i.name for i in proto.graph.input if i.name not in stored]
    if len(names) != 1:
        raise WeightsError(f"--encoder-weights {path}: the model has inputs {names}, not one "
                           "image")
    for i in proto.graph.input:
        if i.name == names[0]:
            i.name = "image"
    for node in proto.graph.node:
        node.input[:] = ["image" if x == names[0] else x for x in node.input]
    r = cfg.resolution
    try:
        imp = vkml.import_onnx(proto, shapes={"image": (batch, 3, r, r)}, seed=seed)
    except vkml.ModelImportError as e:
        raise WeightsError(f"--encoder-weights {path}: {e}") from None
    maps = list(imp.outputs.values())
    want = (batch, cfg.encoder.hidden_size, cfg.grid, cfg.grid)
    if len(maps) != 4 or any(m.shape != want for m in maps):
        raise WeightsError(
            f"--encoder-weights {path}: its outputs are {[m.shape for m in maps]} at {r}x{r}, "
            f"not four feature maps {want}: export Dinov2Backbone with out_features=['stage3', "
            "'stage6', 'stage9', 'stage12'] (see README)")
    return imp.graph, imp.inputs["image"], maps


def dpt_decoder(g: Graph, cfg: DptConfig, features: list[Tensor]) -> Tensor:
    """DPT's neck and head on four (B, D, G, G) feature maps -> depth (B, 1, R, R) in [0, 1].

    Reassemble: each map projected (1x1) and resized to 4, 2, 1 and 1/2 times the grid
    (transposed convolutions, identity, a strided 3x3 convolution), then a 3x3 convolution to
    the fusion width. Fuse: from the
    coarsest, each stage adds a residual convolution unit of its map to the path, runs
    another, upsamples x2 (bilinear, align_corners as DPT) and projects (1x1). Head: a 3x3
    convolution at 8 x the grid, bilinear resize to the input size, a 3x3 convolution and
    ReLU, a 1x1 convolution to one channel, a sigmoid (the target is depth / FAR)."""
    p = _Params(g, "decoder", True)
    d, f = cfg.encoder.hidden_size, cfg.features
    maps = []
    for i, (x, c) in enumerate(zip(features, cfg.reassemble)):
        x = p.conv(f"reassemble.{i}.project", x, d, c, 1)
        if i < 2:
            x = p.conv_transpose(f"reassemble.{i}.resize", x, c, c, (4, 2)[i])
        elif i == 3:
            x = p.conv(f"reassemble.{i}.resize", x, c, c, 3, stride=2, padding=1)
        maps.append(p.conv(f"reassemble.{i}.out", x, c, f, 3, padding=1))

    def residual_unit(name: str, x: Tensor) -> Tensor:
        y = p.conv(f"{name}.conv1", g.relu(x), f, f, 3, padding=1)
        return x + p.conv(f"{name}.conv2", g.relu(y), f, f, 3, padding=1)

    path = None
    for i in reversed(range(4)):
        x = maps[i]
        if path is not None:
            x = x + residual_unit(f"fusion.{i}.residual1", path)
        x = residual_unit(f"fusion.{i}.residual2", x)
        up = maps[i - 1].shape[-1] if i else 2 * x.shape[-1]
        x = g.interpolate(x, size=(up, up), mode="bilinear", align_corners=True)
        path = p.conv(f"fusion.{i}.project", x, f, f, 1)
    x = p.conv("head.conv1", path, f, f // 2, 3, padding=1)
    r = cfg.resolution
    x = g.interpolate(x, size=(r, r), mode="bilinear")
    x = g.relu(p.conv("head.conv2", x, f // 2, cfg.head, 3, padding=1))
    return g.sigmoid(p.conv("head.conv3", x, cfg.head, 1, 1))


@dataclass
class Built:
    graph: Graph
    image: Tensor
    depth: Tensor  # the prediction
    target: Tensor | None
    loss: Tensor | None


def build(cfg: Config, batch: int = 1, train: bool = True, live: str = "decoder",
          seed: int = 0) -> Built:
    """The graph: inputs "image" (B, 3, R, R) and, for training, "target" (B, 1, R, R); output
    "depth"; MSE loss. `live`: "decoder" freezes the encoder, "all" trains everything."""
    if live not in LIVE_MODES:
        raise ValueError(f"live must be one of {LIVE_MODES}, got {live!r}")
    r = cfg.resolution
    if isinstance(cfg, DptConfig) and cfg.encoder_onnx:
        g, image, maps = onnx_backbone(cfg, batch, seed)
        depth = g.output("depth", dpt_decoder(g, cfg, maps))
    elif isinstance(cfg, DptConfig):
        g = vkml.Graph(seed=seed)
        image = g.input("image", (batch, 3, r, r))
        hidden = dinov2.dinov2(g, image, cfg.encoder, "encoder.", trainable=live == "all")
        norm = dinov2.final_norm(g, cfg.encoder, "encoder.", trainable=live == "all")
        depth = g.output("depth", dpt_decoder(g, cfg, feature_maps(g, cfg, hidden, norm)))
    else:
        g = vkml.Graph(seed=seed)
        image = g.input("image", (batch, 3, r, r))
        tokens = encoder(g, cfg, image, trainable=live == "all")
        depth = g.output("depth", decoder(g, cfg, image, tokens))
    if not train:
        return Built(g, image, depth, None, None)
    target = g.input("target", (batch, 1, r, r))
    return Built(g, image, depth, target, g.mse(depth, target))
