"""What the compiler's middle buys, on an MLP, a 4-layer transformer and a small conv net:
dispatches and barriers without and with fusion, logical bytes (one buffer per tensor) against
the bytes the memory plan allocates, and compile time (graph to plan, and to a runnable session
with warm caches). Inference and training (Adam) each.

    python tools/bench_compiler.py [--out out/bench_compiler.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import vkml  # noqa: E402
from vkml import nn  # noqa: E402
from vkml.compiler.stages import lower  # noqa: E402


def mlp(g: vkml.Graph):
    x = g.input("x", (64, 256))
    labels = g.input("labels", (64,), "i32")
    h = x
    for i, (a, b) in enumerate([(256, 128), (128, 64)]):
        h = nn.Linear(g, f"fc{i + 1}", a, b)(h).relu()
    logits = nn.Linear(g, "fc3", 64, 6)(h)
    return logits, g.cross_entropy(logits, labels)


def transformer(g: vkml.Graph, layers=4, batch=2, seq=64, dim=128, heads=4, vocab=256):
    """A GPT-style decoder: token + position embeddings, pre-norm blocks of causal
    self-attention and a GELU MLP, tied output projection."""
    ids = g.input("ids", (batch, seq), "i32")
    targets = g.input("targets", (batch * seq,), "i32")
    wte = g.param("wte", (vocab, dim), "normal", 0.02)
    h = g.add(g.embedding(ids, wte), g.param("wpe", (seq, dim), "normal", 0.02))
    for i in range(layers):
        a = g.layer_norm(h, (dim,), g.param(f"h{i}.ln1.weight", (dim,), 1.0),
                         g.param(f"h{i}.ln1.bias", (dim,)))
        qkv = nn.Linear(g, f"h{i}.attn.qkv", dim, 3 * dim)(a.reshape(batch * seq, dim))
        q, k, v = (t.reshape(batch, seq, heads, dim // heads).transpose(0, 2, 1, 3)
                   for t in g.split(qkv, dim, axis=1))
        att = g.scaled_dot_product_attention(q, k, v, causal=True)
        att = att.transpose(0, 2, 1, 3).reshape(batch * seq, dim)
        h = h + nn.Linear(g, f"h{i}.attn.proj", dim, dim)(att).reshape(batch, seq, dim)
        m = g.layer_norm(h, (dim,), g.param(f"h{i}.ln2.weight", (dim,), 1.0),
                         g.param(f"h{i}.ln2.bias", (dim,)))
        m = nn.Linear(g, f"h{i}.mlp.fc", dim, 4 * dim)(m.reshape(batch * seq, dim)).gelu()
        h = h + nn.Linear(g, f"h{i}.mlp.proj", 4 * dim, dim)(m).reshape(batch, seq, dim)
    h = g.layer_norm(h, (dim,), g.param("ln_f.weight", (dim,), 1.0), g.param("ln_f.bias", (dim,)))
    logits = g.matmul(h.reshape(batch * seq, dim), wte, transpose_b=True)
    return logits, g.cross_entropy(logits, targets)


def convnet(g: vkml.Graph, batch=8, size=32):
    x = g.input("x", (batch, 3, size, size))
    labels = g.input("labels", (batch,), "i32")
    h, channels = x, 3
    for i, out in enumerate((16, 32, 64)):
        w = g.param(f"conv{i}.weight", (out, channels, 3, 3), "normal", (2 / (9 * channels)) ** .5)
        h = g.conv2d(h, w, g.param(f"conv{i}.bias", (out,)), padding=1).relu()
        h = g.max_pool2d(h, 2)
        channels = out
    h = g.global_avg_pool2d(h).reshape(batch, channels)
    logits = nn.Linear(g, "fc", channels, 10)(h)
    return logits, g.cross_entropy(logits, labels)


MODELS = {"mlp": mlp, "transformer-4L": transformer, "convnet": convnet}


def measure(name, build, device, mode, rewrite, reps):
    g = vkml.Graph(seed=0)
    logits, loss = build(g)
    kwargs = ({"outputs": {"logits": logits}} if mode == "inference"
              else {"loss": loss, "optimizer": vkml.Adam()})
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        stages = lower(g, device.caps, rewrite=rewrite, **kwargs)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    session = vkml.compile(g, device=device, rewrite=rewrite, **kwargs)
    compile_s = time.perf_counter() - t0
    plan = stages.plan
    report = plan.memory_report()
    session.close()
    return {"model": name, "mode": mode, "rewrite": rewrite, "dispatches": len(plan.dispatches),
            "barriers": plan.barrier_count, "kernels": len({d.kernel.wgsl for d in
                                                            plan.dispatches}),
            "logical_bytes": report["logical"], "physical_bytes": report["physical"],
            "physical_over_logical": report["physical"] / report["logical"],
            "lower_s_median": statistics.median(times), "lower_s_min": min(times),
            "compile_s_warm": compile_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "out" / "bench_compiler.json")
    parser.add_argument("--reps", type=int, default=3)
    opts = parser.parse_args()
    device = vkml.Device()
    rows = []
    for name, build in MODELS.items():
        for mode in ("inference", "training"):
            for rewrite in ("none", "greedy"):
                measure(name, build, device, mode, rewrite, 1)  # warms the kernel caches
                rows.append(measure(name, build, device, mode, rewrite, opts.reps))
    print(f"device: {device.name}")
    print(f"{'model':15} {'mode':9} {'rewrite':7} {'disp':>5} {'barr':>5} {'kern':>5} "
          f"{'logical':>11} {'physical':>11} {'ratio':>6} {'lower s':>8} {'compile s':>9}")
    for r in rows:
        print(f"{r['model']:15} {r['mode']:9} {r['rewrite']:7} {r['dispatches']:5} "
              f"{r['barriers']:5} {r['kernels']:5} {r['logical_bytes']:11} "
              f"{r['physical_bytes']:11} {r['physical_over_logical']:6.2f} "
              f"{r['lower_s_median']:8.3f} {r['compile_s_warm']:9.3f}")
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps({"device": device.name, "rows": rows}, indent=1))
    print(f"wrote {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
