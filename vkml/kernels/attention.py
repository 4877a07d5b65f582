"""Attention archetype: flash-style kernels that never store the score matrix.

- flash_attention: online softmax (running max m, running sum l, rescaled accumulator);
- flash_attention_lse: m + log(l) per query row, from which the backward (products,
  vkml/ops/attention.py) takes the probabilities.
On CPU drivers one thread a query row, its vectors held in scalar registers unrolled from Python
(no dynamically indexed local arrays, FACTS.md), loops over the keys. Causal masking is
top-left aligned (query i sees keys j <= i), as torch's is_causal.

On GPUs the forward and log-sum-exp passes are tiled (`_tiled`): a workgroup takes BLOCK_Q query
rows, stages KEY_TILE keys and values at a time in workgroup memory (read 16 bytes a load) and
gives each query row PARTS threads, each with its own slice of every tile and its own online
softmax, merged through workgroup memory at the end. One thread a row alone would leave the
H200 9000 threads for Whisper's 6 x 1500 queries (about two warps a multiprocessor). On the
H200 this runs Whisper's attention at 11 TFLOP/s, level with the composed attention's products
and softmax (tools/KERNELS.md, v8), so the composition stays the default; a register-tiled
variant (4 x 2 scores and 4 x 4 outputs a thread, as the GEMM core) measured slower still."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np

from vkml.graph import Tensor
from vkml.hal import Capabilities, Kernel
from vkml.kernels import gemm
from vkml.kernels.common import ENTRY_ARGS, LINEAR_WORKGROUP, Buf, assemble, check_loop, grid

WORKGROUP = 64
BLOCK_Q, PARTS, KEY_TILE = 32, 4, 32  # a workgroup: 32 query rows x 4 threads, 32 keys a tile


# pass -> its input bindings
BINDINGS = {"forward": ["q", "k", "v"], "lse": ["q", "k"]}
Pass = Literal["forward", "lse"]


def lowering(pass_: Pass) -> Callable[[Tensor, Capabilities], Kernel]:
    """The lowering of the op computing `pass_` (registered in vkml/ops/attention.py)."""
    return lambda node, caps: generate(node, caps, pass_)


def generate(node: Tensor, caps: Capabilities, pass_: Pass) -> Kernel:
    if _tileable(node, caps, pass_):
        return _tiled(node, caps, pass_)
    batch, h, hkv, length, s, dim, dv = _dims(node, pass_)
    acc, rep = pass_ == "forward", h // hkv
    causal, scale = node.attrs["causal"], node.attrs["scale"]
    check_loop(node, caps, s, "use scaled_dot_product_attention(..., fused=False) on this device")
    threads = batch * h * length
    score = " + ".join(f"q{e} * k[kr + {e}u]" for e in range(dim))
    lines = [f"fn main({ENTRY_ARGS}) {{",
             f"  let idx = ({LINEAR_WORKGROUP}) * {WORKGROUP}u + lid;",
             f"  if (idx >= {threads}u) {{ return; }}",
             f"  let i = idx % {length}u; let bh = idx / {length}u;",
             f"  let kv = (bh / {h}u) * {hkv}u + (bh % {h}u) / {rep}u;",
             *[f"  let q{e} = q[idx * {dim}u + {e}u] * {scale!r};" for e in range(dim)],
             f"  let end = {f'min(i + 1u, {s}u)' if causal else f'{s}u'};",
             "  var m = -3.4028235e38; var l = 0.0;",
             *([f"  var o{e} = 0.0;" for e in range(dv)] if acc else []),
             "  for (var j = 0u; j < end; j++) {",
             f"    let kr = (kv * {s}u + j) * {dim}u;",
             f"    let sc = {score};",
             "    let mn = max(m, sc); let corr = exp(m - mn); let p = exp(sc - mn);",
             "    l = l * corr + p; m = mn;"]
    if acc:
        lines += [f"    let vr = (kv * {s}u + j) * {dv}u;",
                  *[f"    o{e} = fma(p, v[vr + {e}u], o{e} * corr);" for e in range(dv)],
                  "  }", *[f"  out[idx * {dv}u + {e}u] = o{e} / l;" for e in range(dv)]]
    else:
        lines += ["  }", "  out[idx] = m + log(l);"]
    lines.append("}")
    return assemble(f"{node.op}_{'x'.join(map(str, node.inputs[0].shape))}_{s}", caps,
                    [*map(Buf, BINDINGS[pass_]), Buf("out", writable=True)], (WORKGROUP,),
                    lines, grid(-(-threads // WORKGROUP), caps), **_estimates(node, pass_))


def _shared_bytes(dim: int, dv: int) -> int:
    return 4 * (KEY_TILE * (dim + dv) + BLOCK_Q * dv + 2 * PARTS * BLOCK_Q)


def _dims(node: Tensor, pass_: Pass) -> tuple[int, int, int, int, int, int, int]:
    """(batch: the leading axes flattened, query heads, key/value heads, queries, keys, the
    q/k width, the v width: 0 for the log-sum-exp pass, which reads no v)."""
    q, k = node.inputs[0], node.inputs[1]
    *lead, h, length, dim = q.shape
    dv = node.inputs[2].shape[-1] if pass_ == "forward" else 0
    return int(np.prod(lead, dtype=np.int64)), h, k.shape[-3], length, k.shape[-2], dim, dv


def _tileable(node: Tensor, caps: Capabilities, pass_: Pass) -> bool:
    *_, dim, dv = _dims(node, pass_)
    return (not gemm.on_cpu(caps) and dim % 4 == 0 and dv % 4 == 0
            and BLOCK_Q * PARTS <= caps.max_workgroup_invocations
            and BLOCK_Q * PARTS <= caps.max_workgroup_size[0]
            and _shared_bytes(dim, dv) <= caps.max_shared_memory_bytes)


def _tiled(node: Tensor, caps: Capabilities, pass_: Pass) -> Kernel:
    """The GPU forward (`forward`) or log-sum-exp (`lse`) pass: see the module's docstring.
    Thread lid takes query row lid % BLOCK_Q of its block and keys part * chunk + c (c < chunk =
    KEY_TILE / PARTS) of every tile, part = lid / BLOCK_Q; it folds its chunk of scores into its
    running max and sum at once (one rescale of the accumulator per chunk)."""
    batch, h, hkv, length, s, dim, dv = _dims(node, pass_)
    acc, rep = pass_ == "forward", h // hkv
    causal, scale = node.attrs["causal"], node.attrs["scale"]
    d4, v4, threads, chunk = dim // 4, dv // 4, BLOCK_Q * PARTS, KEY_TILE // PARTS
    blocks = -(-length // BLOCK_Q)
    check_loop(node, caps, -(-s // KEY_TILE),
               "use scaled_dot_product_attention(..., fused=False) on this device")

    def stage(name: str, width: int) -> list[str]:  # one tile of k or v rows into workgroup memory
        lines, tile = [], name.upper() + "s"
        for r in range(-(-KEY_TILE * width // threads)):
            at = f"lid + {r * threads}u"
            guard = f"j < {s}u" + (f" && e < {KEY_TILE * width}u"
                                   if (r + 1) * threads > KEY_TILE * width else "")
            lines += [f"    {{ let e = {at}; let j = t0 + e / {width}u;",
                      f"      if ({guard}) {{ {tile}[e] = {name}[(kv * {s}u + j) * {width}u"
                      f" + e % {width}u]; }} else if (e < {KEY_TILE * width}u) "
                      f"{{ {tile}[e] = vec4<f32>(); }} }}"]
        return lines

    prelude = [f"var<workgroup> Ks: array<vec4<f32>, {KEY_TILE * d4}>;",
               f"var<workgroup> Ms: array<f32, {threads}>;",
               f"var<workgroup> Ls: array<f32, {threads}>;"]
    if acc:
        prelude += [f"var<workgroup> Vs: array<vec4<f32>, {KEY_TILE * v4}>;",
                    f"var<workgroup> Os: array<vec4<f32>, {BLOCK_Q * v4}>;"]
    limit = f"min(i + 1u, {s}u)" if causal else f"{s}u"
    lines = [f"fn main({ENTRY_ARGS}) {{",
             f"  let wg = {LINEAR_WORKGROUP}; let bh = wg / {blocks}u;",
             f"  let row = lid % {BLOCK_Q}u; let part = lid / {BLOCK_Q}u;",
             f"  let first = (wg % {blocks}u) * {BLOCK_Q}u; let i = first + row;",
             f"  let kv = (bh / {h}u) * {hkv}u + (bh % {h}u) / {rep}u;",
             f"  let qr = (bh * {length}u + min(i, {length - 1}u)) * {d4}u;",
             *[f"  let q{e} = q[qr + {e}u] * {scale!r};" for e in range(d4)],
             *([f"  var o{e} = vec4<f32>();" for e in range(v4)] if acc else []),
             "  var m = -3.4028235e38; var l = 0.0;",
             f"  let end = {f'min(first + {BLOCK_Q}u, {s}u)' if causal else f'{s}u'};",
             f"  let seen = {limit};",
             f"  for (var t0 = 0u; t0 < end; t0 += {KEY_TILE}u) {{",
             "    workgroupBarrier();",  # the previous tile's reads are done
             *stage("k", d4), *(stage("v", v4) if acc else []),
             "    workgroupBarrier();"]
    for c in range(chunk):
        key = f"part * {chunk}u + {c}u"
        dot = " + ".join(f"dot(q{e}, Ks[({key}) * {d4}u + {e}u])" for e in range(d4))
        lines.append(f"    let ok{c} = t0 + {key} < seen; "
                     f"let s{c} = select(-3.4028235e38, {dot}, ok{c});")
    top = "m"
    for c in range(chunk):
        top = f"max({top}, s{c})"
    lines += [f"    let mn = {top}; let corr = exp(m - mn);",
              *[f"    let p{c} = select(0.0, exp(s{c} - mn), ok{c});" for c in range(chunk)],
              f"    l = l * corr + {' + '.join(f'p{c}' for c in range(chunk))}; m = mn;"]
    if acc:
        for e in range(v4):
            terms = f"o{e} * corr"
            for c in range(chunk):
                at = f"(part * {chunk}u + {c}u) * {v4}u + {e}u"
                terms = f"fma(vec4<f32>(p{c}), Vs[{at}], {terms})"
            lines.append(f"    o{e} = {terms};")
    lines += ["  }",
              # merge the PARTS partial softmaxes of each row: rescale each to the row's max
              "  Ms[lid] = m;", "  workgroupBarrier();",
              "  var top = Ms[row];",
              *[f"  top = max(top, Ms[row + {p * BLOCK_Q}u]);" for p in range(1, PARTS)],
              "  let own = exp(m - top);", "  Ls[lid] = l * own;"]
    if acc:
        for p in range(PARTS):
            op = "=" if p == 0 else "+="
            lines += [f"  if (part == {p}u) {{",
                      *[f"    Os[row * {v4}u + {e}u] {op} o{e} * own;" for e in range(v4)],
                      "  }", "  workgroupBarrier();"]
    else:
        lines.append("  workgroupBarrier();")
    total = " + ".join(f"Ls[row + {p * BLOCK_Q}u]" for p in range(PARTS))
    if acc:
        lines += [f"  if (part == 0u) {{ Ms[row] = {total}; }}",  # every read of Ms is done
                  "  workgroupBarrier();"]
        for r in range(-(-BLOCK_Q * v4 // threads)):
            lines += [f"  {{ let e = lid + {r * threads}u; let qi = first + e / {v4}u;",
                      f"    if (e < {BLOCK_Q * v4}u && qi < {length}u) {{ out[(bh * {length}u"
                      f" + qi) * {v4}u + e % {v4}u] = Os[e] / Ms[e / {v4}u]; }} }}"]
    else:
        lines.append(f"  if (part == 0u && i < {length}u) {{ out[bh * {length}u + i] = "
                     f"top + log({total}); }}")
    lines.append("}")
    names = BINDINGS[pass_]
    buffers = [Buf(n, "vec4<f32>") for n in names] + [Buf("out", "vec4<f32>" if acc else "f32",
                                                          writable=True)]
    return assemble(f"{node.op}_{'x'.join(map(str, node.inputs[0].shape))}_{s}_tiled", caps,
                    buffers, (threads,), lines, grid(batch * h * blocks, caps),
                    prelude=prelude, **_estimates(node, pass_))


def _estimates(node: Tensor, pass_: Pass) -> dict[str, int]:
    """The work of either pass (the log-sum-exp computes no output rows): 2 L S (D + Dv) flops
    a head, every input read and the output written once."""
    batch, h, _, length, s, dim, dv = _dims(node, pass_)
    return {"flops": 2 * batch * h * length * s * (dim + dv),
            "nbytes": 4 * (sum(x.size for x in node.inputs) + node.size)}
