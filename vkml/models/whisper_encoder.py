"""The Whisper encoder (Hugging Face `WhisperEncoder`), with the audio-classification head of
`WhisperForAudioClassification` (a linear projector, mean pooling over time, a linear
classifier) and cross-entropy as the training loss.

Encoder: log-mel input (B, mels, 2 x positions) -> Conv1d(k3, pad 1) + GELU -> Conv1d(k3, stride 2,
pad 1) + GELU -> (B, positions, d) + sinusoidal positions -> pre-LN layers (LayerNorm,
self-attention whose k_proj has no bias, residual; LayerNorm, fc1-GELU-fc2, residual) -> LayerNorm.

Parameter names are Hugging Face's under `prefix` (default "encoder.", as in
WhisperForAudioClassification; "model.encoder." for WhisperForConditionalGeneration
checkpoints): `conv1.*`, `conv2.*`, `layers.{i}.self_attn.{q,k,v,out}_proj.*`,
`layers.{i}.self_attn_layer_norm.*`, `layers.{i}.fc1.*`, `layers.{i}.fc2.*`,
`layers.{i}.final_layer_norm.*`, `layer_norm.*`, `embed_positions.weight` (the position table:
a frozen parameter, `trainable=False`, as Hugging Face never trains it either; its initial
value is Whisper's sinusoids and a checkpoint's own table replaces it); the head's
`projector.*` and `classifier.*`. A WhisperForAudioClassification file loads with strict=True;
a WhisperForConditionalGeneration one ("model.encoder." prefix) needs strict=False for its
decoder. A classifier file with `layer_weights` (use_weighted_layer_sum=True: a learned mix of
every layer's hidden states, which this model does not implement) is refused by name.

The default config is whisper-tiny's encoder (d_model 384, 4 layers, 6 heads, FFN 1536, 80 mels,
1500 positions, input 1 x 80 x 3000) with a 256-wide projector and 10 classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from vkml.graph import Graph, Tensor
from vkml.models.common import Built, heads, merge_heads
from vkml.nn import linear


@dataclass(frozen=True)
class WhisperEncoderConfig:
    num_mel_bins: int = 80
    d_model: int = 384
    encoder_layers: int = 4
    encoder_attention_heads: int = 6
    encoder_ffn_dim: int = 1536
    max_source_positions: int = 1500
    classifier_proj_size: int = 256
    num_labels: int = 10
    layer_norm_eps: float = 1e-5
    prefix: str = "encoder."
    batch: int = 1
    fused_attention: bool = False


def tiny() -> WhisperEncoderConfig:
    return replace(WhisperEncoderConfig(), num_mel_bins=8, d_model=32, encoder_layers=2,
                   encoder_attention_heads=2, encoder_ffn_dim=64, max_source_positions=16,
                   classifier_proj_size=16, num_labels=5, batch=2)


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> np.ndarray:
    """Whisper's position table (length, channels): sines then cosines."""
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv = np.exp(-increment * np.arange(channels // 2, dtype=np.float64))
    scaled = np.arange(length, dtype=np.float64)[:, None] * inv[None, :]
    return np.concatenate([np.sin(scaled), np.cos(scaled)], 1).astype(np.float32)


def _conv1d(g: Graph, name: str, x: Tensor, out: int, stride: int) -> Tensor:
    bound = 1.0 / math.sqrt(x.shape[1] * 3)  # torch.nn.Conv1d's default init
    w = g.param(f"{name}.weight", (out, x.shape[1], 3), "uniform", bound)
    b = g.param(f"{name}.bias", (out,), "uniform", bound)
    return g.conv1d(x, w, b, stride, 1)


def _layer_norm(g: Graph, name: str, x: Tensor, cfg: WhisperEncoderConfig) -> Tensor:
    d = x.shape[-1]
    return g.layer_norm(x, d, g.param(f"{name}.weight", (d,), 1.0),
                        g.param(f"{name}.bias", (d,)), cfg.layer_norm_eps)


def whisper_encoder(g: Graph, features: Tensor, cfg: WhisperEncoderConfig) -> Tensor:
    """Hidden states (B, positions, d) of log-mel `features` (B, mels, 2 x positions)."""
    p, d = cfg.prefix, cfg.d_model
    nh = cfg.encoder_attention_heads
    hd = d // nh
    h = _conv1d(g, p + "conv1", features, d, 1).gelu()
    h = _conv1d(g, p + "conv2", h, d, 2).gelu()
    x = g.transpose(h, (0, 2, 1))
    positions = g.param(p + "embed_positions.weight", (cfg.max_source_positions, d),
                        sinusoids(cfg.max_source_positions, d), trainable=False)
    if x.shape[1] != cfg.max_source_positions:
        positions = g.slice(positions, 0, 0, x.shape[1])
    x = x + positions
    for i in range(cfg.encoder_layers):
        q = f"{p}layers.{i}."
        a = _layer_norm(g, q + "self_attn_layer_norm", x, cfg)
        qs = heads(g, linear(g, q + "self_attn.q_proj", a, d, d), nh, hd)
        ks = heads(g, linear(g, q + "self_attn.k_proj", a, d, d, bias=False), nh, hd)
        vs = heads(g, linear(g, q + "self_attn.v_proj", a, d, d), nh, hd)
        att = g.scaled_dot_product_attention(qs, ks, vs, fused=cfg.fused_attention)
        x = x + linear(g, q + "self_attn.out_proj", merge_heads(g, att), d, d)
        m = _layer_norm(g, q + "final_layer_norm", x, cfg)
        m = linear(g, q + "fc1", m, d, cfg.encoder_ffn_dim).gelu()
        x = x + linear(g, q + "fc2", m, cfg.encoder_ffn_dim, d)
    return _layer_norm(g, p + "layer_norm", x, cfg)


def classification_head(g: Graph, hidden: Tensor, cfg: WhisperEncoderConfig) -> Tensor:
    """WhisperForAudioClassification's head: projector, mean over time, classifier (of the
    last layer's hidden states: use_weighted_layer_sum=False, whose files have no
    `layer_weights`)."""
    g.unsupported("layer_weights", "the file's WhisperForAudioClassification was made with "
                  "use_weighted_layer_sum=True (its logits mix every layer's hidden states "
                  "with these weights), which vkml's Whisper classifier does not implement: "
                  "it classifies the last layer's states, so its logits would differ; use a "
                  "checkpoint made with use_weighted_layer_sum=False")
    proj = linear(g, "projector", hidden, cfg.d_model, cfg.classifier_proj_size)
    return linear(g, "classifier", g.mean(proj, 1), cfg.classifier_proj_size, cfg.num_labels)


def build(cfg: WhisperEncoderConfig | None = None, seed: int = 0) -> Built:
    """Inputs `input_features` (B, mels, 2 x positions) and `labels` (B,) i32; outputs
    `last_hidden_state` and `logits`; loss: cross-entropy of the classification head."""
    cfg = cfg or WhisperEncoderConfig()
    g = Graph(seed=seed)
    features = g.input("input_features", (cfg.batch, cfg.num_mel_bins,
                                          2 * cfg.max_source_positions))
    labels = g.input("labels", (cfg.batch,), "i32")
    hidden = g.output("last_hidden_state", whisper_encoder(g, features, cfg))
    logits = g.output("logits", classification_head(g, hidden, cfg))
    loss = g.cross_entropy(logits, labels)

    def sample(rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"input_features": rng.standard_normal(features.shape).astype(np.float32),
                "labels": rng.integers(0, cfg.num_labels, cfg.batch).astype(np.int32)}

    return Built(g, {"input_features": features, "labels": labels},
                 {"last_hidden_state": hidden, "logits": logits}, loss, sample)
