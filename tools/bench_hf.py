"""What a PyTorch user runs for three of tools/bench.py's workloads, beside the plain references of
tests/torch_reference.py: Hugging Face's LlamaForCausalLM with SDPA attention (SmolLM2),
torchvision's ResNet (ResNet-50) and Hugging Face's WhisperForAudioClassification with SDPA
(Whisper encoder), built from the workload's config.

Each twin is a subclass of the library's class whose forward takes the bench's inputs by name
and returns (outputs, loss) as the reference does, with the library's own modules doing the
work; its parameter names are the reference's (and vkml's), so the bench's weights file loads
by name and the gates compare gradients name by name.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from torchvision_compat import import_torchvision, usable  # noqa: E402

WORKLOADS = ("smollm2", "resnet", "whisper_encoder")


def twin(workload: str, cfg: Any) -> torch.nn.Module:
    """The library model of `workload` at `cfg` (random weights: load the bench's file)."""
    if workload not in WORKLOADS:
        raise KeyError(f"no library twin for {workload!r}; there are {WORKLOADS}")
    usable()  # transformers imports torchvision where installed (see torchvision_compat)
    return {"smollm2": _llama, "resnet": _resnet, "whisper_encoder": _whisper}[workload](cfg)


def llama_config(cfg: Any) -> Any:
    """Hugging Face's LlamaConfig of a vkml.models.smollm2 config (SDPA attention, no cache)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size,
                       num_hidden_layers=cfg.num_hidden_layers,
                       num_attention_heads=cfg.num_attention_heads,
                       num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                       rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                       tie_word_embeddings=cfg.tie_word_embeddings, use_cache=False,
                       max_position_embeddings=max(256, cfg.seq), attn_implementation="sdpa")


def _llama(cfg: Any) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    class Llama(LlamaForCausalLM):
        def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> Any:  # type: ignore[override]
            logits = super().forward(input_ids=ids.long()).logits.reshape(-1, cfg.vocab_size)
            return {"logits": logits}, F.cross_entropy(logits, targets.long())

    return Llama(llama_config(cfg))


def _resnet(cfg: Any) -> torch.nn.Module:
    resnet = import_torchvision().models.resnet
    block = resnet.Bottleneck if cfg.block == "bottleneck" else resnet.BasicBlock

    class ResNet(resnet.ResNet):
        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Any:  # type: ignore[override]
            logits = super().forward(x)
            return {"logits": logits}, F.cross_entropy(logits, labels.long())

    model = ResNet(block, list(cfg.layers), num_classes=cfg.num_classes)
    if (cfg.stem_width, tuple(cfg.widths), cfg.in_channels) != (64, (64, 128, 256, 512), 3):
        # torchvision fixes the stem at 64 channels and the stages at 64..512: other widths
        # (the tiny config) through its own _make_layer, as its constructor builds the stages
        model.inplanes = cfg.stem_width
        model.conv1 = torch.nn.Conv2d(cfg.in_channels, cfg.stem_width, 7, 2, 3, bias=False)
        model.bn1 = torch.nn.BatchNorm2d(cfg.stem_width)
        for stage, (n, width) in enumerate(zip(cfg.layers, cfg.widths), start=1):
            setattr(model, f"layer{stage}",
                    model._make_layer(block, width, n, stride=1 if stage == 1 else 2))
        model.fc = torch.nn.Linear(cfg.widths[-1] * block.expansion, cfg.num_classes)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.eps = cfg.bn_eps
    return model


def _whisper(cfg: Any) -> torch.nn.Module:
    from transformers import WhisperConfig, WhisperForAudioClassification

    class Whisper(WhisperForAudioClassification):
        def forward(self, input_features: torch.Tensor,  # type: ignore[override]
                    labels: torch.Tensor) -> Any:
            # WhisperForAudioClassification's head (projector, mean over time, classifier), with
            # the encoder's last hidden state kept: the gates compare it too
            hidden = self.encoder(input_features).last_hidden_state
            logits = self.classifier(self.projector(hidden).mean(dim=1))
            return ({"last_hidden_state": hidden, "logits": logits},
                    F.cross_entropy(logits, labels.long()))

    hf = WhisperConfig(num_mel_bins=cfg.num_mel_bins, d_model=cfg.d_model,
                       encoder_layers=cfg.encoder_layers,
                       encoder_attention_heads=cfg.encoder_attention_heads,
                       encoder_ffn_dim=cfg.encoder_ffn_dim, decoder_layers=1,
                       decoder_attention_heads=cfg.encoder_attention_heads,
                       decoder_ffn_dim=cfg.encoder_ffn_dim,
                       max_source_positions=cfg.max_source_positions,
                       classifier_proj_size=cfg.classifier_proj_size, num_labels=cfg.num_labels,
                       dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                       encoder_layerdrop=0.0, use_weighted_layer_sum=False,
                       attn_implementation="sdpa")
    return Whisper(hf)
