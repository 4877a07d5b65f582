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

    def __init__(self, model: torch.nn.Module, key: str | None = None) -> None:
        super().__init__()
        self.model, self.key = model, key

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = self.model(*args)
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

    def narrow():  # its classifier at 512 wide: 4096 makes a 151 MB weight, past lavapipe's
        model = tv.alexnet(num_classes=10)  # 128 MiB storage-buffer binding
        model.classifier[1] = torch.nn.Linear(256 * 6 * 6, 512)
        model.classifier[4] = torch.nn.Linear(512, 512)
        model.classifier[6] = torch.nn.Linear(512, 10)
        return model
    return _vision(tv.alexnet, size, 64, 96, narrow=narrow)


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
