"""Convolution archetype (NCHW, PyTorch's layouts), direct kernels over the im2col index map (the
patch matrix is never materialised); the kernel window is unrolled from Python, bounds checks
stand for the zero padding.
- conv2d: one thread per output element, summing channels-in-group x window.
- conv2d_input_grad (a transposed convolution): one thread per input element, summing the
  output positions whose window covers it (divisibility by the stride checked per tap).
- conv2d_weight_grad: one workgroup per weight element, its threads splitting batch x output
  pixels, then a tree reduction (deterministic).
- max_pool2d and its backward, which recomputes each covering window's first maximum.
Not yet the register-tiled implicit GEMM of the matmul archetype; these are correct, simple and
memory-bound."""

from __future__ import annotations

from ..backend import Capabilities
from ..graph import Tensor
from . import Kernel
from .common import ENTRY_ARGS, LINEAR_WORKGROUP, grid, storage, tree_reduce, unflatten

WORKGROUP = 64


def _elementwise(node: Tensor, caps: Capabilities, body: list[str], helpers: list[str] = ()
                 ) -> Kernel:
    lines = [*helpers, *[storage(k, f"in{k}") for k in range(len(node.inputs))],
             storage(len(node.inputs), "out", writable=True),
             f"@compute @workgroup_size({WORKGROUP})", f"fn main({ENTRY_ARGS}) {{",
             f"  let idx = ({LINEAR_WORKGROUP}) * {WORKGROUP}u + lid;",
             f"  if (idx >= {node.size}u) {{ return; }}",
             *unflatten("idx", node.shape, "i"), *body, "}"]
    return Kernel(name=f"{node.op}_{'x'.join(map(str, node.shape))}",
                  wgsl="\n".join(lines) + "\n", writable=(False,) * len(node.inputs) + (True,),
                  groups=grid(-(-node.size // WORKGROUP), caps))


def _params(node: Tensor):
    a = node.attrs
    return a["stride"], a["padding"], a["dilation"], a["groups"]


def _conv2d(node: Tensor, caps: Capabilities) -> Kernel:
    x, w = node.inputs
    _, c, h, wd = x.shape
    o, cpg, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw), groups = _params(node)
    opg = o // groups
    body = [f"  let g = i1 / {opg}u;", "  var acc = 0.0;",
            f"  for (var c = 0u; c < {cpg}u; c++) {{",
            f"    let xb = (i0 * {c}u + g * {cpg}u + c) * {h * wd}u;",
            f"    let wb = (i1 * {cpg}u + c) * {kh * kw}u;"]
    for ki in range(kh):
        for kj in range(kw):
            body.append(f"    {{ let y = i32(i2 * {sh}u) + {ki * dh - ph}; "
                        f"let x = i32(i3 * {sw}u) + {kj * dw - pw}; "
                        f"if (y >= 0 && y < {h} && x >= 0 && x < {wd}) {{ "
                        f"acc = fma(in0[xb + u32(y * {wd} + x)], in1[wb + {ki * kw + kj}u], acc);"
                        " } }")
    return _elementwise(node, caps, [*body, "  }", "  out[idx] = acc;"])


def _tap(coord: str, offset: int, stride: int, extent: int, name: str) -> tuple[str, str]:
    """The output coordinate `name` whose window tap at `offset` lands on input `coord`."""
    num = f"(i32({coord}) + {offset})"
    if stride == 1:
        return f"let {name} = {num};", f"{name} >= 0 && {name} < {extent}"
    return (f"let {name}n = {num}; let {name} = {name}n / {stride};",
            f"{name}n >= 0 && {name}n % {stride} == 0 && {name} < {extent}")


def _conv2d_input_grad(node: Tensor, caps: Capabilities) -> Kernel:
    d, w = node.inputs
    _, o, oh, ow = d.shape
    _, cpg, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw), groups = _params(node)
    opg = o // groups
    body = [f"  let g = i1 / {cpg}u; let cl = i1 % {cpg}u;", "  var acc = 0.0;",
            f"  for (var ol = 0u; ol < {opg}u; ol++) {{",
            f"    let oc = g * {opg}u + ol;",
            f"    let db = (i0 * {o}u + oc) * {oh * ow}u;",
            f"    let wb = (oc * {cpg}u + cl) * {kh * kw}u;"]
    for ki in range(kh):
        for kj in range(kw):
            ly, cy = _tap("i2", ph - ki * dh, sh, oh, "y")
            lx, cx = _tap("i3", pw - kj * dw, sw, ow, "x")
            body.append(f"    {{ {ly} {lx} if ({cy} && {cx}) {{ "
                        f"acc = fma(in0[db + u32(y * {ow} + x)], in1[wb + {ki * kw + kj}u], acc);"
                        " } }")
    return _elementwise(node, caps, [*body, "  }", "  out[idx] = acc;"])


def _conv2d_weight_grad(node: Tensor, caps: Capabilities) -> Kernel:
    x, d = node.inputs
    n, c, h, wd = x.shape
    _, o, oh, ow = d.shape
    _, cpg, kh, kw = node.shape
    (sh, sw), (ph, pw), (dh, dw), groups = _params(node)
    opg = o // groups
    count = node.size
    lines = [storage(0, "in0"), storage(1, "in1"), storage(2, "out", writable=True),
             f"var<workgroup> partial: array<f32, {WORKGROUP}>;",
             f"@compute @workgroup_size({WORKGROUP})", f"fn main({ENTRY_ARGS}) {{",
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
    return Kernel(name=f"conv2d_weight_grad_{'x'.join(map(str, node.shape))}",
                  wgsl="\n".join(lines) + "\n", writable=(False, False, True),
                  groups=grid(count, caps))


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


def _max_pool2d(node: Tensor, caps: Capabilities) -> Kernel:
    (x,) = node.inputs
    _, c, h, wd = x.shape
    (_, kw), (sh, sw), (ph, pw) = node.attrs["kernel"], node.attrs["stride"], node.attrs["padding"]
    body = [f"  let base = (i0 * {c}u + i1) * {h * wd}u;",
            "  let at = window_argmax(base, i32(i2), i32(i3));",
            f"  let y = i32(i2) * {sh} - {ph} + at / {kw};",
            f"  let x = i32(i3) * {sw} - {pw} + at % {kw};",
            f"  out[idx] = in0[base + u32(y * {wd} + x)];"]
    return _elementwise(node, caps, body, [_window_max(x, node.attrs)])


def _max_pool2d_backward(node: Tensor, caps: Capabilities) -> Kernel:
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
    return _elementwise(node, caps, [*body, "  out[idx] = acc;"], [_window_max(x, node.attrs)])


GENERATORS = {"conv2d": _conv2d, "conv2d_input_grad": _conv2d_input_grad,
              "conv2d_weight_grad": _conv2d_weight_grad, "max_pool2d": _max_pool2d,
              "max_pool2d_backward": _max_pool2d_backward}


def generate(node: Tensor, caps: Capabilities) -> Kernel:
    return GENERATORS[node.op](node, caps)
