"""Convolution kernels for CPU drivers (lavapipe), where they beat the GEMM core's direct variant
3-10x on small convolutions (measured here: the core decodes (channel, ky, kx) from the flat
depth index at every multiply; these loop over channels and unroll the kernel taps from Python,
so the inner loop is loads and fmas).
- conv2d and conv2d_input_grad: register-tiled implicit GEMMs, rows = output (input) pixels,
  columns = output (input) channels of the group (grid z = group); a loop over the other
  channels of the group with the taps unrolled inside.
- conv2d_weight_grad: one workgroup per weight element, its threads splitting each image's
  output pixels (neighbouring threads, neighbouring pixels: lavapipe runs them as SIMD lanes,
  so their loads are contiguous), then a tree reduction (deterministic).
Their loops run channels, batch and pixels / 64 times: `handles` says whether those fit the
driver's loop limit; where not, the GEMM core's split variant is used instead."""

from __future__ import annotations

from vkml.graph import Tensor
from vkml.hal import Capabilities, Kernel
from vkml.kernels import conv
from vkml.kernels.common import (
    ENTRY_ARGS,
    LINEAR_WORKGROUP,
    assemble,
    grid,
    helper_functions,
    tree_reduce,
    unflatten,
)

WORKGROUP = 64


def handles(node: Tensor, caps: Capabilities) -> bool:
    """Whether this module's kernel for `node` keeps every loop within the device's limit."""
    limit = caps.max_loop_iterations
    if limit is None:
        return True
    op = conv.base_op(node)
    if op == "conv2d":
        loops = [node.inputs[1].shape[1]]  # input channels of a group
    elif op == "conv2d_input_grad":
        loops = [node.inputs[0].shape[1] // node.attrs["groups"]]  # output channels of a group
    else:
        n, _, oh, ow = node.inputs[1].shape
        loops = [n, -(-oh * ow // WORKGROUP)]
    return max(loops) <= limit


def _tile(extent: int, threads: int) -> int:
    """Register tile along one side: larger reuses each loaded value more; small extents would
    leave threads idle."""
    return 4 if extent >= 4 * threads else 2 if extent >= 2 * threads else 1


def _pow2_at_least(v: int, cap: int) -> int:
    p = 1
    while p < v and p < cap:
        p *= 2
    return p


def _implicit_gemm(node: Tensor, caps: Capabilities, m: int, ncols: int, groups: int,
                   rows: list[str], cols: list[str], k_loop: tuple[str, int, list[str]],
                   taps: list[tuple[list[str], str]], b_at: str, store: str) -> Kernel:
    """Register-tiled implicit GEMM, C[row, col] = sum_k A[row, k] B[k, col], per group (grid z).

    `rows`/`cols`: WGSL lines run per register-tile row i / column j (with {i} / {j} to fill in)
    that decode the clamped row `p{i}` / column `q{j}` into whatever the reads need ({i}, {j},
    {tap} are replaced textually, so WGSL braces need no escaping); `k_loop`:
    (variable, trip count, lines at the top of each trip); `taps`: per unrolled kernel tap, the
    lines computing `a{i}` (0.0 where the tap falls in the padding) and the tap's flat offset;
    `b_at`: the address of B for column j at the tap ({j}, {tap}); `store`: the statements
    storing accumulator `acc` for row i, column `col` ({i})."""
    tx = _pow2_at_least(ncols, 16)
    ty = 256 // tx
    tm, tn = _tile(m, ty), _tile(ncols, tx)
    bm, bn = tm * ty, tn * tx
    var, trips, k_head = k_loop
    lines = ["fn main(@builtin(local_invocation_id) lid: vec3<u32>, "
             "@builtin(workgroup_id) wid: vec3<u32>) {",
             "  let g = wid.z;",
             f"  let row0 = wid.y * {bm}u; let col0 = wid.x * {bn}u;"]
    for i in range(tm):  # edge rows/columns compute on a clamped (valid) index; not stored
        lines.append(f"  let p{i} = min(row0 + lid.y + {ty * i}u, {m - 1}u);")
        lines += [line.replace("{i}", str(i)) for line in rows]
    for j in range(tn):
        lines.append(f"  let q{j} = min(col0 + lid.x + {tx * j}u, {ncols - 1}u);")
        lines += [line.replace("{j}", str(j)) for line in cols]
    lines += [f"  var c{i}_{j} = 0.0;" for i in range(tm) for j in range(tn)]
    lines += [f"  for (var {var} = 0u; {var} < {trips}u; {var}++) {{", *k_head]
    for a_lines, tap in taps:
        lines.append("    {")
        for i in range(tm):
            lines += ["      " + line.replace("{i}", str(i)) for line in a_lines]
        for j in range(tn):
            at = b_at.replace("{j}", str(j)).replace("{tap}", tap)
            lines.append(f"      let b{j} = in1[{at}];")
        lines += [f"      c{i}_{j} = fma(a{i}, b{j}, c{i}_{j});"
                  for i in range(tm) for j in range(tn)]
        lines.append("    }")
    lines.append("  }")
    for i in range(tm):
        for j in range(tn):
            put = store.replace("{i}", str(i))
            lines += [f"  {{ let row = row0 + lid.y + {ty * i}u; let col = col0 + lid.x + "
                      f"{tx * j}u; let acc = c{i}_{j};",
                      f"    if (row < {m}u && col < {ncols}u) {{ {put} }} }}"]
    lines.append("}")
    return assemble(f"{node.op}_{'x'.join(map(str, node.shape))}", caps, conv.buffers(node),
                    (tx, ty), lines, (-(-ncols // bn), -(-m // bm), groups),
                    prelude=helper_functions(conv.epilogue(node)),
                    flops=2 * m * ncols * groups * trips * len(taps),
                    nbytes=4 * (sum(x.size for x in node.inputs) + node.size))


def _store(node: Tensor, at: str, index: str) -> str:
    """The statements storing `acc` at flat index `at` through the node's epilogue, whose
    inputs are read at the output indices i0..i3 that `index` defines."""
    return " ".join(line.strip() for line in conv.epilogue_store(node, [index], "acc",
                                                                 f"out[{at}] ="))


def generate_conv2d(node: Tensor, caps: Capabilities) -> Kernel:
    """Rows: output pixels (n, oy, ox); columns: output channels of the group; k: input channels
    of the group (a loop) x kernel taps (unrolled)."""
    x, w = node.inputs[:2]
    _, c, h, wd = x.shape
    o, cpg, kh, kw = w.shape
    _, _, oh, ow = node.shape
    (sh, sw), (ph, pw), (dh, dw), groups = conv.params(node)
    opg = o // groups
    rows = [f"  let n{{i}} = p{{i}} / {oh * ow}u; let r{{i}} = p{{i}} % {oh * ow}u;",
            f"  let y{{i}} = i32(r{{i}} / {ow}u * {sh}u) - {ph}; "
            f"let x{{i}} = i32(r{{i}} % {ow}u * {sw}u) - {pw};",
            f"  let xb{{i}} = (n{{i}} * {c}u + g * {cpg}u) * {h * wd}u;"]
    cols = [f"  let wb{{j}} = (g * {opg}u + q{{j}}) * {cpg * kh * kw}u;"]
    k_head = [f"    let xc = ci * {h * wd}u; let wc = ci * {kh * kw}u;"]
    taps = []
    for ki in range(kh):
        for kj in range(kw):
            taps.append(([f"let y{{i}}t = y{{i}} + {ki * dh}; let x{{i}}t = x{{i}} + {kj * dw};",
                          "var a{i} = 0.0;",
                          f"if (y{{i}}t >= 0 && y{{i}}t < {h} && x{{i}}t >= 0 && x{{i}}t < {wd}) "
                          f"{{ a{{i}} = in0[xb{{i}} + xc + u32(y{{i}}t * {wd} + x{{i}}t)]; }}"],
                         str(ki * kw + kj)))
    store = _store(node, f"(n{{i}} * {o}u + g * {opg}u + col) * {oh * ow}u + r{{i}}",
                   f"let i0 = n{{i}}; let i1 = g * {opg}u + col; let i2 = r{{i}} / {ow}u; "
                   f"let i3 = r{{i}} % {ow}u;")
    return _implicit_gemm(node, caps, node.shape[0] * oh * ow, opg, groups, rows, cols,
                          ("ci", cpg, k_head), taps, "wb{j} + wc + {tap}u", store)


def generate_conv2d_input_grad(node: Tensor, caps: Capabilities) -> Kernel:
    """The transposed convolution. Rows: input pixels (n, y, x); columns: input channels of the
    group; k: output channels of the group (a loop) x kernel taps (unrolled), a tap counting
    where the stride divides the distance from the output position."""
    d, w = node.inputs[:2]
    _, o, oh, ow = d.shape
    _, cpg, kh, kw = w.shape
    n, c, h, wd = node.shape
    (sh, sw), (ph, pw), (dh, dw), groups = conv.params(node)
    opg = o // groups
    rows = [f"  let n{{i}} = p{{i}} / {h * wd}u; let r{{i}} = p{{i}} % {h * wd}u;",
            f"  let y{{i}} = r{{i}} / {wd}u; let x{{i}} = r{{i}} % {wd}u;",
            f"  let db{{i}} = (n{{i}} * {o}u + g * {opg}u) * {oh * ow}u;"]
    cols = [f"  let wb{{j}} = (g * {opg * cpg}u + q{{j}}) * {kh * kw}u;"]
    k_head = [f"    let dc = ol * {oh * ow}u; let wc = ol * {cpg * kh * kw}u;"]
    taps = []
    for ki in range(kh):
        for kj in range(kw):
            ly, cy = conv.tap("y{i}", ph, sh, oh, "v{i}", f"{ki}u", dh)
            lx, cx = conv.tap("x{i}", pw, sw, ow, "u{i}", f"{kj}u", dw)
            taps.append(([ly, lx, "var a{i} = 0.0;",
                          f"if ({cy} && {cx}) {{ a{{i}} = in0[db{{i}} + dc + "
                          f"u32(v{{i}} * {ow} + u{{i}})]; }}"], str(ki * kw + kj)))
    store = _store(node, f"(n{{i}} * {c}u + g * {cpg}u + col) * {h * wd}u + r{{i}}",
                   f"let i0 = n{{i}}; let i1 = g * {cpg}u + col; let i2 = y{{i}}; "
                   f"let i3 = x{{i}};")
    return _implicit_gemm(node, caps, n * h * wd, cpg, groups, rows, cols, ("ol", opg, k_head),
                          taps, "wb{j} + wc + {tap}u", store)


def generate_conv2d_weight_grad(node: Tensor, caps: Capabilities) -> Kernel:
    x, d = node.inputs
    n, c, h, wd = x.shape
    _, o, oh, ow = d.shape
    _, cpg, kh, kw = node.shape
    (sh, sw), (ph, pw), (dh, dw), groups = conv.params(node)
    opg = o // groups
    count = node.size
    lines = [f"fn main({ENTRY_ARGS}) {{",
             f"  let e = {LINEAR_WORKGROUP};",
             "  var acc = 0.0;",
             f"  if (e < {count}u) {{",  # surplus workgroups skip the loads but join the barriers
             *["  " + line for line in unflatten("e", node.shape, "i")],
             f"    let g = i0 / {opg}u;",
             f"    let ci = g * {cpg}u + i1;",
             f"    for (var b = 0u; b < {n}u; b++) {{",
             f"    for (var p = lid; p < {oh * ow}u; p += {WORKGROUP}u) {{",
             f"      let oy = p / {ow}u; let ox = p % {ow}u;",
             f"      let y = i32(oy * {sh}u + i2 * {dh}u) - {ph};",
             f"      let x = i32(ox * {sw}u + i3 * {dw}u) - {pw};",
             f"      if ({conv.inside('y', 'x', h, wd)}) {{",
             f"        acc = fma(in0[(b * {c}u + ci) * {h * wd}u + u32(y * {wd} + x)], "
             f"in1[(b * {o}u + i0) * {oh * ow}u + p], acc);",
             "      }", "    }", "    }", "  }",
             "  partial[lid] = acc;",
             *tree_reduce("partial", WORKGROUP, "{a} + {b}"),
             f"  if (lid == 0u && e < {count}u) {{ out[e] = partial[0]; }}", "}"]
    return assemble(f"conv2d_weight_grad_{'x'.join(map(str, node.shape))}", caps,
                    conv.buffers(node), (WORKGROUP,), lines, grid(count, caps),
                    prelude=[f"var<workgroup> partial: array<f32, {WORKGROUP}>;"],
                    flops=2 * count * n * oh * ow,
                    nbytes=4 * (x.size + d.size + count))
