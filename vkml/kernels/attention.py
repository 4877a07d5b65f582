"""Attention archetype: flash-style kernels that never store the score matrix.

One thread per query row (forward, log-sum-exp, dQ) or per key row (dK, dV), its vectors held in
scalar registers unrolled from Python (no dynamically indexed local arrays, FACTS.md), looping
over the other side's rows:
- flash_attention: online softmax (running max m, running sum l, rescaled accumulator);
- flash_attention_lse: m + log(l) per query row, for the backward;
- dq / dk / dv: FlashAttention-2's backward, P recomputed from the scores and the saved
  log-sum-exp, dS = P * (dO . v - D) with D = rowsum(dO * O).
Causal masking is top-left aligned (query i sees keys j <= i), as torch's is_causal. Not yet
tiled through workgroup memory (each thread streams K and V itself)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np

from vkml.graph import Tensor
from vkml.hal import Capabilities, Kernel
from vkml.kernels.common import ENTRY_ARGS, LINEAR_WORKGROUP, Buf, assemble, check_loop, grid

WORKGROUP = 64


def _dot(a: str, b: str, n: int) -> str:
    """sum over e < n of a{e} * b[e] (a: register names prefix, b: an address prefix)."""
    return " + ".join(f"{a}{e} * {b}{e}u]" for e in range(n))


# pass -> its input bindings: the forward output, the row log-sum-exp, and the gradients
BINDINGS = {"forward": ["q", "k", "v"], "lse": ["q", "k"],
            "dq": ["q", "k", "v", "dout", "lse", "dsum"],
            "dk": ["q", "k", "v", "dout", "lse", "dsum"], "dv": ["q", "k", "dout", "lse"]}
Pass = Literal["forward", "lse", "dq", "dk", "dv"]


def lowering(pass_: Pass) -> Callable[[Tensor, Capabilities], Kernel]:
    """The lowering of the op computing `pass_` (registered in vkml/ops/attention.py)."""
    return lambda node, caps: generate(node, caps, pass_)


def generate(node: Tensor, caps: Capabilities, pass_: Pass) -> Kernel:
    q, k = node.inputs[0], node.inputs[1]
    *lead, h, length, dim = q.shape
    hkv, s = k.shape[-3], k.shape[-2]
    dv = node.inputs[2].shape[-1] if pass_ in ("forward", "dq", "dk") else node.shape[-1]
    rep = h // hkv
    batch = int(np.prod(lead, dtype=np.int64))
    causal, scale = node.attrs["causal"], node.attrs["scale"]
    per_query = pass_ in ("forward", "lse", "dq")
    check_loop(node, caps, s if per_query else rep * length,
               "use scaled_dot_product_attention(..., fused=False) on this device")
    threads = batch * h * length if per_query else batch * hkv * s
    names = BINDINGS[pass_]
    lines = [f"fn main({ENTRY_ARGS}) {{",
             f"  let idx = ({LINEAR_WORKGROUP}) * {WORKGROUP}u + lid;",
             f"  if (idx >= {threads}u) {{ return; }}"]
    if per_query:
        lines += [f"  let i = idx % {length}u; let bh = idx / {length}u;",
                  f"  let kv = (bh / {h}u) * {hkv}u + (bh % {h}u) / {rep}u;",
                  *[f"  let q{e} = q[idx * {dim}u + {e}u] * {scale!r};" for e in range(dim)],
                  f"  let end = {f'min(i + 1u, {s}u)' if causal else f'{s}u'};"]
        score = f"let sc = {_dot('q', 'k[kr + ', dim)};"
        if pass_ == "dq":
            lse_at, dsum_at = "lse[idx]", "dsum[idx]"
            lines += [*[f"  let g{e} = dout[idx * {dv}u + {e}u];" for e in range(dv)],
                      f"  let lse_i = {lse_at}; let d_i = {dsum_at};",
                      *[f"  var a{e} = 0.0;" for e in range(dim)],
                      "  for (var j = 0u; j < end; j++) {",
                      f"    let kr = (kv * {s}u + j) * {dim}u; let vr = (kv * {s}u + j) * {dv}u;",
                      f"    {score}",
                      "    let p = exp(sc - lse_i);",
                      f"    let ds = p * ({_dot('g', 'v[vr + ', dv)} - d_i);",
                      *[f"    a{e} = fma(ds, k[kr + {e}u], a{e});" for e in range(dim)],
                      "  }",
                      *[f"  out[idx * {dim}u + {e}u] = a{e} * {scale!r};" for e in range(dim)]]
        else:
            acc = pass_ == "forward"
            lines += ["  var m = -3.4028235e38; var l = 0.0;",
                      *([f"  var o{e} = 0.0;" for e in range(dv)] if acc else []),
                      "  for (var j = 0u; j < end; j++) {",
                      f"    let kr = (kv * {s}u + j) * {dim}u;",
                      f"    {score}",
                      "    let mn = max(m, sc); let corr = exp(m - mn); let p = exp(sc - mn);",
                      "    l = l * corr + p; m = mn;"]
            if acc:
                lines += [f"    let vr = (kv * {s}u + j) * {dv}u;",
                          *[f"    o{e} = fma(p, v[vr + {e}u], o{e} * corr);" for e in range(dv)]]
            lines.append("  }")
            if acc:
                lines += [f"  out[idx * {dv}u + {e}u] = o{e} / l;" for e in range(dv)]
            else:
                lines.append("  out[idx] = m + log(l);")
    else:  # one thread per key row j of kv head `kv`, over the queries of its `rep` heads
        width = dim if pass_ == "dk" else dv
        lines += [f"  let j = idx % {s}u; let kv = idx / {s}u;",
                  f"  let b = kv / {hkv}u; let h0 = b * {h}u + (kv % {hkv}u) * {rep}u;",
                  *[f"  let k{e} = k[idx * {dim}u + {e}u];" for e in range(dim)],
                  *([f"  let v{e} = v[idx * {dv}u + {e}u];" for e in range(dv)]
                    if pass_ == "dk" else []),
                  *[f"  var a{e} = 0.0;" for e in range(width)],
                  f"  for (var t = 0u; t < {rep * length}u; t++) {{",
                  f"    let i = t % {length}u; let row = (h0 + t / {length}u) * {length}u + i;",
                  *(["    if (i < j) { continue; }"] if causal else []),
                  f"    let qr = row * {dim}u; let gr = row * {dv}u;",
                  f"    let sc = ({_dot('k', 'q[qr + ', dim)}) * {scale!r};",
                  "    let p = exp(sc - lse[row]);"]
        if pass_ == "dk":
            lines += [f"    let ds = p * ({_dot('v', 'dout[gr + ', dv)} - dsum[row]);",
                      *[f"    a{e} = fma(ds, q[qr + {e}u], a{e});" for e in range(dim)], "  }",
                      *[f"  out[idx * {dim}u + {e}u] = a{e} * {scale!r};" for e in range(dim)]]
        else:
            lines += [*[f"    a{e} = fma(p, dout[gr + {e}u], a{e});" for e in range(dv)], "  }",
                      *[f"  out[idx * {dv}u + {e}u] = a{e};" for e in range(dv)]]
    lines.append("}")
    return assemble(f"{node.op}_{'x'.join(map(str, q.shape))}_{s}", caps,
                    [*map(Buf, names), Buf("out", writable=True)], (WORKGROUP,), lines,
                    grid(-(-threads // WORKGROUP), caps),
                    flops=4 * batch * h * length * s * max(dim, dv),
                    nbytes=4 * (sum(x.size for x in node.inputs) + node.size))
