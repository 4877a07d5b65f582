"""Plain-PyTorch reference implementations of vkml's reference models (vkml/models/), written
independently of vkml from the published architectures, with module attribute names chosen so
that `state_dict()` names equal the Hugging Face / torchvision ones vkml uses: a vkml session's
`params()` loads into them with `load_state_dict(..., strict=True)`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


# ---- SmolLM2 (LLaMA) ----------------------------------------------------------------------------
def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


def rope(x, theta):
    """Hugging Face LLaMA rotary embedding on (B, H, S, D), positions 0..S-1."""
    length, dim = x.shape[-2:]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    emb = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq).repeat(1, 2)
    return x * emb.cos().to(x.dtype) + rotate_half(x) * emb.sin().to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, d, n_heads, n_kv, head_dim, kv_in=None, theta=None):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim, self.theta = n_heads, n_kv, head_dim, theta
        self.q_proj = nn.Linear(d, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(kv_in or d, n_kv * head_dim, bias=False)
        self.v_proj = nn.Linear(kv_in or d, n_kv * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, d, bias=False)

    def forward(self, x, kv=None, causal=False):
        b, s, _ = x.shape
        kv = x if kv is None else kv
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(kv).view(b, kv.shape[1], self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(kv).view(b, kv.shape[1], self.n_kv, self.head_dim).transpose(1, 2)
        if self.theta is not None:
            q, k = rope(q, self.theta), rope(k, self.theta)
        rep = self.n_heads // self.n_kv  # repeat_kv, as Hugging Face does
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        if causal:
            mask = torch.ones(s, s, dtype=torch.bool).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        out = scores.softmax(-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class LlamaMLP(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    def __init__(self, cfg, kv_in=None, theta=None):
        super().__init__()
        d = cfg.hidden_size
        self.self_attn = LlamaAttention(d, cfg.num_attention_heads, cfg.num_key_value_heads,
                                        cfg.head_dim, kv_in, theta)
        self.mlp = LlamaMLP(d, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)

    def forward(self, x, kv=None, causal=False):
        x = x + self.self_attn(self.input_layernorm(x), kv, causal)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(cfg, theta=cfg.rope_theta)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class SmolLM2(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, ids, targets):
        x = self.model.embed_tokens(ids.long())
        for layer in self.model.layers:
            x = layer(x, causal=True)
        x = self.model.norm(x)
        head = (self.model.embed_tokens.weight if self.cfg.tie_word_embeddings
                else self.lm_head.weight)
        logits = (x @ head.T).reshape(-1, self.cfg.vocab_size)
        return {"logits": logits}, F.cross_entropy(logits, targets.long())


# ---- ResNet (torchvision layout) ---------------------------------------------------------------
def _bn2d(cfg, c):
    # "train": batch statistics only (no running-statistics buffers, as the vkml graph has none);
    # "eval": running statistics, used after module.eval().
    return nn.BatchNorm2d(c, eps=cfg.bn_eps, track_running_stats=cfg.bn == "eval")


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cfg, cin, width, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.bn1 = _bn2d(cfg, width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = _bn2d(cfg, width)
        self.downsample = None
        if stride != 1 or cin != width:
            self.downsample = nn.Sequential(nn.Conv2d(cin, width, 1, stride, bias=False),
                                            _bn2d(cfg, width))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cfg, cin, width, stride):
        super().__init__()
        out = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = _bn2d(cfg, width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = _bn2d(cfg, width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = _bn2d(cfg, out)
        self.downsample = None
        if stride != 1 or cin != out:
            self.downsample = nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False),
                                            _bn2d(cfg, out))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        return F.relu(h + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        block = BasicBlock if cfg.block == "basic" else Bottleneck
        self.conv1 = nn.Conv2d(cfg.in_channels, cfg.stem_width, 7, 2, 3, bias=False)
        self.bn1 = _bn2d(cfg, cfg.stem_width)
        cin = cfg.stem_width
        for stage, (n, width) in enumerate(zip(cfg.layers, cfg.widths), start=1):
            blocks = []
            for i in range(n):
                blocks.append(block(cfg, cin, width, 2 if stage > 1 and i == 0 else 1))
                cin = width * block.expansion
            setattr(self, f"layer{stage}", nn.Sequential(*blocks))
        self.n_stages = len(cfg.layers)
        self.fc = nn.Linear(cin, cfg.num_classes)

    def forward(self, x, labels):
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        for stage in range(1, self.n_stages + 1):
            h = getattr(self, f"layer{stage}")(h)
        logits = self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))
        return {"logits": logits}, F.cross_entropy(logits, labels.long())


# ---- the small diffusion U-Net -----------------------------------------------------------------
class ResBlock(nn.Module):
    def __init__(self, cin, cout, groups, eps):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin, eps)
        self.conv1 = nn.Conv2d(cin, cout, 3, 1, 1)
        self.norm2 = nn.GroupNorm(groups, cout, eps)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return h + (x if self.conv_shortcut is None else self.conv_shortcut(x))


class UNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        widths = [cfg.base * m for m in cfg.mults]
        self.conv_in = nn.Conv2d(cfg.in_channels, widths[0], 3, 1, 1)
        self.down = nn.ModuleList()
        cin = widths[0]
        for i, w in enumerate(widths):
            level = nn.Module()
            level.res = ResBlock(cin, w, cfg.groups, cfg.eps)
            if i < len(widths) - 1:
                level.downsample = nn.Conv2d(w, w, 3, 2, 1)
            self.down.append(level)
            cin = w
        self.mid = nn.Module()
        self.mid.res = ResBlock(cin, cin, cfg.groups, cfg.eps)
        self.up = nn.ModuleList(nn.Module() for _ in widths)
        for i in reversed(range(len(widths))):
            if i < len(widths) - 1:
                self.up[i].upsample = nn.Conv2d(cin, cin, 3, 1, 1)
            self.up[i].res = ResBlock(cin + widths[i], widths[i], cfg.groups, cfg.eps)
            cin = widths[i]
        self.norm_out = nn.GroupNorm(cfg.groups, cin, cfg.eps)
        self.conv_out = nn.Conv2d(cin, cfg.out_channels, 3, 1, 1)

    def forward(self, x, target):
        h = self.conv_in(x)
        skips = []
        for level in self.down:
            h = level.res(h)
            skips.append(h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        h = self.mid.res(h)
        for i in reversed(range(len(self.up))):
            if hasattr(self.up[i], "upsample"):
                h = self.up[i].upsample(F.interpolate(h, scale_factor=2, mode="nearest"))
            h = self.up[i].res(torch.cat([h, skips[i]], 1))
        prediction = self.conv_out(F.silu(self.norm_out(h)))
        return {"prediction": prediction}, F.mse_loss(prediction, target)


# ---- Whisper encoder (Hugging Face WhisperForAudioClassification) -----------------------------
def whisper_sinusoids(length, channels, max_timescale=10000):
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-increment * torch.arange(channels // 2, dtype=torch.float64))
    scaled = torch.arange(length, dtype=torch.float64).view(-1, 1) * inv_timescales.view(1, -1)
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)


class WhisperAttention(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d // n_heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape

        def split(t):
            return t.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)

        q = split(self.q_proj(x) * self.head_dim ** -0.5)
        k, v = split(self.k_proj(x)), split(self.v_proj(x))
        out = (q @ k.transpose(-1, -2)).softmax(-1) @ v
        return self.out_proj(out.transpose(1, 2).reshape(b, s, d))


class WhisperEncoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.d_model
        self.self_attn = WhisperAttention(d, cfg.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(d, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)

    def forward(self, x):
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.d_model
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, 3, padding=1)
        self.conv2 = nn.Conv1d(d, d, 3, stride=2, padding=1)
        # A frozen parameter, as Hugging Face's WhisperEncoder has it (and vkml's model)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, d)
        with torch.no_grad():
            self.embed_positions.weight.copy_(whisper_sinusoids(cfg.max_source_positions, d))
        self.embed_positions.weight.requires_grad_(False)
        self.layers = nn.ModuleList(WhisperEncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)

    def forward(self, features):
        h = F.gelu(self.conv2(F.gelu(self.conv1(features)))).permute(0, 2, 1)
        h = h + self.embed_positions.weight[:h.shape[1]]
        for layer in self.layers:
            h = layer(h)
        return self.layer_norm(h)


class WhisperForAudioClassification(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        assert cfg.prefix == "encoder."
        self.encoder = WhisperEncoder(cfg)
        self.projector = nn.Linear(cfg.d_model, cfg.classifier_proj_size)
        self.classifier = nn.Linear(cfg.classifier_proj_size, cfg.num_labels)

    def forward(self, input_features, labels):
        hidden = self.encoder(input_features)
        logits = self.classifier(self.projector(hidden).mean(1))
        return ({"last_hidden_state": hidden, "logits": logits},
                F.cross_entropy(logits, labels.long()))


# ---- SmolVLA action expert ---------------------------------------------------------------------
class LMExpert(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList(
            LlamaLayer(cfg, theta=cfg.rope_theta) if i % cfg.self_attn_every_n_layers == 0
            else LlamaLayer(cfg, kv_in=cfg.vlm_kv_dim) for i in range(cfg.num_hidden_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class VLAFlowMatching(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.hidden_size
        self.cfg = cfg
        self.vlm_with_expert = nn.Module()
        self.vlm_with_expert.lm_expert = LMExpert(cfg)
        self.action_in_proj = nn.Linear(cfg.action_dim, d)
        self.action_out_proj = nn.Linear(d, cfg.action_dim)
        self.action_time_mlp_in = nn.Linear(2 * d, d)
        self.action_time_mlp_out = nn.Linear(d, d)


class SmolVLAExpert(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        assert cfg.prefix == "model."
        self.model = VLAFlowMatching(cfg)

    def forward(self, noisy_actions, time_emb, vlm_kv, target):
        m, cfg = self.model, self.model.cfg
        x = m.action_in_proj(noisy_actions)
        t = time_emb[:, None, :].expand_as(x)
        x = m.action_time_mlp_out(F.silu(m.action_time_mlp_in(torch.cat([x, t], -1))))
        for i, layer in enumerate(m.vlm_with_expert.lm_expert.layers):
            x = layer(x, None if i % cfg.self_attn_every_n_layers == 0 else vlm_kv)
        velocity = m.action_out_proj(m.vlm_with_expert.lm_expert.norm(x))
        return {"velocity": velocity}, F.mse_loss(velocity, target)
