"""SmolVLA's action expert (LeRobot's `VLAFlowMatching` head): a small LLaMA-style transformer
over a chunk of noisy actions, whose layers alternate between self-attention over the action
tokens (even layers) and cross-attention to the VLM's tokens (odd layers), trained by flow
matching: MSE between the predicted velocity and the target.

- actions (B, chunk, action_dim) -> `action_in_proj`; concatenated with the sinusoidal time
  embedding (given as the input `time_emb`, (B, hidden): see `time_embedding`) ->
  `action_time_mlp_in` -> SiLU -> `action_time_mlp_out`.
- layers as SmolLM2's (RMSNorm, attention with 15 query / 5 key-value heads of 64, SwiGLU FFN
  2048); self-attention layers are bidirectional over the chunk with RoPE; in cross-attention
  layers k_proj / v_proj take the VLM tokens (B, vlm_tokens, vlm_kv_dim = 320) and no RoPE.
- final RMSNorm -> `action_out_proj` -> (B, chunk, action_dim).

Names follow LeRobot's SmolVLA checkpoints: `model.action_in_proj.*`, `model.action_out_proj.*`,
`model.action_time_mlp_{in,out}.*`, and `model.vlm_with_expert.lm_expert.layers.{i}.self_attn
.{q,k,v,o}_proj.weight`, `...mlp.{gate,up,down}_proj.weight`, `...input_layernorm.weight`,
`...post_attention_layernorm.weight`, `model.vlm_with_expert.lm_expert.norm.weight`.

Simplifications, stated: the VLM side is one tensor `vlm_kv` (B, 16, 320) that every
cross-attention layer reads (LeRobot feeds each layer that VLM layer's own key and value
states); self-attention layers attend over the action tokens only (LeRobot's also see the
prefix); the state token is not modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from vkml.graph import Graph, Tensor
from vkml.models.common import Built, heads, merge_heads
from vkml.nn import linear


@dataclass(frozen=True)
class SmolVLAExpertConfig:
    hidden_size: int = 720
    num_hidden_layers: int = 16
    num_attention_heads: int = 15
    num_key_value_heads: int = 5
    head_dim: int = 64
    intermediate_size: int = 2048
    vlm_kv_dim: int = 320
    vlm_tokens: int = 16
    action_dim: int = 32
    chunk_size: int = 50
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    self_attn_every_n_layers: int = 2  # layer i is self-attention when i % n == 0
    prefix: str = "model."
    batch: int = 1
    fused_attention: bool = False


def tiny() -> SmolVLAExpertConfig:
    return replace(SmolVLAExpertConfig(), hidden_size=48, num_hidden_layers=4,
                   num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                   intermediate_size=64, vlm_kv_dim=16, vlm_tokens=4, action_dim=6,
                   chunk_size=5, batch=2)


def time_embedding(t: np.ndarray, dim: int, min_period: float = 4e-3,
                   max_period: float = 4.0) -> np.ndarray:
    """LeRobot's create_sinusoidal_pos_embedding of flow-matching times `t` (B,) -> (B, dim)."""
    fraction = np.linspace(0.0, 1.0, dim // 2, dtype=np.float64)
    period = min_period * (max_period / min_period) ** fraction
    angle = (2 * math.pi / period)[None, :] * np.asarray(t, np.float64)[:, None]
    return np.concatenate([np.sin(angle), np.cos(angle)], 1).astype(np.float32)


def smolvla_expert(g: Graph, actions: Tensor, time_emb: Tensor, vlm_kv: Tensor,
                   cfg: SmolVLAExpertConfig) -> Tensor:
    """Velocity (B, chunk, action_dim) for noisy `actions` at times `time_emb` given `vlm_kv`."""
    p, d, hd = cfg.prefix, cfg.hidden_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    b, chunk, _ = actions.shape
    x = linear(g, p + "action_in_proj", actions, cfg.action_dim, d)
    t = g.broadcast_to(g.reshape(time_emb, (b, 1, d)), (b, chunk, d))
    x = linear(g, p + "action_time_mlp_in", g.concat([x, t], -1), 2 * d, d).silu()
    x = linear(g, p + "action_time_mlp_out", x, d, d)
    for i in range(cfg.num_hidden_layers):
        q = f"{p}vlm_with_expert.lm_expert.layers.{i}."
        h = g.rms_norm(x, g.param(q + "input_layernorm.weight", (d,), 1.0), cfg.rms_norm_eps)
        is_self = i % cfg.self_attn_every_n_layers == 0
        src, src_dim = (h, d) if is_self else (vlm_kv, cfg.vlm_kv_dim)
        qs = heads(g, linear(g, q + "self_attn.q_proj", h, d, nh * hd, False), nh, hd)
        ks = heads(g, linear(g, q + "self_attn.k_proj", src, src_dim, nkv * hd, False), nkv, hd)
        vs = heads(g, linear(g, q + "self_attn.v_proj", src, src_dim, nkv * hd, False), nkv, hd)
        if is_self:
            qs, ks = g.rope(qs, cfg.rope_theta), g.rope(ks, cfg.rope_theta)
        a = g.scaled_dot_product_attention(qs, ks, vs, fused=cfg.fused_attention)
        x = x + linear(g, q + "self_attn.o_proj", merge_heads(g, a), nh * hd, d, False)
        h = g.rms_norm(x, g.param(q + "post_attention_layernorm.weight", (d,), 1.0),
                       cfg.rms_norm_eps)
        f = cfg.intermediate_size
        gate = linear(g, q + "mlp.gate_proj", h, d, f, False)
        up = linear(g, q + "mlp.up_proj", h, d, f, False)
        x = x + linear(g, q + "mlp.down_proj", g.swiglu(gate, up), f, d, False)
    x = g.rms_norm(x, g.param(p + "vlm_with_expert.lm_expert.norm.weight", (d,), 1.0),
                   cfg.rms_norm_eps)
    return linear(g, p + "action_out_proj", x, d, cfg.action_dim)


def build(cfg: SmolVLAExpertConfig | None = None, seed: int = 0) -> Built:
    """Inputs `noisy_actions` (B, chunk, action_dim), `time_emb` (B, hidden), `vlm_kv`
    (B, vlm_tokens, vlm_kv_dim) and `target` (B, chunk, action_dim) (the flow-matching velocity
    noise - actions); output `velocity`; loss: MSE."""
    cfg = cfg or SmolVLAExpertConfig()
    g = Graph(seed=seed)
    actions = g.input("noisy_actions", (cfg.batch, cfg.chunk_size, cfg.action_dim))
    time_emb = g.input("time_emb", (cfg.batch, cfg.hidden_size))
    vlm_kv = g.input("vlm_kv", (cfg.batch, cfg.vlm_tokens, cfg.vlm_kv_dim))
    target = g.input("target", actions.shape)
    velocity = g.output("velocity", smolvla_expert(g, actions, time_emb, vlm_kv, cfg))
    loss = g.mse(velocity, target)

    def sample(rng: np.random.Generator) -> dict[str, np.ndarray]:
        clean = rng.standard_normal(actions.shape).astype(np.float32)
        noise = rng.standard_normal(actions.shape).astype(np.float32)
        t = rng.uniform(0.0, 1.0, cfg.batch)
        noisy = t[:, None, None] * noise + (1 - t[:, None, None]) * clean
        return {"noisy_actions": noisy.astype(np.float32),
                "time_emb": time_embedding(t, cfg.hidden_size),
                "vlm_kv": rng.standard_normal(vlm_kv.shape).astype(np.float32),
                "target": noise - clean}

    return Built(g, {"noisy_actions": actions, "time_emb": time_emb, "vlm_kv": vlm_kv,
                     "target": target}, {"velocity": velocity}, loss, sample)
