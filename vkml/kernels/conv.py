"""Convolution archetype (NCHW, PyTorch's layouts), over the im2col index map (the patch matrix
is never materialised); kernel taps are unrolled from Python, bounds checks stand for the zero
padding.
- conv2d: register-tiled implicit GEMM, rows = output pixels (n, oy, ox), columns = output
  channels of the group (grid z = group), k = input channels of the group x taps.
- conv2d_input_grad (a transposed convolution): the same implicit GEMM, rows = input pixels,
  columns = input channels of the group, k = output channels x taps (a tap counts where the
  stride divides the distance).
- conv2d_weight_grad: one workgroup per weight element, its threads splitting batch x output
  pixels (the GEMM's long k), then a tree reduction (deterministic).
- max_pool2d and its backward, which recomputes each covering window's first maximum.
Operands are read straight from memory into registers (each value reused across the register
tile); not yet staged through workgroup memory or cooperative matrices."""

from __future__ import annotations

from vkml.graph import Tensor
from vkml.hal import Capabilities, Kernel
from vkml.kernels import gather
from vkml.kernels.common import (
    ENTRY_ARGS,
    LINEAR_WORKGROUP,
    Buf,
    assemble,
    grid,
    tree_reduce,
    unflatten,
)

WORKGROUP = 64


def _buffers(node: Tensor) -> list[Buf]:
    """The inputs in order, then the output."""
    return [*[Buf(f"in{k}") for k in range(len(node.inputs))], Buf("out", writable=True)]


def _params(node: Tensor):
    a = node.attrs
    return a["stride"], a["padding"], a["dilation"], a["groups"]


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
    `b_at`: the address of B for column j at the tap ({j}, {tap}); `store`: the statement storing
    accumulator `acc` for row i, column `col` ({i})."""
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
    return assemble(f"{node.op}_{'x'.join(map(str, node.shape))}", caps, _buffers(node),
                    (tx, ty), lines, (-(-ncols // bn), -(-m // bm), groups),
                    flops=2 * m * ncols * groups * trips * len(taps),
                    nbytes=4 * (sum(x.size for x in node.inputs) + node.size))


def generate_conv2d(node: Tensor, caps: Capabilities) -> Kernel:
    """Rows: output pixels (n, oy, ox); columns: output channels of the group; k: input channels
    of the group (a loop) x kernel taps (unrolled)."""
    x, w = node.inputs
    _, c, h, wd = x.shape
    o, cpg, kh, kw = w.shape
    _, _, oh, ow = node.shape
    (sh, sw), (ph, pw), (dh, dw), groups = _params(node)
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
    store = (f"out[(n{{i}} * {o}u + g * {opg}u + col) * {oh * ow}u + r{{i}}] = acc;")
    return _implicit_gemm(node, caps, node.shape[0] * oh * ow, opg, groups, rows, cols,
                          ("ci", cpg, k_head), taps, "wb{j} + wc + {tap}u", store)


def generate_conv2d_input_grad(node: Tensor, caps: Capabilities) -> Kernel:
    """The transposed convolution. Rows: input pixels (n, y, x); columns: input channels of the
    group; k: output channels of the group (a loop) x kernel taps (unrolled), a tap counting
    where the stride divides the distance from the output position."""
    d, w = node.inputs
    _, o, oh, ow = d.shape
    _, cpg, kh, kw = w.shape
    n, c, h, wd = node.shape
    (sh, sw), (ph, pw), (dh, dw), groups = _params(node)
    opg = o // groups
    rows = [f"  let n{{i}} = p{{i}} / {h * wd}u; let r{{i}} = p{{i}} % {h * wd}u;",
            f"  let y{{i}} = i32(r{{i}} / {wd}u); let x{{i}} = i32(r{{i}} % {wd}u);",
            f"  let db{{i}} = (n{{i}} * {o}u + g * {opg}u) * {oh * ow}u;"]
    cols = [f"  let wb{{j}} = (g * {opg * cpg}u + q{{j}}) * {kh * kw}u;"]
    k_head = [f"    let dc = ol * {oh * ow}u; let wc = ol * {cpg * kh * kw}u;"]
    taps = []
    for ki in range(kh):
        for kj in range(kw):
            ly, cy = _tap("y{i}", ph - ki * dh, sh, oh, "v{i}")
            lx, cx = _tap("x{i}", pw - kj * dw, sw, ow, "u{i}")
            taps.append(([ly, lx, "var a{i} = 0.0;",
                          f"if ({cy} && {cx}) {{ a{{i}} = in0[db{{i}} + dc + "
                          f"u32(v{{i}} * {ow} + u{{i}})]; }}"], str(ki * kw + kj)))
    store = f"out[(n{{i}} * {c}u + g * {cpg}u + col) * {h * wd}u + r{{i}}] = acc;"
    return _implicit_gemm(node, caps, n * h * wd, cpg, groups, rows, cols, ("ol", opg, k_head),
                          taps, "wb{j} + wc + {tap}u", store)


def _tap(coord: str, offset: int, stride: int, extent: int, name: str) -> tuple[str, str]:
    """The output coordinate `name` whose window tap at `offset` lands on input `coord`."""
    num = f"(i32({coord}) + {offset})"
    if stride == 1:
        return f"let {name} = {num};", f"{name} >= 0 && {name} < {extent}"
    return (f"let {name}n = {num}; let {name} = {name}n / {stride};",
            f"{name}n >= 0 && {name}n % {stride} == 0 && {name} < {extent}")


def generate_conv2d_weight_grad(node: Tensor, caps: Capabilities) -> Kernel:
    x, d = node.inputs
    n, c, h, wd = x.shape
    _, o, oh, ow = d.shape
    _, cpg, kh, kw = node.shape
    (sh, sw), (ph, pw), (dh, dw), groups = _params(node)
    opg = o // groups
    count = node.size
    lines = [f"fn main({ENTRY_ARGS}) {{",
             f"  let e = {LINEAR_WORKGROUP};",
             "  var acc = 0.0;",
             f"  if (e < {count}u) {{",  # surplus workgroups skip the loads but join the barriers
             *["  " + line for line in unflatten("e", node.shape, "i")],
             f"    let g = i0 / {opg}u;",
             f"    let ci = g * {cpg}u + i1;",
             f"    for (var r = lid; r < {n * oh * ow}u; r += {WORKGROUP}u) {{",
             f"      let b = r / {oh * ow}u; let p = r % {oh * ow}u;",
             f"      let oy = p / {ow}u; let ox = p % {ow}u;",
             f"      let y = i32(oy * {sh}u + i2 * {dh}u) - {ph};",
             f"      let x = i32(ox * {sw}u + i3 * {dw}u) - {pw};",
             f"      if (y >= 0 && y < {h} && x >= 0 && x < {wd}) {{",
             f"        acc = fma(in0[(b * {c}u + ci) * {h * wd}u + u32(y * {wd} + x)], "
             f"in1[(b * {o}u + i0) * {oh * ow}u + p], acc);",
             "      }", "    }", "  }",
             "  partial[lid] = acc;",
             *tree_reduce("partial", WORKGROUP, "{a} + {b}"),
             f"  if (lid == 0u && e < {count}u) {{ out[e] = partial[0]; }}", "}"]
    return assemble(f"conv2d_weight_grad_{'x'.join(map(str, node.shape))}", caps,
                    _buffers(node), (WORKGROUP,), lines, grid(count, caps),
                    prelude=[f"var<workgroup> partial: array<f32, {WORKGROUP}>;"],
                    flops=2 * count * n * oh * ow,
                    nbytes=4 * (x.size + d.size + count))


def _window_max(x: Tensor, a: dict) -> str:
    """WGSL function: the flat window offset (ky * kw + kx) of the first maximum of the pooling
    window at output (oy, ox) of the plane starting at `base`, as PyTorch picks it."""
    _, _, h, wd = x.shape
    (kh, kw), (sh, sw), (ph, pw) = a["kernel"], a["stride"], a["padding"]
    lines = ["fn window_argmax(base: u32, oy: i32, ox: i32) -> i32 {",
             "  var best = -3.4028235e38; var at = -1;"]
    for ki in range(kh):
        for kj in range(kw):
            lines.append(f"  {{ let y = oy * {sh} + {ki - ph}; let x = ox * {sw} + {kj - pw}; "
                         f"if (y >= 0 && y < {h} && x >= 0 && x < {wd}) {{ "
                         f"let v = in0[base + u32(y * {wd} + x)]; "
                         f"if (v > best || at < 0) {{ best = v; at = {ki * kw + kj}; }} }} }}")
    return "\n".join([*lines, "  return at;", "}"])


def generate_max_pool2d(node: Tensor, caps: Capabilities) -> Kernel:
    (x,) = node.inputs
    _, c, h, wd = x.shape
    (_, kw), (sh, sw), (ph, pw) = node.attrs["kernel"], node.attrs["stride"], node.attrs["padding"]
    body = [f"  let base = (i0 * {c}u + i1) * {h * wd}u;",
            "  let at = window_argmax(base, i32(i2), i32(i3));",
            f"  let y = i32(i2) * {sh} - {ph} + at / {kw};",
            f"  let x = i32(i3) * {sw} - {pw} + at % {kw};",
            f"  out[idx] = in0[base + u32(y * {wd} + x)];"]
    return gather.generate(node, caps, body, [_window_max(x, node.attrs)],
                           flops=node.size * node.attrs["kernel"][0] * node.attrs["kernel"][1])


def generate_max_pool2d_backward(node: Tensor, caps: Capabilities) -> Kernel:
    x, d = node.inputs
    _, c, h, wd = x.shape
    _, _, oh, ow = d.shape
    (kh, kw), (sh, sw), (ph, pw) = node.attrs["kernel"], node.attrs["stride"], node.attrs["padding"]
    body = [f"  let base = (i0 * {c}u + i1) * {h * wd}u;",
            f"  let db = (i0 * {c}u + i1) * {oh * ow}u;", "  var acc = 0.0;"]
    for ki in range(kh):
        for kj in range(kw):
            ly, cy = _tap("i2", ph - ki, sh, oh, "y")
            lx, cx = _tap("i3", pw - kj, sw, ow, "x")
            body.append(f"  {{ {ly} {lx} if ({cy} && {cx}) {{ "
                        f"if (window_argmax(base, y, x) == {ki * kw + kj}) {{ "
                        f"acc += in1[db + u32(y * {ow} + x)]; }} }} }}")
    return gather.generate(node, caps, [*body, "  out[idx] = acc;"],
                           [_window_max(x, node.attrs)], flops=node.size * (kh * kw) ** 2)
