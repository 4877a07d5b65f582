"""SmolLM2 (LLaMA architecture): token embedding, pre-norm decoder layers of RMSNorm, causal
grouped-query self-attention with rotary position embedding (Hugging Face's rotate_half
convention) and a SwiGLU FFN, a final RMSNorm and an output projection tied to the embedding.

Parameter names are Hugging Face's `LlamaForCausalLM` ones (`model.embed_tokens.weight`,
`model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `model.layers.{i}.mlp.{gate,up,down}_proj
.weight`, `model.layers.{i}.input_layernorm.weight`, `...post_attention_layernorm.weight`,
`model.norm.weight`; `lm_head.weight` only when the embeddings are not tied), so the published
`HuggingFaceTB/SmolLM2-135M` safetensors loads by name.

The default config is the published SmolLM2-135M one (hidden 576, 30 layers, 9 query / 3 key-value
heads of 64, FFN 1536, vocab 49152, RMSNorm eps 1e-5, rope_theta 1e5) at the benchmark's batch 1 x
128 tokens. The loss is next-token cross-entropy: the `targets` input holds, for each position,
the token that follows it (the caller shifts; Hugging Face shifts `labels` inside the model).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from vkml.graph import Graph, Tensor
from vkml.models.common import Built, heads, merge_heads
from vkml.nn import linear
from vkml.ops.composite import picked_log_probabilities


@dataclass(frozen=True)
class SmolLM2Config:
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    tie_word_embeddings: bool = True
    initializer_range: float = 0.041666666666666664
    batch: int = 1
    seq: int = 128
    fused_attention: bool = False  # the flash-style kernel instead of the composed attention


def tiny() -> SmolLM2Config:
    """The same code at test size (seconds for a training step on lavapipe)."""
    return replace(SmolLM2Config(), vocab_size=96, hidden_size=32, intermediate_size=64,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=8, batch=2, seq=8)


def smollm2(g: Graph, ids: Tensor, cfg: SmolLM2Config) -> Tensor:
    """Logits (B*S, vocab) of i32 token `ids` (B, S)."""
    d, hd, std = cfg.hidden_size, cfg.head_dim, cfg.initializer_range
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    b, s = ids.shape
    embed = g.param("model.embed_tokens.weight", (cfg.vocab_size, d), "normal", std)
    x = g.embedding(ids, embed)  # (B, S, D)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        h = g.rms_norm(x, g.param(p + "input_layernorm.weight", (d,), 1.0), cfg.rms_norm_eps)
        q = heads(g, linear(g, p + "self_attn.q_proj", h, d, nh * hd, False, std), nh, hd)
        k = heads(g, linear(g, p + "self_attn.k_proj", h, d, nkv * hd, False, std), nkv, hd)
        v = heads(g, linear(g, p + "self_attn.v_proj", h, d, nkv * hd, False, std), nkv, hd)
        q, k = g.rope(q, cfg.rope_theta), g.rope(k, cfg.rope_theta)
        a = g.scaled_dot_product_attention(q, k, v, causal=True, fused=cfg.fused_attention)
        x = x + linear(g, p + "self_attn.o_proj", merge_heads(g, a), nh * hd, d, False, std)
        h = g.rms_norm(x, g.param(p + "post_attention_layernorm.weight", (d,), 1.0),
                       cfg.rms_norm_eps)
        f = cfg.intermediate_size
        gate = linear(g, p + "mlp.gate_proj", h, d, f, False, std)
        up = linear(g, p + "mlp.up_proj", h, d, f, False, std)
        x = x + linear(g, p + "mlp.down_proj", g.swiglu(gate, up), f, d, False, std)
    h = g.rms_norm(x, g.param("model.norm.weight", (d,), 1.0), cfg.rms_norm_eps)
    head = embed if cfg.tie_word_embeddings else g.param("lm_head.weight", (cfg.vocab_size, d),
                                                         "normal", std)
    return g.matmul(g.reshape(h, (b * s, d)), head, transpose_b=True)


def next_token_loss(g: Graph, logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of `logits` (rows, vocab) against i32 `targets` (rows,), as
    g.cross_entropy computes it, but summed in two stages (over the vocabulary per row, then over
    the rows). g.cross_entropy's loss is one reduction: one workgroup of 64 invocations, each
    looping over a 64th of the 128 x 49152 = 6.3M log-probabilities at the full config, and
    lavapipe ends a shader loop after 65535 iterations (llvmpipe's loop limit), so everything
    past 65535 x 64 elements was dropped (the loss came out 34% low). Two stages keep every
    loop short: 768 iterations per row here."""
    picked = picked_log_probabilities(g, logits, targets)
    return g.mul(g.sum(g.sum(picked, -1)), -1.0 / logits.shape[0])


def build(cfg: SmolLM2Config | None = None, seed: int = 0) -> Built:
    """Inputs `ids` (B, S) i32 and `targets` (B*S,) i32 (the next token at each position);
    output `logits` (B*S, vocab); loss: mean cross-entropy over the B*S positions."""
    cfg = cfg or SmolLM2Config()
    g = Graph(seed=seed)
    ids = g.input("ids", (cfg.batch, cfg.seq), "i32")
    targets = g.input("targets", (cfg.batch * cfg.seq,), "i32")
    logits = g.output("logits", smollm2(g, ids, cfg))
    loss = next_token_loss(g, logits, targets)

    def sample(rng: np.random.Generator) -> dict[str, np.ndarray]:
        tokens = rng.integers(0, cfg.vocab_size, (cfg.batch, cfg.seq + 1)).astype(np.int32)
        return {"ids": tokens[:, :-1], "targets": tokens[:, 1:].reshape(-1)}

    return Built(g, {"ids": ids, "targets": targets}, {"logits": logits}, loss, sample)
