"""The model zoo's models: torchvision and Hugging Face transformers architectures, built with
seeded random weights (nothing is downloaded), each at three sizes.

- "tiny": the smallest configuration of the architecture that still has every kind of layer it
  has (a few channels, one or two blocks, tiny images or sequences): what `make test` runs.
- "small": the architecture's real widths and depths where lavapipe can still train it in
  seconds to minutes, small inputs; transformers at small configurations (the issue's request).
- "full": the published configuration at its usual input size (for GPUs).

Each entry returns a `ZooModel`: an eval-mode module whose forward takes tensors and returns one
tensor (the wrapper picks the output a user fine-tunes: logits, last hidden state, depth), and
its example inputs by name. Dropout is off and batch norm uses its running statistics (eval
mode), so both engines compute the same function: the zoo checks fine-tuning as a user does it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from torchvision_compat import import_torchvision, usable  # noqa: E402


@dataclass
class ZooModel:
    module: torch.nn.Module
    inputs: dict[str, torch.Tensor]
    source: str  # "torchvision" or "transformers"


class FirstOutput(torch.nn.Module):
    """A model whose forward returns a dict, tuple or ModelOutput, as one that returns its
    `key` (or the first) tensor: the zoo trains on one output."""

    def __init__(self, model: torch.nn.Module, key: str | None = None,
                 names: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.model, self.key, self.names = model, key, names

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        # by keyword where the model's second argument is not its second input (an
        # encoder-decoder's decoder ids come after the attention mask)
        out = self.model(**dict(zip(self.names, args))) if self.names else self.model(*args)
        if isinstance(out, torch.Tensor):
            return out
        if isinstance(out, dict) or hasattr(out, "keys"):
            return out[self.key] if self.key else next(iter(out.values()))
        return out[0]


SIZES = ("tiny", "small", "full")
Builder = Callable[[str], ZooModel]
MODELS: dict[str, Builder] = {}


def zoo(name: str) -> Callable[[Builder], Builder]:
    def register(fn: Builder) -> Builder:
        MODELS[name] = fn
        return fn
    return register


def _image(size: str, tiny: int, small: int, full: int = 224, batch: int = 2) -> dict:
    side = {"tiny": tiny, "small": small, "full": full}[size]
    return {"pixel_values": torch.randn(batch, 3, side, side)}


def _vision(ctor: Callable[..., torch.nn.Module], size: str, tiny: int, small: int,
            num_classes: int = 10, full: int = 224, key: str | None = None,
            narrow: Callable[[], torch.nn.Module] | None = None, **kwargs) -> ZooModel:
    """torchvision's model; at "tiny" size `narrow()`, the same class with fewer and narrower
    blocks (every kind of layer kept), where the published widths would take lavapipe
    minutes a step."""
    if size == "tiny" and narrow is not None:
        model = narrow()
    else:
        model = ctor(weights=None, num_classes=num_classes if size != "full" else 1000,
                     **kwargs)
    return ZooModel(FirstOutput(model, key).eval(), _image(size, tiny, small, full),
                    "torchvision")


def _tv():
    return import_torchvision().models


def _narrow_classifier(model: torch.nn.Module, widths: tuple[int, ...]) -> torch.nn.Module:
    """`model` with its classifier's linear layers replaced by ones of these widths, in
    order (input, hidden..., classes)."""
    linears = [i for i, m in enumerate(model.classifier) if isinstance(m, torch.nn.Linear)]
    for i, n_in, n_out in zip(linears, widths, widths[1:]):
        model.classifier[i] = torch.nn.Linear(n_in, n_out)
    return model


# ---- torchvision -------------------------------------------------------------------------------
@zoo("resnet18")
def resnet18(size: str) -> ZooModel:
    tv = _tv()
    return _vision(tv.resnet18, size, 32, 64, narrow=lambda: tv.resnet.ResNet(
        tv.resnet.BasicBlock, [1, 1, 1, 1], num_classes=10))


@zoo("resnet50")
def resnet50(size: str) -> ZooModel:
    tv = _tv()
    return _vision(tv.resnet50, size, 32, 64, narrow=lambda: tv.resnet.ResNet(
        tv.resnet.Bottleneck, [1, 1, 1, 1], num_classes=10, width_per_group=8))


@zoo("mobilenet_v2")
def mobilenet_v2(size: str) -> ZooModel:
    tv = _tv()
    return _vision(tv.mobilenet_v2, size, 32, 64, narrow=lambda: tv.mobilenet_v2(
        num_classes=10, width_mult=0.25))


@zoo("mobilenet_v3_small")
def mobilenet_v3_small(size: str) -> ZooModel:
    tv = _tv()
    return _vision(tv.mobilenet_v3_small, size, 32, 64, narrow=lambda: tv.mobilenet_v3_small(
        num_classes=10, width_mult=0.25, reduced_tail=True))


@zoo("efficientnet_b0")
def efficientnet_b0(size: str) -> ZooModel:
    tv = _tv()

    def narrow():
        blocks, last = tv.efficientnet._efficientnet_conf("efficientnet_b0", width_mult=0.25,
                                                          depth_mult=0.25)
        return tv.efficientnet.EfficientNet(blocks, 0.2, num_classes=10, last_channel=last)
    return _vision(tv.efficientnet_b0, size, 32, 64, narrow=narrow)


@zoo("convnext_tiny")
def convnext_tiny(size: str) -> ZooModel:
    tv = _tv()
    cn = tv.convnext
    return _vision(tv.convnext_tiny, size, 32, 64, narrow=lambda: cn.ConvNeXt(
        [cn.CNBlockConfig(16, 32, 1), cn.CNBlockConfig(32, None, 1)], num_classes=10))


@zoo("regnet_y_400mf")
def regnet_y_400mf(size: str) -> ZooModel:
    tv = _tv()
    rg = tv.regnet
    return _vision(tv.regnet_y_400mf, size, 32, 64, narrow=lambda: rg.RegNet(
        rg.BlockParams.from_init_params(depth=3, w_0=8, w_a=8.0, w_m=2.0, group_width=8,
                                        se_ratio=0.25), num_classes=10, stem_width=8))


@zoo("shufflenet_v2_x0_5")
def shufflenet_v2_x0_5(size: str) -> ZooModel:
    tv = _tv()
    return _vision(tv.shufflenet_v2_x0_5, size, 32, 64, narrow=lambda: tv.shufflenetv2.ShuffleNetV2(
        [1, 1, 1], [8, 16, 32, 64, 128], num_classes=10))


@zoo("squeezenet1_1")
def squeezenet1_1(size: str) -> ZooModel:
    return _vision(_tv().squeezenet1_1, size, 48, 64)


@zoo("densenet121")
def densenet121(size: str) -> ZooModel:
    tv = _tv()
    return _vision(tv.densenet121, size, 32, 64, narrow=lambda: tv.densenet.DenseNet(
        growth_rate=8, block_config=(2, 2, 2, 2), num_init_features=16, num_classes=10))


@zoo("mnasnet0_5")
def mnasnet0_5(size: str) -> ZooModel:
    tv = _tv()
    return _vision(tv.mnasnet0_5, size, 32, 64, narrow=lambda: tv.mnasnet.MNASNet(
        0.25, num_classes=10))


@zoo("alexnet")
def alexnet(size: str) -> ZooModel:
    tv = _tv()

    # its classifier at 512 wide: 4096 makes a 151 MB weight, past lavapipe's 128 MiB
    # storage-buffer binding
    return _vision(tv.alexnet, size, 64, 96, narrow=lambda: _narrow_classifier(
        tv.alexnet(num_classes=10), (256 * 6 * 6, 512, 512, 10)))


@zoo("googlenet")
def googlenet(size: str) -> ZooModel:
    return _vision(_tv().googlenet, size, 32, 64, aux_logits=False, init_weights=True)


@zoo("vit_small")
def vit_small(size: str) -> ZooModel:
    """A small VisionTransformer (torchvision's class: patch 16 at 224 in full, ViT-S widths)."""
    VisionTransformer = _tv().vision_transformer.VisionTransformer
    image, patch, layers, heads, width, mlp = {
        "tiny": (32, 8, 2, 2, 32, 64), "small": (64, 16, 4, 6, 192, 768),
        "full": (224, 16, 12, 6, 384, 1536)}[size]
    model = VisionTransformer(image, patch, layers, heads, width, mlp, num_classes=10)
    return ZooModel(model.eval(), _image(size, image, image, image), "torchvision")


@zoo("swin_t")
def swin_t(size: str) -> ZooModel:
    tv = _tv()
    return _vision(tv.swin_t, size, 32, 64, narrow=lambda: tv.swin_transformer.SwinTransformer(
        [4, 4], 16, [1, 1], [1, 2], [2, 2], num_classes=10))


@zoo("deeplabv3_mobilenet_v3_large")
def deeplabv3(size: str) -> ZooModel:
    tv = _tv()
    segmentation = tv.segmentation
    if size == "tiny":  # the same heads on a quarter-width, dilated MobileNetV3
        backbone = tv.mobilenet_v3_large(width_mult=0.25, dilated=True, reduced_tail=True)
        model = segmentation.deeplabv3._deeplabv3_mobilenetv3(backbone, 5, False)
    else:
        model = segmentation.deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None,
                                                          num_classes=5, aux_loss=False)
    return ZooModel(FirstOutput(model, "out").eval(), _image(size, 32, 64, 224, batch=1),
                    "torchvision")


@zoo("fcn_resnet50")
def fcn_resnet50(size: str) -> ZooModel:
    tv = _tv()
    segmentation = tv.segmentation
    if size == "tiny":  # FCN's head on a narrow dilated bottleneck ResNet, one block a stage
        backbone = tv.resnet.ResNet(tv.resnet.Bottleneck, [1, 1, 1, 1], num_classes=10,
                                    width_per_group=4,
                                    replace_stride_with_dilation=[False, True, True])
        model = segmentation.fcn.FCN(
            tv._utils.IntermediateLayerGetter(backbone, {"layer4": "out"}),
            segmentation.fcn.FCNHead(2048, 5))
    else:
        model = segmentation.fcn_resnet50(weights=None, weights_backbone=None, num_classes=5,
                                          aux_loss=False)
    return ZooModel(FirstOutput(model, "out").eval(), _image(size, 32, 64, 224, batch=1),
                    "torchvision")


@zoo("vgg11_bn")
def vgg11_bn(size: str) -> ZooModel:
    tv = _tv()

    # its classifier narrowed (4096 wide at 512 x 7 x 7 inputs is a 411 MB weight, past
    # lavapipe's 128 MiB storage-buffer binding): at "tiny" 128 wide with an eighth of the
    # convolutions' widths (its adaptive pool still makes 7 x 7 of a 1 x 1 map), at "small"
    # 512 wide
    def narrow():
        widths = [c if c == "M" else c // 8 for c in tv.vgg.cfgs["A"]]
        model = tv.vgg.VGG(tv.vgg.make_layers(widths, batch_norm=True), num_classes=10)
        return _narrow_classifier(model, (64 * 7 * 7, 128, 128, 10))

    if size == "small":
        return ZooModel(FirstOutput(_narrow_classifier(
            tv.vgg11_bn(weights=None, num_classes=10), (512 * 7 * 7, 512, 512, 10))).eval(),
            _image(size, 32, 64), "torchvision")
    return _vision(tv.vgg11_bn, size, 32, 64, narrow=narrow)


@zoo("resnext50_32x4d")
def resnext50_32x4d(size: str) -> ZooModel:
    tv = _tv()
    return _vision(tv.resnext50_32x4d, size, 32, 64, narrow=lambda: tv.resnet.ResNet(
        tv.resnet.Bottleneck, [1, 1, 1, 1], num_classes=10, groups=4, width_per_group=4))


@zoo("efficientnet_v2_s")
def efficientnet_v2_s(size: str) -> ZooModel:
    tv = _tv()
    ef = tv.efficientnet

    def narrow():  # fused and depthwise MBConv stages, narrow, one block each
        from functools import partial
        blocks = [ef.FusedMBConvConfig(1, 3, 1, 8, 8, 1), ef.FusedMBConvConfig(4, 3, 2, 8, 16, 1),
                  ef.MBConvConfig(4, 3, 2, 16, 24, 1)]
        return ef.EfficientNet(blocks, 0.2, num_classes=10, last_channel=64,
                               norm_layer=partial(torch.nn.BatchNorm2d, eps=1e-3))
    return _vision(tv.efficientnet_v2_s, size, 32, 64, narrow=narrow)


@zoo("swin_v2_t")
def swin_v2_t(size: str) -> ZooModel:
    tv = _tv()
    sw = tv.swin_transformer
    return _vision(tv.swin_v2_t, size, 32, 64, narrow=lambda: sw.SwinTransformer(
        [4, 4], 16, [1, 1], [1, 2], [2, 2], num_classes=10, block=sw.SwinTransformerBlockV2,
        downsample_layer=sw.PatchMergingV2))


@zoo("maxvit_t")
def maxvit_t(size: str) -> ZooModel:
    """MaxViT: MBConv, then block and grid attention with relative position bias per stage."""
    tv = _tv()
    side = {"tiny": 32, "small": 64, "full": 224}[size]
    if size == "full":
        model = tv.maxvit_t(weights=None)
    else:
        stages = ([16, 32], [1, 1], 8) if size == "tiny" else ([64, 128, 256, 512], [2, 2, 5, 2],
                                                               32)
        model = tv.maxvit.MaxVit((side, side), stages[0][0], 2, stages[0], stages[1], stages[2],
                                 0.0, num_classes=10)
    return ZooModel(FirstOutput(model).eval(), _image(size, side, side, side), "torchvision")


def _video(size: str) -> dict:
    """A clip (N, C, T, H, W): 16 frames of 112 x 112 in full, as the video models train."""
    frames, side = {"tiny": (4, 16), "small": (8, 56), "full": (16, 112)}[size]
    return {"video": torch.randn(1, 3, frames, side, side)}


@zoo("r2plus1d_18")
def r2plus1d_18(size: str) -> ZooModel:
    """R(2+1)D: 3-D convolutions split into a spatial (1 x 3 x 3) and a temporal (3 x 1 x 1)
    one, 3-D batch norm, adaptive 3-D pooling."""
    tv = _tv()
    vr = tv.video.resnet
    if size == "full":
        model = tv.video.r2plus1d_18(weights=None, num_classes=400)
    else:  # at "tiny", the published widths only on the meta device, replaced below
        with torch.device("meta" if size == "tiny" else "cpu"):
            model = vr.VideoResNet(vr.BasicBlock, [vr.Conv2Plus1D] * 4, [1, 1, 1, 1],
                                   vr.R2Plus1dStem, num_classes=10)
    if size == "tiny":  # its stem and stages at an eighth of the widths (by its own builder)
        conv = torch.nn.Conv3d
        model.stem = torch.nn.Sequential(
            conv(3, 6, (1, 7, 7), (1, 2, 2), (0, 3, 3), bias=False), torch.nn.BatchNorm3d(6),
            torch.nn.ReLU(), conv(6, 8, (3, 1, 1), 1, (1, 0, 0), bias=False),
            torch.nn.BatchNorm3d(8), torch.nn.ReLU())
        model.inplanes = 8
        for i, (planes, stride) in enumerate([(8, 1), (16, 2), (24, 2), (32, 2)], 1):
            setattr(model, f"layer{i}", model._make_layer(vr.BasicBlock, vr.Conv2Plus1D,
                                                          planes, 1, stride))
        model.fc = torch.nn.Linear(32, 10)
    return ZooModel(FirstOutput(model).eval(), _video(size), "torchvision")


@zoo("swin3d_t")
def swin3d_t(size: str) -> ZooModel:
    """Video Swin: shifted 3-D windows, 3-D patch merging."""
    tv = _tv()
    if size == "full":
        model = tv.video.swin3d_t(weights=None)
    else:
        model = tv.video.SwinTransformer3d([2, 4, 4], 16 if size == "tiny" else 48,
                                           [1, 1] if size == "tiny" else [2, 2],
                                           [1, 2] if size == "tiny" else [3, 6], [2, 2, 2],
                                           stochastic_depth_prob=0.0, num_classes=10)
    inputs = _video(size)
    if size != "full":  # 4 frames of 32 x 32: two windows each way after the patch embedding
        inputs = {"video": torch.randn(1, 3, 4, 32, 32)}
    return ZooModel(FirstOutput(model).eval(), inputs, "torchvision")


# ---- transformers ------------------------------------------------------------------------------
def _hf(model: torch.nn.Module, inputs: dict, key: str | None = None) -> ZooModel:
    return ZooModel(FirstOutput(model, key).eval(), inputs, "transformers")


def _text(size: str, vocab: int, batch: int = 2) -> dict:
    seq = {"tiny": 8, "small": 32, "full": 128}[size]
    return {"input_ids": torch.randint(0, vocab, (batch, seq))}


def _widths(size: str, full: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """(hidden, layers, heads, intermediate) per size; `full` is the published configuration."""
    return {"tiny": (32, 2, 2, 64), "small": (128, 2, 4, 256), "full": full}[size]


def _no_dropout() -> dict:
    return {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def _encoder_classifier(config_cls, model_cls, size: str) -> ZooModel:
    """BERT's layout (BERT, RoBERTa): base widths in full, three labels."""
    h, n, heads, ff = _widths(size, (768, 12, 12, 3072))
    cfg = config_cls(vocab_size=1000, hidden_size=h, num_hidden_layers=n,
                     num_attention_heads=heads, intermediate_size=ff, num_labels=3,
                     attn_implementation="eager", **_no_dropout())
    return _hf(model_cls(cfg), _text(size, 1000), "logits")


@zoo("bert")
def bert(size: str) -> ZooModel:
    from transformers import BertConfig, BertForSequenceClassification
    return _encoder_classifier(BertConfig, BertForSequenceClassification, size)


@zoo("distilbert")
def distilbert(size: str) -> ZooModel:
    from transformers import DistilBertConfig, DistilBertForSequenceClassification
    h, n, heads, ff = _widths(size, (768, 6, 12, 3072))
    cfg = DistilBertConfig(vocab_size=1000, dim=h, n_layers=n, n_heads=heads, hidden_dim=ff,
                           num_labels=3, dropout=0.0, attention_dropout=0.0,
                           seq_classif_dropout=0.0, attn_implementation="eager")
    return _hf(DistilBertForSequenceClassification(cfg), _text(size, 1000), "logits")


@zoo("roberta")
def roberta(size: str) -> ZooModel:
    from transformers import RobertaConfig, RobertaForSequenceClassification
    return _encoder_classifier(RobertaConfig, RobertaForSequenceClassification, size)


@zoo("gpt2")
def gpt2(size: str) -> ZooModel:
    from transformers import GPT2Config, GPT2LMHeadModel
    h, n, heads, _ = _widths(size, (768, 12, 12, 3072))
    cfg = GPT2Config(vocab_size=1000, n_embd=h, n_layer=n, n_head=heads, n_positions=256,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     attn_implementation="eager")
    return _hf(GPT2LMHeadModel(cfg), _text(size, 1000), "logits")


def _causal_lm(config_cls, model_cls, size: str, full: tuple, **extra) -> ZooModel:
    h, n, heads, ff = _widths(size, full[:4])
    cfg = config_cls(vocab_size=1000, hidden_size=h, num_hidden_layers=n,
                     num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                     intermediate_size=ff, max_position_embeddings=256, use_cache=False,
                     attn_implementation="sdpa", **extra)
    return _hf(model_cls(cfg), _text(size, 1000), "logits")


@zoo("llama")
def llama(size: str) -> ZooModel:
    from transformers import LlamaConfig, LlamaForCausalLM
    return _causal_lm(LlamaConfig, LlamaForCausalLM, size, (576, 30, 9, 1536),
                      tie_word_embeddings=True, rope_theta=1e5)


@zoo("qwen2")
def qwen2(size: str) -> ZooModel:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return _causal_lm(Qwen2Config, Qwen2ForCausalLM, size, (896, 24, 14, 4864))


@zoo("t5_encoder")
def t5_encoder(size: str) -> ZooModel:
    from transformers import T5Config, T5EncoderModel
    h, n, heads, ff = _widths(size, (512, 6, 8, 2048))
    cfg = T5Config(vocab_size=1000, d_model=h, d_kv=h // heads, d_ff=ff, num_layers=n,
                   num_heads=heads, dropout_rate=0.0, use_cache=False)
    return _hf(T5EncoderModel(cfg), _text(size, 1000), "last_hidden_state")


def _vit_widths(size: str, full: tuple[int, int, int, int]) -> dict:
    h, n, heads, ff = _widths(size, full)
    return {"hidden_size": h, "num_hidden_layers": n, "num_attention_heads": heads,
            "intermediate_size": ff}


def _patch_image(size: str, patch: int, tiny: int = 2, small: int = 4, full: int = 224) -> dict:
    side = {"tiny": patch * tiny, "small": patch * small, "full": full}[size]
    return {"pixel_values": torch.randn(1, 3, side, side)}


@zoo("vit")
def vit(size: str) -> ZooModel:
    from transformers import ViTConfig, ViTForImageClassification
    patch = 16 if size == "full" else 8
    image = _patch_image(size, patch)
    cfg = ViTConfig(image_size=image["pixel_values"].shape[-1], patch_size=patch, num_labels=5,
                    attn_implementation="eager", **_no_dropout(),
                    **_vit_widths(size, (768, 12, 12, 3072)))
    return _hf(ViTForImageClassification(cfg), image, "logits")


@zoo("dinov2")
def dinov2(size: str) -> ZooModel:
    from transformers import Dinov2Config, Dinov2Model
    patch = 14 if size == "full" else 7
    image = _patch_image(size, patch)
    cfg = Dinov2Config(image_size=image["pixel_values"].shape[-1], patch_size=patch,
                       attn_implementation="eager", **_no_dropout(),
                       **_vit_widths(size, (384, 12, 6, 1536)))
    return _hf(Dinov2Model(cfg), image, "last_hidden_state")


@zoo("clip_vision")
def clip_vision(size: str) -> ZooModel:
    from transformers import CLIPVisionConfig, CLIPVisionModel
    patch = 32 if size == "full" else 8
    image = _patch_image(size, patch)
    cfg = CLIPVisionConfig(image_size=image["pixel_values"].shape[-1], patch_size=patch,
                           attention_dropout=0.0, attn_implementation="eager",
                           **_vit_widths(size, (768, 12, 12, 3072)))
    return _hf(CLIPVisionModel(cfg), image, "pooler_output")


@zoo("whisper_encoder")
def whisper_encoder(size: str) -> ZooModel:
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder
    h, n, heads, ff = _widths(size, (384, 4, 6, 1536))
    frames = {"tiny": 32, "small": 200, "full": 3000}[size]
    cfg = WhisperConfig(d_model=h, encoder_layers=n, encoder_attention_heads=heads,
                        encoder_ffn_dim=ff, num_mel_bins=80, max_source_positions=frames // 2,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                        attn_implementation="eager")
    return _hf(WhisperEncoder(cfg), {"input_features": torch.randn(1, 80, frames)},
               "last_hidden_state")


@zoo("segformer")
def segformer(size: str) -> ZooModel:
    from transformers import SegformerConfig, SegformerForSemanticSegmentation
    widths = {"tiny": [8, 16, 24, 32], "small": [32, 64, 160, 256],
              "full": [32, 64, 160, 256]}[size]
    cfg = SegformerConfig(hidden_sizes=widths, num_labels=4, decoder_hidden_size=widths[-1],
                          depths=[1, 1, 1, 1] if size == "tiny" else [2, 2, 2, 2],
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                          classifier_dropout_prob=0.0, drop_path_rate=0.0)
    return _hf(SegformerForSemanticSegmentation(cfg),
               _image(size, 32, 64, 512, batch=1), "logits")


@zoo("dpt_dinov2")
def dpt_dinov2(size: str) -> ZooModel:
    """DPT depth estimation on a DINOv2 backbone (Depth Anything's layout)."""
    from transformers import Dinov2Config, DPTConfig, DPTForDepthEstimation
    patch = 14 if size == "full" else 7
    image = _patch_image(size, patch)
    h, n, heads, ff = _widths(size, (384, 12, 6, 1536))
    backbone = Dinov2Config(image_size=image["pixel_values"].shape[-1], patch_size=patch,
                            hidden_size=h, num_hidden_layers=max(n, 4), num_attention_heads=heads,
                            intermediate_size=ff, out_features=["stage1", "stage2", "stage3",
                                                                "stage4"],
                            reshape_hidden_states=False, attn_implementation="eager")
    neck = [h // 8, h // 4, h // 2, h] if size != "full" else [48, 96, 192, 384]
    cfg = DPTConfig(backbone_config=backbone, is_hybrid=False, neck_hidden_sizes=neck,
                    reassemble_factors=[4, 2, 1, 0.5], fusion_hidden_size=max(16, h // 2),
                    head_in_index=-1, use_bias_in_fusion_residual=False)
    model = DPTForDepthEstimation(cfg)
    # the head ends in a ReLU, which a random model's negative depths leave all zero (and every
    # check vacuous): the zoo compares the depths before it
    model.head.head[-1] = torch.nn.Identity()
    return _hf(model, image, "predicted_depth")


@zoo("convnext_hf")
def convnext_hf(size: str) -> ZooModel:
    from transformers import ConvNextConfig, ConvNextForImageClassification
    widths, depths = {"tiny": ([8, 16, 24, 32], [1, 1, 1, 1]),
                      "small": ([32, 64, 128, 256], [1, 1, 3, 1]),
                      "full": ([96, 192, 384, 768], [3, 3, 9, 3])}[size]
    cfg = ConvNextConfig(hidden_sizes=widths, depths=depths, num_labels=5, drop_path_rate=0.0)
    return _hf(ConvNextForImageClassification(cfg), _image(size, 32, 64, batch=1), "logits")


@zoo("albert")
def albert(size: str) -> ZooModel:
    """ALBERT: factorized embeddings and one layer's weights shared by every layer."""
    from transformers import AlbertConfig, AlbertForSequenceClassification
    h, n, heads, ff = _widths(size, (768, 12, 12, 3072))
    cfg = AlbertConfig(vocab_size=1000, embedding_size=h // 2, hidden_size=h,
                       num_hidden_layers=n, num_attention_heads=heads, intermediate_size=ff,
                       num_labels=3, classifier_dropout_prob=0.0, attn_implementation="eager",
                       **_no_dropout())
    return _hf(AlbertForSequenceClassification(cfg), _text(size, 1000), "logits")


@zoo("deberta_v2")
def deberta_v2(size: str) -> ZooModel:
    """DeBERTa-v2: disentangled attention, relative positions gathered per query and key."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification
    h, n, heads, ff = _widths(size, (768, 12, 12, 3072))
    cfg = DebertaV2Config(vocab_size=1000, hidden_size=h, num_hidden_layers=n,
                          num_attention_heads=heads, intermediate_size=ff, num_labels=3,
                          relative_attention=True, position_buckets=16 if size != "full" else 256,
                          max_relative_positions=-1, pos_att_type=["p2c", "c2p"],
                          norm_rel_ebd="layer_norm", share_att_key=True, pooler_dropout=0.0,
                          **_no_dropout())
    return _hf(DebertaV2ForSequenceClassification(cfg), _text(size, 1000), "logits")


@zoo("squeezebert")
def squeezebert(size: str) -> ZooModel:
    """SqueezeBERT: BERT with grouped 1-d convolutions for its projections."""
    from transformers import SqueezeBertConfig, SqueezeBertForSequenceClassification
    h, n, heads, ff = _widths(size, (768, 12, 12, 3072))
    cfg = SqueezeBertConfig(vocab_size=1000, hidden_size=h, embedding_size=h,
                            num_hidden_layers=n, num_attention_heads=heads, intermediate_size=ff,
                            num_labels=3, **_no_dropout())
    return _hf(SqueezeBertForSequenceClassification(cfg), _text(size, 1000), "logits")


@zoo("bart")
def bart(size: str) -> ZooModel:
    """BART whole: encoder and decoder, two inputs, cross-attention, tied embeddings."""
    from transformers import BartConfig, BartForConditionalGeneration
    h, n, heads, ff = _widths(size, (768, 6, 12, 3072))
    cfg = BartConfig(vocab_size=1000, d_model=h, encoder_layers=n, decoder_layers=n,
                     encoder_attention_heads=heads, decoder_attention_heads=heads,
                     encoder_ffn_dim=ff, decoder_ffn_dim=ff, max_position_embeddings=256,
                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False,
                     attn_implementation="eager")
    inputs = _text(size, 1000)
    inputs["decoder_input_ids"] = torch.randint(0, 1000, (2, inputs["input_ids"].shape[1] // 2))
    return ZooModel(FirstOutput(BartForConditionalGeneration(cfg), "logits",
                                names=("input_ids", "decoder_input_ids")).eval(), inputs,
                    "transformers")


@zoo("bloom")
def bloom(size: str) -> ZooModel:
    """BLOOM: ALiBi position biases (made from the attention mask), no position embeddings."""
    from transformers import BloomConfig, BloomForCausalLM
    h, n, heads, _ = _widths(size, (1024, 24, 16, 4096))
    cfg = BloomConfig(vocab_size=1000, hidden_size=h, n_layer=n, n_head=heads,
                      hidden_dropout=0.0, attention_dropout=0.0, use_cache=False)
    return _hf(BloomForCausalLM(cfg), _text(size, 1000), "logits")


@zoo("phi")
def phi(size: str) -> ZooModel:
    """Phi: partial rotary embeddings, attention and MLP in parallel off one layer norm."""
    from transformers import PhiConfig, PhiForCausalLM
    return _causal_lm(PhiConfig, PhiForCausalLM, size, (2048, 24, 32, 8192),
                      partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0,
                      attention_dropout=0.0)


@zoo("wav2vec2")
def wav2vec2(size: str) -> ZooModel:
    """wav2vec 2.0: a 1-d convolutional feature extractor (group norm), a grouped, weight-
    normalized positional convolution, a transformer encoder."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model
    h, n, heads, ff = _widths(size, (768, 12, 12, 3072))
    conv = {"tiny": ((16, 16), (10, 3), (5, 2)), "small": ((128,) * 3, (10, 3, 3), (5, 2, 2)),
            "full": ((512,) * 7, (10, 3, 3, 3, 3, 2, 2), (5, 2, 2, 2, 2, 2, 2))}[size]
    samples = {"tiny": 400, "small": 4000, "full": 16000}[size]
    cfg = Wav2Vec2Config(hidden_size=h, num_hidden_layers=n, num_attention_heads=heads,
                         intermediate_size=ff, conv_dim=conv[0], conv_kernel=conv[1],
                         conv_stride=conv[2], num_conv_pos_embeddings=16 if size != "full"
                         else 128, num_conv_pos_embedding_groups=4 if size != "full" else 16,
                         feat_extract_norm="group", hidden_dropout=0.0, attention_dropout=0.0,
                         activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0,
                         attn_implementation="eager")
    return _hf(Wav2Vec2Model(cfg), {"input_values": torch.randn(1, samples)},
               "last_hidden_state")


@zoo("mobilevit")
def mobilevit(size: str) -> ZooModel:
    """MobileViT: inverted residuals, then transformers over unfolded 2 x 2 patches folded back."""
    from transformers import MobileViTConfig, MobileViTForImageClassification
    side = {"tiny": 64, "small": 128, "full": 256}[size]
    widths = {"tiny": ([16, 24, 32], [8, 8, 16, 16, 24, 24, 32]),
              "small": ([64, 80, 96], [16, 16, 24, 48, 64, 80, 320]),
              "full": ([144, 192, 240], [16, 32, 64, 96, 128, 160, 640])}[size]
    cfg = MobileViTConfig(image_size=side, hidden_sizes=widths[0], neck_hidden_sizes=widths[1],
                          num_attention_heads=2 if size == "tiny" else 4, num_labels=5,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                          classifier_dropout_prob=0.0, attn_implementation="eager")
    return _hf(MobileViTForImageClassification(cfg), _image(size, side, side, side, batch=1),
               "logits")


def _gathered_every_call(module: torch.nn.Module) -> torch.nn.Module:
    """LeViT's attention gathers its bias table anew in every forward, as it does in training.
    In eval mode it caches the gathered table at its first forward: filled by one without
    gradients (the zoo's first), the cache is a constant that leaves the table untrained on
    both engines in silence, and filled with gradients it is a non-leaf tensor that
    `copy.deepcopy` refuses."""
    for layer in module.modules():
        if hasattr(layer, "attention_bias_cache"):
            cls = type(layer)
            layer.__class__ = type(cls.__name__, (cls,), {
                "get_attention_biases":
                    lambda self, device: self.attention_biases[:, self.attention_bias_idxs]})
    return module


@zoo("levit")
def levit(size: str) -> ZooModel:
    """LeViT: a convolutional stem, attention with a learned bias gathered per query-key
    offset, queries subsampled between stages, batch norm after every linear, hardswish."""
    from transformers import LevitConfig, LevitForImageClassification
    side = {"tiny": 64, "small": 128, "full": 224}[size]
    widths, heads, depths = {"tiny": ([16, 32, 48], [1, 2, 3], [1, 1, 1]),
                             "small": ([128, 256, 384], [4, 6, 8], [2, 3, 4]),  # LeViT-128S
                             "full": ([128, 256, 384], [4, 8, 12], [4, 4, 4])}[size]  # LeViT-128
    key_dim = [8] * 3 if size == "tiny" else [16] * 3
    cfg = LevitConfig(image_size=side, hidden_sizes=widths, num_attention_heads=heads,
                      depths=depths, key_dim=key_dim, patch_size=16, num_labels=5,
                      drop_path_rate=0)  # the config types it int
    return _hf(_gathered_every_call(LevitForImageClassification(cfg)),
               _image(size, side, side, side), "logits")


@zoo("beit")
def beit(size: str) -> ZooModel:
    """BEiT: a relative position bias per layer, layer scale, mean pooling."""
    from transformers import BeitConfig, BeitForImageClassification
    patch = 16 if size == "full" else 8
    image = _patch_image(size, patch)
    cfg = BeitConfig(image_size=image["pixel_values"].shape[-1], patch_size=patch, num_labels=5,
                     use_relative_position_bias=True, use_mean_pooling=True,
                     layer_scale_init_value=0.1, drop_path_rate=0.0, attn_implementation="eager",
                     **_no_dropout(), **_vit_widths(size, (768, 12, 12, 3072)))
    return _hf(BeitForImageClassification(cfg), image, "logits")


@zoo("poolformer")
def poolformer(size: str) -> ZooModel:
    """PoolFormer: average pooling (padding not counted) as the token mixer, group norm."""
    from transformers import PoolFormerConfig, PoolFormerForImageClassification
    widths, depths = {"tiny": ([8, 16, 24, 32], [1, 1, 1, 1]),
                      "small": ([32, 64, 128, 256], [2, 2, 4, 2]),
                      "full": ([64, 128, 320, 512], [2, 2, 6, 2])}[size]
    cfg = PoolFormerConfig(hidden_sizes=widths, depths=depths, num_labels=5, drop_path_rate=0.0,
                           hidden_dropout_prob=0.0)
    return _hf(PoolFormerForImageClassification(cfg), _image(size, 32, 64, batch=1), "logits")


@zoo("gptj")
def gptj(size: str) -> ZooModel:
    """GPT-J: rotary embeddings on part of each head, interleaved pairs (rotate_every_two),
    attention and MLP in parallel. Its "full" is the published 6B (24 GB of f32 weights)."""
    from transformers import GPTJConfig, GPTJForCausalLM
    h, n, heads, _ = _widths(size, (4096, 28, 16, 16384))
    cfg = GPTJConfig(vocab_size=1000, n_embd=h, n_layer=n, n_head=heads,
                     rotary_dim=(h // heads) // 2, n_positions=256, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0,
                     eos_token_id=0, attn_implementation="eager")
    return _hf(GPTJForCausalLM(cfg), _text(size, 1000), "logits")


@zoo("opt")
def opt(size: str) -> ZooModel:
    """OPT: learned positions offset by two, read at the mask's cumulative sum."""
    from transformers import OPTConfig, OPTForCausalLM
    h, n, heads, ff = _widths(size, (768, 12, 12, 3072))
    cfg = OPTConfig(vocab_size=1000, hidden_size=h, num_hidden_layers=n,
                    num_attention_heads=heads, ffn_dim=ff, word_embed_proj_dim=h,
                    max_position_embeddings=256, dropout=0.0, attention_dropout=0.0,
                    use_cache=False, attn_implementation="eager")
    return _hf(OPTForCausalLM(cfg), _text(size, 1000), "logits")


@zoo("falcon")
def falcon(size: str) -> ZooModel:
    """Falcon: multi-query attention (one key/value head), attention and MLP in parallel. Its
    "full" is the published 7B (28 GB of f32 weights)."""
    from transformers import FalconConfig, FalconForCausalLM
    h, n, heads, _ = _widths(size, (4544, 32, 71, 0))
    cfg = FalconConfig(vocab_size=1000, hidden_size=h, num_hidden_layers=n,
                       num_attention_heads=heads, multi_query=True, parallel_attn=True,
                       alibi=False, bias=False, hidden_dropout=0.0, attention_dropout=0.0,
                       use_cache=False)
    return _hf(FalconForCausalLM(cfg), _text(size, 1000), "logits")


@zoo("fnet")
def fnet(size: str) -> ZooModel:
    """FNet: a 2-D Fourier transform (its real part) in place of attention."""
    from transformers import FNetConfig, FNetForSequenceClassification
    h, n, _, ff = _widths(size, (768, 12, 12, 3072))
    cfg = FNetConfig(vocab_size=1000, hidden_size=h, num_hidden_layers=n, intermediate_size=ff,
                     num_labels=3, hidden_dropout_prob=0.0, use_tpu_fourier_optimizations=False)
    return _hf(FNetForSequenceClassification(cfg), _text(size, 1000), "logits")


@zoo("funnel")
def funnel(size: str) -> ZooModel:
    """Funnel Transformer: the sequence pooled between blocks, relative attention."""
    from transformers import FunnelConfig, FunnelForSequenceClassification
    h, _, heads, ff = _widths(size, (768, 12, 12, 3072))
    blocks = [1, 1] if size == "tiny" else [2, 2] if size == "small" else [4, 4, 4]
    cfg = FunnelConfig(vocab_size=1000, block_sizes=blocks, d_model=h, n_head=heads,
                       d_head=h // heads, d_inner=ff, num_decoder_layers=1 if size == "tiny"
                       else 2, num_labels=3, hidden_dropout=0.0, attention_dropout=0.0,
                       activation_dropout=0.0)
    return _hf(FunnelForSequenceClassification(cfg), _text(size, 1000), "logits")


@zoo("convbert")
def convbert(size: str) -> ZooModel:
    """ConvBERT: half the heads a span-based dynamic convolution (unfold of a separable 1-d
    convolution's output)."""
    from transformers import ConvBertConfig, ConvBertForSequenceClassification
    h, n, heads, ff = _widths(size, (768, 12, 12, 3072))
    cfg = ConvBertConfig(vocab_size=1000, hidden_size=h, embedding_size=h, num_hidden_layers=n,
                         num_attention_heads=heads, intermediate_size=ff, num_labels=3,
                         conv_kernel_size=3 if size == "tiny" else 9, head_ratio=2,
                         **_no_dropout())
    return _hf(ConvBertForSequenceClassification(cfg), _text(size, 1000), "logits")


def build(name: str, size: str, seed: int = 0) -> ZooModel:
    """The named model at `size` with weights and inputs drawn from `seed`."""
    if name not in MODELS:
        raise KeyError(f"no zoo model {name!r}; the zoo has {sorted(MODELS)}")
    if size not in SIZES:
        raise ValueError(f"size {size!r}: one of {SIZES}")
    usable()  # transformers imports torchvision where installed (see torchvision_compat)
    torch.manual_seed(seed)
    with torch.no_grad():
        model = MODELS[name](size)
        # Fresh models start with equal tensors (every bias zero, every norm's weight one), and
        # torch.onnx's exporter merges initializers of equal values into one, which would tie
        # them in the file. A trained model's are all different: so are these.
        for p in model.module.parameters():
            p.add_(torch.randn_like(p), alpha=0.02)
    return model
