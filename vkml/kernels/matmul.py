"""Tiled matmul archetype: C = op(A) @ op(B), 16x16 threads, each holding a TM x TN register
tile of scalar accumulators (generated unrolled: a dynamically indexed local array would live in
slow local memory, FACTS.md), A and B tiles staged through workgroup memory."""

from __future__ import annotations

from ..backend import Capabilities
from ..graph import Tensor
from . import Kernel
from .common import storage

THREADS = 16  # per side of the workgroup
BK = 16  # depth of a staged tile


def _register_tile(m: int, n: int) -> tuple[int, int]:
    """Larger register tiles reuse each loaded value more; small matrices would waste threads."""
    def pick(extent: int) -> int:
        return 4 if extent >= 64 else 2 if extent >= 32 else 1
    return pick(m), pick(n)


def generate(node: Tensor, caps: Capabilities) -> Kernel:
    a, b = node.inputs
    ta, tb = node.attrs["transpose_a"], node.attrs["transpose_b"]
    m, n = node.shape
    k = a.shape[0] if ta else a.shape[1]
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
        a_load = load("As", "mat_a", bm * BK, "kk", "mm", bm, f"gk * {m}u + gm", a_guard, a_place)
    else:
        a_load = load("As", "mat_a", bm * BK, "mm", "kk", BK, f"gm * {k}u + gk", a_guard, a_place)
    if tb:  # B stored (N, K)
        b_load = load("Bs", "mat_b", bn * BK, "nn", "kk", BK, f"gn * {k}u + gk", b_guard, b_place)
    else:
        b_load = load("Bs", "mat_b", bn * BK, "kk", "nn", bn, f"gk * {n}u + gn", b_guard, b_place)

    acc = [[f"c{i}_{j}" for j in range(tn)] for i in range(tm)]
    lines = [storage(0, "mat_a"), storage(1, "mat_b"), storage(2, "mat_c", writable=True),
             f"var<workgroup> As: array<f32, {BK * bm}>;",
             f"var<workgroup> Bs: array<f32, {BK * bn}>;",
             f"@compute @workgroup_size({THREADS}, {THREADS})",
             "fn main(@builtin(local_invocation_id) lid: vec3<u32>, "
             "@builtin(workgroup_id) wid: vec3<u32>) {",
             f"  let tx = lid.x; let ty = lid.y; let tid = ty * {THREADS}u + tx;",
             f"  let row0 = wid.y * {bm}u; let col0 = wid.x * {bn}u;",
             *[f"  var {c} = 0.0;" for row in acc for c in row],
             f"  for (var k0 = 0u; k0 < {k}u; k0 += {BK}u) {{",
             *a_load, *b_load,
             "    workgroupBarrier();",
             f"    for (var q = 0u; q < {BK}u; q++) {{",
             *[f"      let a{i} = As[q * {bm}u + ty + {THREADS * i}u];" for i in range(tm)],
             *[f"      let b{j} = Bs[q * {bn}u + tx + {THREADS * j}u];" for j in range(tn)],
             *[f"      {acc[i][j]} = fma(a{i}, b{j}, {acc[i][j]});"
               for i in range(tm) for j in range(tn)],
             "    }",
             "    workgroupBarrier();",
             "  }"]
    for i in range(tm):
        for j in range(tn):
            row, col = f"row0 + ty + {THREADS * i}u", f"col0 + tx + {THREADS * j}u"
            store = f"mat_c[({row}) * {n}u + {col}] = {acc[i][j]};"
            conds = [c for c, need in ((f"{row} < {m}u", m % bm), (f"{col} < {n}u", n % bn))
                     if need]
            lines.append(f"  if ({' && '.join(conds)}) {{ {store} }}" if conds else f"  {store}")
    lines.append("}")
    groups = (-(-n // bn), -(-m // bm), 1)
    tag = ("t" if ta else "n") + ("t" if tb else "n")
    return Kernel(name=f"matmul_{tag}_{m}x{n}x{k}", wgsl="\n".join(lines) + "\n",
                  writable=(False, False, True), groups=groups)
