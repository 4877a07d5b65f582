"""Tiled matmul archetype: C = op(A) @ op(B), 16x16 threads, each holding a TM x TN register
tile of scalar accumulators (generated unrolled: a dynamically indexed local array would live in
slow local memory, FACTS.md), A and B tiles staged through workgroup memory."""

from __future__ import annotations

import numpy as np

from vkml.expr import Arg, Body, broadcast_strides
from vkml.graph import Tensor
from vkml.hal import Capabilities, Kernel
from vkml.kernels.common import Buf, assemble, body_lines, helper_functions, offset, unflatten

THREADS = 16  # per side of the workgroup
BK = 16  # depth of a staged tile


def _register_tile(m: int, n: int) -> tuple[int, int]:
    """Larger register tiles reuse each loaded value more; small matrices would waste threads."""
    def pick(extent: int) -> int:
        return 4 if extent >= 64 else 2 if extent >= 32 else 1
    return pick(m), pick(n)


def generate(node: Tensor, caps: Capabilities) -> Kernel:
    """Bindings: A, B, the epilogue's extra inputs, C. In the epilogue x0 is the accumulator."""
    a, b, *extras = node.inputs
    ta, tb = node.attrs["transpose_a"], node.attrs["transpose_b"]
    epilogue: Body = node.attrs.get("epilogue", Body(Arg(0), ((),)))
    *leading, m, n = node.shape
    k = a.shape[-2] if ta else a.shape[-1]
    # Batched: workgroup z is the flat batch index; each operand's batch offset follows numpy
    # broadcasting of its own leading dimensions (stride 0 where it is broadcast).
    rank = len(node.shape)
    names = [f"i{x}" for x in range(rank)]
    batch = int(np.prod(leading, dtype=np.int64))
    bases = []
    for src, x in (("a", a), ("b", b)):
        mat = x.shape[-2] * x.shape[-1]
        strides = broadcast_strides(x.shape[:-2], tuple(leading))
        bases.append(f"  let {src}_base = {offset(names[:-2], tuple(s * mat for s in strides))};")
    tm, tn = _register_tile(m, n)
    bm, bn = tm * THREADS, tn * THREADS
    threads = THREADS * THREADS

    def load(tile: str, src: str, count: int, slow: str, fast: str, fast_extent: int,
             at: str, guard: str, place: str) -> list[str]:
        # `fast` is the tile coordinate that is contiguous in the operand's stored layout, so
        # consecutive threads read consecutive addresses whichever way the operand is transposed.
        where = ("let gm = row0 + mm; let gk = k0 + kk;" if tile == "As"
                 else "let gn = col0 + nn; let gk = k0 + kk;")
        read = (f"var v = 0.0; if ({guard}) {{ v = {src}[{at}]; }}" if guard
                else f"let v = {src}[{at}];")
        return [f"    {{ let t = tid + {step * threads}u; let {slow} = t / {fast_extent}u; "
                f"let {fast} = t % {fast_extent}u; {where} {read} {tile}[{place}] = v; }}"
                for step in range(count // threads)]

    a_guard = " && ".join(c for c, need in ((f"gm < {m}u", m % bm), (f"gk < {k}u", k % BK)) if need)
    b_guard = " && ".join(c for c, need in ((f"gn < {n}u", n % bn), (f"gk < {k}u", k % BK)) if need)
    a_place, b_place = f"kk * {bm}u + mm", f"kk * {bn}u + nn"
    if ta:  # A stored (K, M)
        a_load = load("As", "mat_a", bm * BK, "kk", "mm", bm,
                      f"a_base + gk * {m}u + gm", a_guard, a_place)
    else:
        a_load = load("As", "mat_a", bm * BK, "mm", "kk", BK,
                      f"a_base + gm * {k}u + gk", a_guard, a_place)
    if tb:  # B stored (N, K)
        b_load = load("Bs", "mat_b", bn * BK, "nn", "kk", BK,
                      f"b_base + gn * {k}u + gk", b_guard, b_place)
    else:
        b_load = load("Bs", "mat_b", bn * BK, "kk", "nn", bn,
                      f"b_base + gk * {n}u + gn", b_guard, b_place)

    acc = [[f"c{i}_{j}" for j in range(tn)] for i in range(tm)]
    fmas = [f"      {acc[i][j]} = fma(a{i}, b{j}, {acc[i][j]});"
            for i in range(tm) for j in range(tn)]
    # A CPU driver (lavapipe) gains nothing from staging through workgroup memory, and its JIT
    # takes tens of seconds on the staged kernel's barriers: read operands directly there.
    staged = caps.device_type != "cpu"
    buffers = [Buf("mat_a"), Buf("mat_b"), *[Buf(f"ep{e + 1}") for e in range(len(extras))],
               Buf("mat_c", writable=True)]
    prelude = [*helper_functions(epilogue),
               *([f"var<workgroup> As: array<f32, {BK * bm}>;",
                  f"var<workgroup> Bs: array<f32, {BK * bn}>;"] if staged else [])]
    lines = ["fn main(@builtin(local_invocation_id) lid: vec3<u32>, "
             "@builtin(workgroup_id) wid: vec3<u32>) {",
             f"  let tx = lid.x; let ty = lid.y; let tid = ty * {THREADS}u + tx;",
             f"  let row0 = wid.y * {bm}u; let col0 = wid.x * {bn}u;",
             *unflatten("wid.z", tuple(leading), "i"), *bases,
             f"  let c_base = wid.z * {m * n}u;",
             *[f"  var {c} = 0.0;" for row in acc for c in row]]
    if staged:
        lines += [f"  for (var k0 = 0u; k0 < {k}u; k0 += {BK}u) {{",
                  *a_load, *b_load,
                  "    workgroupBarrier();",
                  f"    for (var q = 0u; q < {BK}u; q++) {{",
                  *[f"      let a{i} = As[q * {bm}u + ty + {THREADS * i}u];" for i in range(tm)],
                  *[f"      let b{j} = Bs[q * {bn}u + tx + {THREADS * j}u];" for j in range(tn)],
                  *fmas, "    }", "    workgroupBarrier();", "  }"]
    else:
        # Rows and columns past the edge read a clamped (valid) address; their sums are dropped.
        rows = [f"min(row0 + ty + {THREADS * i}u, {m - 1}u)" for i in range(tm)]
        cols = [f"min(col0 + tx + {THREADS * j}u, {n - 1}u)" for j in range(tn)]
        a_at = [f"a_base + gk * {m}u + {r}" if ta else f"a_base + {r} * {k}u + gk" for r in rows]
        b_at = [f"b_base + {c} * {k}u + gk" if tb else f"b_base + gk * {n}u + {c}" for c in cols]
        lines += [f"  for (var gk = 0u; gk < {k}u; gk++) {{",
                  *[f"    let a{i} = mat_a[{at}];" for i, at in enumerate(a_at)],
                  *[f"    let b{j} = mat_b[{at}];" for j, at in enumerate(b_at)],
                  *fmas, "  }"]
    for i in range(tm):
        for j in range(tn):
            row, col = f"row0 + ty + {THREADS * i}u", f"col0 + tx + {THREADS * j}u"
            ir, ic = names[-2], names[-1]
            conds = [c for c, need in ((f"{ir} < {m}u", m % bm), (f"{ic} < {n}u", n % bn))
                     if need]
            reads = {0: acc[i][j]} | {e: f"ep{e}[{offset(names, epilogue.strides[e])}]"
                                      for e in range(1, len(epilogue.strides))}
            lines += [f"  {{ let {ir} = {row}; let {ic} = {col};",
                      f"    if ({' && '.join(conds)}) {{" if conds else "    {",
                      *body_lines(epilogue, reads, "      ",
                                  f"mat_c[c_base + {ir} * {n}u + {ic}] ="),
                      "  } }"]
    lines.append("}")
    groups = (-(-n // bn), -(-m // bm), batch)
    tag = ("t" if ta else "n") + ("t" if tb else "n")
    prefix = f"b{'x'.join(map(str, leading))}_" if leading else ""
    return assemble(f"{node.op}_{tag}_{prefix}{m}x{n}x{k}", caps, buffers, (THREADS, THREADS),
                    lines, groups, prelude=prelude, flops=2 * batch * m * n * k,
                    nbytes=4 * (a.size + b.size + batch * m * n))
