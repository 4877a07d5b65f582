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
softmax, merged through workgroup memory at the end. One thread a row alone would leave a large
GPU a few warps a multiprocessor (Whisper's 6 x 1500 queries are 9000 threads). Tiled, it runs
level with the composed attention's products and softmax, so the composition stays the
default; a register-tiled variant (4 x 2 scores and 4 x 4 outputs a thread, as the GEMM core)
measured slower still.

At precision "f16" (and "bf16") the forward pass runs on cooperative matrices (`_cooperative`):
16 query rows a subgroup, keys COOP_KEYS a tile, f16 (bf16) operands and f32 accumulators, in
two passes over the keys: the first finds each row's max and sum of exponentials, the second
adds P V with P already normalized, so the output's fragments never need rescaling (a
fragment's elements are opaque to the threads that hold it: rescaling rows as the max grows
would cost a trip through workgroup memory a tile). The scores are computed as S^T = K Q^T, so
keys and values are staged as they lie in memory and only Q, once, transposed. The compiler's
rewrite (compiler/compose.py, ops/attention.py) puts the composed attention of an inference on
it."""

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
    if pass_ == "forward":
        *_, s, dim, dv = _dims(node, pass_)  # heads_inner's layouts: only _cooperative has them
        if cooperative(dim, dv, s, caps):
            return _cooperative(node, caps)
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
    inner_q, inner_k = heads_inner(node)[:2]
    *lead, h, length, dim = q.shape
    *_, hkv, s, _ = k.shape
    if inner_q:
        h, length = length, h
    if inner_k:
        hkv, s = s, hkv
    dv = node.inputs[2].shape[-1] if pass_ == "forward" else 0
    return int(np.prod(lead, dtype=np.int64)), h, hkv, length, s, dim, dv


def heads_inner(node: Tensor) -> tuple[bool, bool, bool, bool]:
    """For q, k, v and the output: whether it lies (..., rows, heads, width), as the heads'
    projections and their merge do, instead of (..., heads, rows, width): where the kernel
    replaces a composition (ops/attention.py), it reads and writes those directly rather than
    through the heads' transposes."""
    return node.attrs.get("heads_inner", (False, False, False, False))


def _row(inner: bool, heads: int, rows: int, bh: str, row: str) -> str:
    """WGSL: the index, in rows of one head's width, of row `row` of head `bh` (batch x heads +
    head) of a tensor laid out as `heads_inner` says."""
    if not inner:
        return f"({bh} * {rows}u + {row})"
    return f"((({bh}) / {heads}u * {rows}u + {row}) * {heads}u + ({bh}) % {heads}u)"


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


COOP_SUBGROUPS, COOP_KEYS = 4, 64  # a workgroup: 4 subgroups of 16 query rows; keys a tile
COOP_PAD, COOP_SCORES = 8, 20  # f16 added to staged rows; f32 a row of a subgroup's S^T
# The most keys the cooperative kernel takes: each workgroup runs its tiles of keys one after
# another (twice), which over long sequences (Whisper's 1500 keys) is slower than the
# composition, and over short ones (SmolLM2's 128, SmolVLA's 50 and 16) faster.
COOP_MAX_KEYS = 256
MASKED = -3.4028235e38  # a masked score; a row's running max starts at -1e30, above it


def _coop_layout(dim: int, dv: int) -> dict[str, int]:
    """Row strides (elements) and sizes of the cooperative kernel's workgroup arrays: Ks, Vs the
    key and value tiles (f16, as in memory), Ss each subgroup's S^T (f32: keys x its 16 rows),
    Ps each subgroup's P (f16: rows x keys), which first holds Q^T (dim x the block's rows)."""
    block = 16 * COOP_SUBGROUPS
    strides = {"k": dim + COOP_PAD, "v": dv + COOP_PAD, "s": COOP_SCORES,
               "p": COOP_KEYS + COOP_PAD, "qt": block + COOP_PAD}
    sizes = {"Ks": COOP_KEYS * strides["k"], "Vs": COOP_KEYS * strides["v"],
             "Ss": COOP_SUBGROUPS * COOP_KEYS * COOP_SCORES,
             "Ps": max(block * strides["p"], dim * strides["qt"])}
    return {**strides, **sizes, "bytes": 2 * (sizes["Ks"] + sizes["Vs"] + sizes["Ps"])
            + 4 * sizes["Ss"]}


def cooperative(dim: int, dv: int, keys: int, caps: Capabilities) -> bool:
    """Whether the forward pass of attention with q/k width `dim`, v width `dv` over `keys`
    keys runs on cooperative matrices: at precision "f16" or "bf16" on a device with them,
    32-wide subgroups (two threads a row of each subgroup's 16), head widths in whole
    fragments, at most COOP_MAX_KEYS keys, and the tiles within workgroup memory."""
    return (caps.f16_products == "cooperative"
            and caps.subgroup_size == 32 and dim % 16 == 0 and dv % 16 == 0
            and 32 * COOP_SUBGROUPS <= min(caps.max_workgroup_invocations,
                                           caps.max_workgroup_size[0])
            and keys <= COOP_MAX_KEYS
            and _coop_layout(dim, dv)["bytes"] <= caps.max_shared_memory_bytes)


def _cooperative(node: Tensor, caps: Capabilities) -> Kernel:
    """The forward pass on cooperative matrices (see the module's docstring). Subgroup sg takes
    query rows first + 16 sg ..; of its 32 threads, thread lane takes row lane % 16 and the keys
    of parity lane / 16 of each tile in the softmax."""
    batch, h, hkv, length, s, dim, dv = _dims(node, "forward")
    rep, causal, scale = h // hkv, node.attrs["causal"], node.attrs["scale"]
    inner_q, inner_k, inner_v, inner_out = heads_inner(node)
    lay = _coop_layout(dim, dv)
    ks, vs, ss, ps, qts = lay["k"], lay["v"], lay["s"], lay["p"], lay["qt"]
    block, threads, keys = 16 * COOP_SUBGROUPS, 32 * COOP_SUBGROUPS, COOP_KEYS
    blocks, d4, v4 = -(-length // block), dim // 4, dv // 4
    check_loop(node, caps, -(-s // keys),
               "use scaled_dot_product_attention(..., fused=False) on this device")
    prelude = ["enable f16;", "enable wgpu_cooperative_matrix;",
               *[f"var<workgroup> {name}: array<{'f32' if name == 'Ss' else 'f16'}, "
                 f"{lay[name]}>;" for name in ("Ks", "Vs", "Ss", "Ps")]]

    def rounds(width: int) -> list[tuple[int, bool]]:  # (first element, past the tile's end?)
        return [(r * threads, (r + 1) * threads > keys * width)
                for r in range(-(-keys * width // threads))]

    def fetch(name: str, width: int, tile: str) -> list[str]:
        """The tile of k or v rows from key `tile` on into this thread's registers, four
        elements a read; rows past the keys as zeros. Fetched a tile ahead, so the reads'
        latency overlaps the tile before."""
        at_row = _row(inner_k if name == "k" else inner_v, hkv, s, "kv", "j")
        return [f"    {{ let e = lid + {at}u; let j = {tile} + e / {width}u; {name}x{r} = "
                f"vec4<f32>(); if ({f'e < {keys * width}u && ' if partial else ''}j < {s}u) "
                f"{{ {name}x{r} = {name}[{at_row} * {width}u + e % {width}u]; }} }}"
                for r, (at, partial) in enumerate(rounds(width))]

    def stage(name: str, width: int, stride: int) -> list[str]:
        """The fetched tile into workgroup memory as f16, rows as in memory."""
        lines = []
        for r, (at, partial) in enumerate(rounds(width)):
            lines += [f"    {{ let e = lid + {at}u;" + (f" if (e < {keys * width}u) {{"
                                                         if partial else " {"),
                      f"      let h = vec4<f16>({name}x{r}); let at = (e / {width}u) * "
                      f"{stride}u + (e % {width}u) * 4u;",
                      *[f"      {name.upper()}s[at + {c}u] = h.{'xyzw'[c]};" for c in range(4)],
                      "    } }"]
        return lines

    def scores() -> list[str]:  # S^T = K Q^T for the tile, into the subgroup's Ss
        lines = []
        for jf in range(keys // 16):
            lines.append(f"    var st{jf} = coop_mat16x16<f32, C>();")
            for df in range(dim // 16):
                lines += [f"    st{jf} = coopMultiplyAdd(coopLoadT<coop_mat16x16<f16, A>>("
                          f"&Ks[{16 * jf * ks + 16 * df}u], {ks}u), qf{df}, st{jf});"]
            lines.append(f"    coopStoreT(st{jf}, &Ss[sgs + {16 * jf * ss}u], {ss}u);")
        return lines

    def score(c: int) -> str:  # this thread's c-th score of the tile, or the mask's value
        key = f"{2 * c}u + parity"
        return f"select({MASKED}, Ss[sgs + ({key}) * {ss}u + row], t0 + {key} < seen)"

    def passes(body: list[str], values: bool) -> list[str]:
        tensors = [("k", d4, ks), *([("v", v4, vs)] if values else [])]
        return [*[line for name, width, _ in tensors for line in fetch(name, width, "0u")],
                f"  for (var t0 = 0u; t0 < kstop; t0 += {keys}u) {{",
                "    workgroupBarrier();",  # the previous tile's reads are done
                *[line for t in tensors for line in stage(*t)],
                *[line for name, width, _ in tensors
                  for line in fetch(name, width, f"t0 + {keys}u")],
                "    workgroupBarrier();", *scores(), "    workgroupBarrier();", *body, "  }"]

    per_thread = keys // 2
    top = "m"
    for c in range(per_thread):
        top = f"max({top}, sc{c})"
    first_pass = [*[f"    let sc{c} = {score(c)};" for c in range(per_thread)],
                  f"    let mn = {top};",
                  "    l = l * exp(m - mn) + " + " + ".join(
                      f"exp(sc{c} - mn)" for c in range(per_thread)) + "; m = mn;"]
    second_pass = [*[f"    Ps[sgp + row * {ps}u + {2 * c}u + parity] = "
                     f"f16(exp({score(c)} - top) * inv);" for c in range(per_thread)],
                   "    workgroupBarrier();"]
    for jf in range(keys // 16):
        second_pass.append(f"    {{ let pa = coopLoadT<coop_mat16x16<f16, A>>("
                           f"&Ps[sgp + {16 * jf}u], {ps}u);")
        second_pass += [f"      o{ef} = coopMultiplyAdd(pa, coopLoadT<coop_mat16x16<f16, B>>("
                        f"&Vs[{16 * jf * vs + 16 * ef}u], {vs}u), o{ef});"
                        for ef in range(dv // 16)]
        second_pass.append("    }")
    lines = [f"fn main({ENTRY_ARGS}) {{",
             f"  let wg = {LINEAR_WORKGROUP};",
             f"  if (wg >= {batch * h * blocks}u) {{ return; }}",
             f"  let bh = wg / {blocks}u; let first = (wg % {blocks}u) * {block}u;",
             f"  let kv = (bh / {h}u) * {hkv}u + (bh % {h}u) / {rep}u;",
             "  let sg = lid / 32u; let row = lid % 16u; let parity = (lid / 16u) % 2u;",
             f"  let sgs = sg * {keys * ss}u; let sgp = sg * {16 * ps}u;",
             "  let i = first + sg * 16u + row;",
             f"  let seen = {f'min(i + 1u, {s}u)' if causal else f'{s}u'};",
             f"  let kstop = {f'min(first + {block}u, {s}u)' if causal else f'{s}u'};"]
    q_row = _row(inner_q, h, length, "bh", "first + qi")
    for r in range(-(-block * d4 // threads)):  # Q^T, scaled, into Ps
        lines += [f"  {{ let e = lid + {r * threads}u; let qi = e % {block}u; "
                  f"let c = e / {block}u;",
                  f"    if (e < {block * d4}u) {{ var x = vec4<f32>();",
                  f"      if (first + qi < {length}u) {{ x = q[{q_row} * {d4}u + c] * "
                  f"{scale!r}; }}",
                  "      let h = vec4<f16>(x);",
                  *[f"      Ps[(c * 4u + {j}u) * {qts}u + qi] = h.{'xyzw'[j]};"
                    for j in range(4)],
                  "  } }"]
    lines += ["  workgroupBarrier();",
              *[f"  let qf{df} = coopLoadT<coop_mat16x16<f16, B>>(&Ps[{16 * df * qts}u + "
                f"sg * 16u], {qts}u);" for df in range(dim // 16)],
              # masked scores lie far below the start of the max: their exponentials are 0
              "  var m = -1e30; var l = 0.0;",
              *[f"  var {name}x{r} = vec4<f32>();" for name, width in (("k", d4), ("v", v4))
                for r in range(len(rounds(width)))],
              *passes(first_pass, values=False),
              # the row's two threads' maxima and sums, through Ss: every read of it is done
              "  workgroupBarrier();",
              f"  Ss[lid] = m; Ss[lid + {threads}u] = l;",
              "  workgroupBarrier();",
              "  let mo = Ss[lid ^ 16u]; let top = max(m, mo);",
              f"  let total = l * exp(m - top) + Ss[(lid ^ 16u) + {threads}u] * exp(mo - top);",
              "  let inv = 1.0 / total;",
              *[f"  var o{ef} = coop_mat16x16<f32, C>();" for ef in range(dv // 16)],
              *passes(second_pass, values=True)]
    def out_row(row: str) -> str:
        return _row(inner_out, h, length, "bh", row)
    direct = [f"    coopStoreT(o{ef}, &out[{out_row('first + sg * 16u')} * {dv}u + {16 * ef}u], "
              f"{dv * (h if inner_out else 1)}u);" for ef in range(dv // 16)]
    through = []
    for ef in range(dv // 16):
        through += ["    workgroupBarrier();", f"    coopStoreT(o{ef}, &Ss[sgs], 16u);",
                    "    workgroupBarrier();",
                    "    for (var e = lid % 32u; e < 256u; e += 32u) {",
                    "      let qi = first + sg * 16u + e / 16u;",
                    f"      if (qi < {length}u) {{ out[{out_row('qi')} * {dv}u + "
                    f"{16 * ef}u + e % 16u] = Ss[sgs + e]; }}", "    }"]
    lines += [f"  if (first + {block}u <= {length}u) {{", *direct, "  } else {", *through,
              "  }", "}"]
    buffers = [Buf(n, "vec4<f32>") for n in BINDINGS["forward"]] + [Buf("out", writable=True)]
    return assemble(f"{node.op}_{'x'.join(map(str, node.inputs[0].shape))}_{s}_c", caps,
                    buffers, (threads,), lines, grid(batch * h * blocks, caps),
                    prelude=prelude, **_estimates(node, "forward"))
