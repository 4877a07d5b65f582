"""Convolution archetype (NCHW, PyTorch's layouts): the forward pass and both gradients as implicit
GEMMs on the GEMM core (vkml/kernels/gemm.py), reading the input through the im2col index map
(the patch matrix is never materialised; bounds checks stand for the zero padding). Grid z is the
group (and, for the weight gradient, the split of its long sum).
- conv2d: rows = output pixels (n, oy, ox), columns = output channels of the group,
  depth = input channels of the group x kernel taps.
- conv2d_input_grad (a transposed convolution): rows = input pixels, columns = input channels
  of the group, depth = output channels x taps (a tap counts where the stride divides the
  distance from the output position). Strided, on GPUs: one product per phase of the stride
  (the input pixels at one position modulo it) and tap that reaches it, each a partial sum, so
  no multiply meets a tap that does not count (3x3 at stride 2: 9 taps over 4 phases where
  each of the 4 took all 9; see `phased`).
- conv2d_weight_grad: rows = output channels of the group, columns = input channels x taps,
  depth = batch x output pixels; with `splits` > 1 it writes one partial sum per split of that
  depth (the graph sums them: ops/conv.py), so small weights with huge sums still fill a GPU.
- fused_conv2d, fused_conv2d_input_grad: the same with an epilogue body applied before the
  store (the rewrite stage moves batch norm's inference form, activations and residual adds
  there); inputs (the convolution's two, *the epilogue's), x0 the accumulator.
- max_pool2d and its backward, which recomputes each covering window's first maximum.
- conv2d over channels-last f16 operands (accelerated inference, `channels_last`): the input and
  the weight each copied by `generate_channels_last` into (N, H, W, C) and (O, KH, KW, C/groups)
  f16, channels padded to a multiple of 4, so a patch row (ky, kx, ci, ci fastest) runs along
  memory: the tiles read it four halves a load and stage it with no conversion, where the NCHW
  gather reads and converts an element at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from vkml.expr import Body
from vkml.graph import Tensor
from vkml.hal import Capabilities, Kernel
from vkml.kernels import gather, gemm
from vkml.kernels.common import (
    CHANNELS_LAST,
    Buf,
    assemble,
    body_lines,
    epilogue_reads,
    helper_functions,
    is_nan,
    result_store,
    split_index,
)


def buffers(node: Tensor, wide: tuple[bool, ...] = (), wide_out: bool = False) -> list[Buf]:
    """The inputs in order (the convolution's two bound as vec4 arrays where `wide`, see
    gemm.indexed, as vec4<f16> ones where channels-last; the epilogue's in their own dtype),
    then the output (a vec4 array where `wide_out`)."""
    half = [is_channels_last(node) and x.dtype == "i32" for x in node.inputs[:2]]  # copies
    return [*[Buf(f"in{k}", "vec4<f16>") if half[k]
              else gemm.binding(f"in{k}", k < len(wide) and wide[k]) for k in range(2)],
            *[Buf(f"in{k}", x.dtype) for k, x in enumerate(node.inputs[2:], 2)],
            Buf("out", "vec4<f32>", writable=True) if wide_out else result_store(node, "")[2]]


def base_op(node: Tensor) -> str:
    """The convolution a node computes, fused with an epilogue or not."""
    return node.op.removeprefix("fused_")


def epilogue(node: Tensor) -> Body | None:
    """What a fused convolution applies to each output before it stores it (None: unfused)."""
    return node.attrs.get("epilogue")


def epilogue_store(node: Tensor, index: list[str], acc: str, target: str,
                   indent: str = "      ") -> list[str]:
    """Lines storing accumulator `acc` through the node's epilogue into `target` (an `x =`
    style assignment): `index` are lines defining the output element's indices i0..i3, which
    the epilogue's inputs (bound as in2, in3, ...) are read at."""
    body = epilogue(node)
    if body is None:
        return [f"{indent}{target} {acc};"]
    reads = epilogue_reads(body, acc, [f"i{a}" for a in range(4)], lambda e: f"in{e + 1}")
    return [*(indent + line for line in index), *body_lines(body, reads, indent, target)]


def params(node: Tensor):
    a = node.attrs
    return a["stride"], a["padding"], a["dilation"], a["groups"]


def _split(index: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> str:
    return " ".join(split_index(index, sizes, names))


def inside(y: str, x: str, h: int, w: int) -> str:
    return f"{y} >= 0 && {y} < {h} && {x} >= 0 && {x} < {w}"


def _im2col(node: Tensor, x_shape, w_shape, pixel: str, tap: str) -> list[str]:
    """Lines setting `v` to the input element output pixel `pixel` (n, oy, ox) reads at kernel
    tap `tap` (input channel of group g, ky, kx), 0 in the padding: the implicit im2col matrix."""
    n, c, h, wd = x_shape
    _, cpg, kh, kw = w_shape
    (sh, sw), (ph, pw), (dh, dw), _ = params(node)
    oh, ow = (out_extent(h, kh, sh, ph, dh), out_extent(wd, kw, sw, pw, dw))
    return [_split(pixel, (n, oh, ow), ("nb", "oy", "ox")),
            _split(tap, (cpg, kh, kw), ("ci", "ky", "kx")),
            f"let iy = i32(oy * {sh}u + ky * {dh}u) - {ph};",
            f"let ix = i32(ox * {sw}u + kx * {dw}u) - {pw};",
            f"if ({inside('iy', 'ix', h, wd)}) {{ v = in0[((nb * {c}u + g * {cpg}u + ci) "
            f"* {h}u + u32(iy)) * {wd}u + u32(ix)]; }}"]


def out_extent(size: int, kernel: int, stride: int, pad: int, dilation: int) -> int:
    """Output positions along one axis of a convolution or pooling window."""
    return (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1


def generate_conv2d(node: Tensor, caps: Capabilities,
                    tiling: gemm.Tiling | None = None) -> Kernel:
    if is_channels_last(node):
        return _channels_last_conv2d(node, caps, tiling)
    x, w = node.inputs[:2]
    n, c, h, wd = x.shape
    o, cpg, kh, kw = w.shape
    oh, ow = node.shape[-2:]
    (sh, sw), (ph, pw), (dh, dw), groups = params(node)
    opg, taps = o // groups, kh * kw
    m, cols, depth = n * oh * ow, opg, cpg * taps

    def load_x(i: str, d: str) -> list[str]:
        return _im2col(node, x.shape, w.shape, i, d)

    def at(r: str, col: str) -> str:
        return (f"s * {n * o * oh * ow}u + (({r} / {oh * ow}u) * {o}u + g * {opg}u + {col}) "
                f"* {oh * ow}u + {r} % {oh * ow}u")

    def index(r: str, col: str) -> list[str]:
        return pixel_index(r, col, opg, (n, oh, ow))

    gpu, chunk = not gemm.on_cpu(caps), _chunk(node, depth)
    # a 1x1 convolution without stride or padding reads its input as a plain matrix
    wide = (gpu and plain(node), gpu and depth % 4 == chunk % 4 == 0)
    a = (gemm.indexed("in0", True, lambda i, d: f"(({i} / {h * wd}u) * {c}u + g * {cpg}u + {d}) "
                                                f"* {h * wd}u + {i} % {h * wd}u", "row")
         if wide[0] else gemm.Operand(load_x, "row"))
    b = gemm.indexed("in1", wide[1], lambda j, d: f"(g * {opg}u + {j}) * {depth}u + {d}", "depth")
    return _product(node, caps, m, cols, depth, groups, a, b,
                    Output(at, "row", oh * ow, index), tiling, x.size + w.size, wide)


def phased(node: Tensor, caps: Capabilities) -> bool:
    """Whether an input gradient runs as products per phase of its stride and tap: on GPUs,
    strided, undilated, over images the stride divides (every phase then has as many pixels)."""
    _, _, h, wd = node.attrs["in_shape"]
    (sh, sw), _, dilation, _ = params(node)
    return (not gemm.on_cpu(caps) and (sh, sw) != (1, 1) and dilation == (1, 1)
            and h % sh == 0 and wd % sw == 0)


def phase_taps(node: Tensor, caps: Capabilities) -> int:
    """The most taps that reach one phase of an input gradient, where phased (else 1): its
    partial sums, one a tap, whatever the split of its output channels adds."""
    if not phased(node, caps):
        return 1
    _, _, kh, kw = node.inputs[1].shape
    (sh, sw), (ph, pw), _, _ = params(node)
    return math.prod(max(len(range((r + pad) % stride, kernel, stride)) for r in range(stride))
                     for kernel, stride, pad in ((kh, sh, ph), (kw, sw, pw)))


def _phased_input_grad(node: Tensor, caps: Capabilities, tiling: gemm.Tiling | None) -> Kernel:
    """Grid layer z = ((group, phase), (tap slot, split of the output channels)). Phase (ry, rx)
    holds input pixels y = yq * sh + ry, x = xq * sw + rx; the taps along y that reach it are
    ky = ky0 + jy * sh for jy < cy, where ky0 = (ry + ph) % sh, and tap jy reads output row
    oy = yq + (ry + ph) / sh - jy (likewise along x). Each layer sums one tap over (a split of)
    the output channels into its own partial sum, so its loads divide by nothing but
    constants; slots past a phase's taps hold zeros."""
    d, w = node.inputs[:2]
    _, o, oh, ow = d.shape
    _, cpg, kh, kw = w.shape
    n, c, h, wd = node.shape[-4:]
    (sh, sw), (ph, pw), _, groups = params(node)
    hq, wq = h // sh, wd // sw
    slots, pieces = phase_taps(node, caps), node.attrs.get("splits", 1)
    opg, parts = o // groups, pieces // slots
    chunk = -(-opg // parts)
    setup = [f"  let s = z % {pieces}u; let gp = z / {pieces}u;",
             f"  let g = gp / {sh * sw}u; let ry = gp % {sh * sw}u / {sw}u; "
             f"let rx = gp % {sw}u;"]
    for axis, kernel, stride, pad in (("y", kh, sh, ph), ("x", kw, sw, pw)):
        setup.append(f"  let k{axis}0 = (r{axis} + {pad}u) % {stride}u; "
                     f"let q{axis} = (r{axis} + {pad}u) / {stride}u; "
                     f"let c{axis} = select(0u, ({kernel}u - k{axis}0 + {stride - 1}u) / "
                     f"{stride}u, k{axis}0 < {kernel}u);")
    setup += [f"  let slot = s / {parts}u; let part = s % {parts}u;",
              "  let jy = slot / max(cx, 1u); let jx = slot % max(cx, 1u);",
              f"  let ky = ky0 + jy * {sh}u; let kx = kx0 + jx * {sw}u;",
              "  let dy0 = qy - jy; let dx0 = qx - jx;"]  # oy = yq + dy0 (may wrap below 0)
    begin = f"part * {chunk}u"
    end = f"select({begin}, min({begin} + {chunk}u, {opg}u), slot < cy * cx)"

    def load_dy(i: str, ol: str) -> list[str]:
        return [_split(i, (n, hq, wq), ("nb", "yq", "xq")),
                "let oy = i32(yq + dy0); let ox = i32(xq + dx0);",
                f"if ({inside('oy', 'ox', oh, ow)}) {{ v = in0[((nb * {o}u + g * {opg}u + {ol}) "
                f"* {oh}u + u32(oy)) * {ow}u + u32(ox)]; }}"]

    def load_w(j: str, ol: str) -> list[str]:
        return [f"v = in1[((g * {opg}u + {ol}) * {cpg}u + {j}) * {kh * kw}u + ky * {kw}u + kx];"]

    def pixel(r: str) -> tuple[str, str, str]:  # the row's image, y and x
        return (f"({r} / {hq * wq}u)", f"(({r} / {wq}u) % {hq}u * {sh}u + ry)",
                f"({r} % {wq}u * {sw}u + rx)")

    def at(r: str, col: str) -> str:
        nb, y, x = pixel(r)
        return (f"s * {n * c * h * wd}u + (({nb} * {c}u + g * {cpg}u + {col}) * {h}u + {y}) "
                f"* {wd}u + {x}")

    def index(r: str, col: str) -> list[str]:
        nb, y, x = pixel(r)
        return [f"let i0 = {nb}; let i1 = g * {cpg}u + ({col}); let i2 = {y}; let i3 = {x};"]

    m = n * hq * wq
    return _product(node, caps, m, cpg, opg, groups * sh * sw, gemm.Operand(load_dy, "row"),
                    gemm.Operand(load_w, "depth"), Output(at, "row", 1, index), tiling,
                    d.size + w.size, (False,), setup=setup, k_range=(begin, end),
                    tiling_layers=dims_conv2d_input_grad(node, caps)[3],
                    flops=2 * m * cpg * opg * kh * kw * groups)


def generate_conv2d_input_grad(node: Tensor, caps: Capabilities,
                               tiling: gemm.Tiling | None = None) -> Kernel:
    if phased(node, caps):
        return _phased_input_grad(node, caps, tiling)
    d, w = node.inputs[:2]
    _, o, oh, ow = d.shape
    _, cpg, kh, kw = w.shape
    n, c, h, wd = node.shape[-4:]
    (sh, sw), (ph, pw), (dh, dw), groups = params(node)
    opg, taps = o // groups, kh * kw
    m, cols, depth = n * h * wd, cpg, opg * taps

    def load_dy(i: str, dd: str) -> list[str]:
        ly, cy = tap("y", ph, sh, oh, "oy", "ky", dh)
        lx, cx = tap("x", pw, sw, ow, "ox", "kx", dw)
        return [_split(i, (n, h, wd), ("nb", "y", "x")),
                _split(dd, (opg, kh, kw), ("ol", "ky", "kx")), ly, lx,
                f"if ({cy} && {cx}) {{ v = in0[((nb * {o}u + g * {opg}u + ol) * {oh}u "
                f"+ u32(oy)) * {ow}u + u32(ox)]; }}"]

    def load_w(j: str, dd: str) -> list[str]:
        return [_split(dd, (opg, taps), ("ol", "t")),
                f"v = in1[((g * {opg}u + ol) * {cpg}u + {j}) * {taps}u + t];"]

    def at(r: str, col: str) -> str:
        return (f"s * {n * c * h * wd}u + (({r} / {h * wd}u) * {c}u + g * {cpg}u + {col}) "
                f"* {h * wd}u + {r} % {h * wd}u")

    def index(r: str, col: str) -> list[str]:
        return pixel_index(r, col, cpg, (n, h, wd))

    wide = (not gemm.on_cpu(caps) and plain(node),)
    a = (gemm.indexed("in0", True, lambda i, dd: f"(({i} / {h * wd}u) * {o}u + g * {opg}u + {dd})"
                                                 f" * {h * wd}u + {i} % {h * wd}u", "row")
         if wide[0] else gemm.Operand(load_dy, "row"))
    return _product(node, caps, m, cols, depth, groups, a, gemm.Operand(load_w, "depth"),
                    Output(at, "row", h * wd, index), tiling, d.size + w.size, wide)


def pixel_index(r: str, col: str, per_group: int, pixels: tuple[int, int, int]) -> list[str]:
    """Lines defining the NCHW indices i0..i3 of C[r, col] for GEMM rows that are an image's
    pixels (n, y, x) over `pixels` (N, H, W) and columns that are channels of group g."""
    return [f"let i1 = g * {per_group}u + ({col}); "
            + _split(f"({r})", pixels, ("i0", "i2", "i3"))]


def tap(coord: str, pad: int, stride: int, extent: int, name: str, k: str,
         dilation: int) -> tuple[str, str]:
    """The output coordinate `name` whose window tap `k` lands on input `coord`: the WGSL line
    defining it and the condition that it exists."""
    num = f"(i32({coord}) + {pad} - i32({k} * {dilation}u))"
    if stride == 1:
        return f"let {name} = {num};", f"{name} >= 0 && {name} < {extent}"
    return (f"let {name}n = {num}; let {name} = {name}n / {stride};",
            f"{name}n >= 0 && {name}n % {stride} == 0 && {name} < {extent}")


def generate_conv2d_weight_grad(node: Tensor, caps: Capabilities,
                                tiling: gemm.Tiling | None = None) -> Kernel:
    x, d = node.inputs
    n, c, h, wd = x.shape
    _, o, oh, ow = d.shape
    _, cpg, kh, kw = node.attrs["w_shape"]
    (sh, sw), (ph, pw), (dh, dw), groups = params(node)
    opg, taps = o // groups, kh * kw
    m, cols, depth = opg, cpg * taps, n * oh * ow

    def load_x(j: str, dd: str) -> list[str]:
        return _im2col(node, x.shape, node.attrs["w_shape"], dd, j)

    def at(r: str, col: str) -> str:
        return f"s * {o * cols}u + (g * {opg}u + {r}) * {cols}u + {col}"

    # The sum runs over (image, pixel): four at a time where images hold multiples of 4 pixels.
    gpu, chunk = not gemm.on_cpu(caps), _chunk(node, depth)
    wide = (gpu and plain(node) and chunk % 4 == 0,
            gpu and (oh * ow) % 4 == chunk % 4 == 0)
    a = gemm.indexed("in1", wide[1], lambda i, dd: f"(({dd} / {oh * ow}u) * {o}u + g * {opg}u "
                                                   f"+ {i}) * {oh * ow}u + {dd} % {oh * ow}u",
                     "depth")
    b = (gemm.indexed("in0", True, lambda j, dd: f"(({dd} / {h * wd}u) * {c}u + g * {cpg}u + {j})"
                                                 f" * {h * wd}u + {dd} % {h * wd}u", "depth")
         if wide[0] else gemm.Operand(load_x, "depth"))
    return _product(node, caps, m, cols, depth, groups, a, b, Output(at, "col", cols), tiling,
                    x.size + d.size, wide)


def weight_shape(node: Tensor) -> tuple[int, ...]:
    """The (out, in/groups, kh, kw) weight of a convolution or its gradients (an attribute where
    the node does not read it as such: a weight gradient, a channels-last convolution)."""
    return node.attrs["w_shape"] if "w_shape" in node.attrs else node.inputs[1].shape


def input_shape(node: Tensor) -> tuple[int, ...]:
    """The NCHW input of a convolution (an attribute where it reads it channels-last)."""
    return node.attrs["x_shape"] if "x_shape" in node.attrs else node.inputs[0].shape


def pointwise(node: Tensor) -> bool:
    """Whether a convolution's window is one pixel, unstrided and unpadded: its input is then a
    plain matrix of channels x pixels per image."""
    kh, kw = weight_shape(node)[-2:]
    (sh, sw), (ph, pw), _, _ = params(node)
    return (kh, kw, sh, sw, ph, pw) == (1, 1, 1, 1, 0, 0)


def plain(node: Tensor) -> bool:
    """Whether a convolution is a product of plain matrices read four elements a load (a
    pointwise one over images of a multiple of 4 pixels, or channels-last: pixels x channels):
    tiled as a matmul is (gemm.choose)."""
    if is_channels_last(node):
        return pointwise(node)
    h, w = node.inputs[0].shape[-2:]  # the input, or the input gradient's output gradient
    return pointwise(node) and (h * w) % 4 == 0


def coop_min(node: Tensor) -> tuple[int, int] | None:
    """The sizes from which the node takes f16 tiles in accelerated mode (gemm.choose's
    `coop_min`): every size for a channels-last convolution, whose operands are f16 already;
    None (gemm.COOP_MIN) for the others."""
    return (0, 0) if is_channels_last(node) else None


def _chunk(node: Tensor, depth: int) -> int:
    """The depth each split of the sum covers (all of it unsplit; channels-last, a multiple of
    4, so no split ends inside a quad of channels read at once)."""
    chunk = -(-depth // node.attrs.get("splits", 1))
    return -(-chunk // CHANNEL_QUAD) * CHANNEL_QUAD if is_channels_last(node) else chunk


@dataclass(frozen=True)
class Output:
    """Where the GEMM's C[r, col] lands in the output (`at`: its flat index) and which index of
    C runs along memory (`along`) in runs of `run` elements (an image's pixels, a weight's
    taps): where runs are multiples of 4, GPUs store four outputs at once. `index`: lines
    defining the output's indices i0..i3 at C[r, col], for an epilogue's reads (None: the
    kernel takes none)."""

    at: Callable[[str, str], str]
    along: Literal["row", "col"]
    run: int
    index: Callable[[str, str], list[str]] | None = None


def _product(node: Tensor, caps: Capabilities, m: int, cols: int, depth: int, groups: int,
             a: gemm.Operand, b: gemm.Operand, output: Output,
             tiling: gemm.Tiling | None, read: int, wide: tuple[bool, ...],
             setup: list[str] | None = None, k_range: tuple[str, str] | None = None,
             tiling_layers: int | None = None, flops: int | None = None,
             prelude: Sequence[str] = ()) -> Kernel:
    """The GEMM over grid layers z = group * splits + split (see OpDef.splits): split s sums its
    own range of the depth into slice s of a result with a leading split axis. `wide`: which
    inputs are bound as vec4 arrays. `setup` and `k_range`: lines defining g and s from z, and
    the range a layer sums, where the layers are not just groups and splits of one depth
    (phased input gradients: the sum then has edges); `tiling_layers`: the layers the tiling
    was planned for (by dims_*) where they are not the groups; `prelude`: WGSL the loaders
    call."""
    pieces = node.attrs.get("splits", 1)
    chunk = depth if k_range else _chunk(node, depth)
    tiling = tiling or gemm.choose(m, cols, depth, tiling_layers or groups, caps, plain(node),
                                   coop_min(node))
    target, after, _ = result_store(node, "")
    # a result stored channels-last goes an element at a time
    wide_out = output.run % 4 == 0 and gemm.stores_wide(tiling, chunk) and not after

    def index(r: str, col: str) -> list[str]:
        return output.index(r, col) if output.index is not None else []

    def store(r: str, col: str, acc: str) -> list[str]:
        if after:  # result_store's lines read the output's indices
            return [*("      " + line for line in index(r, col)),
                    *epilogue_store(node, [], acc, target), *("      " + a for a in after)]
        return epilogue_store(node, index(r, col), acc, f"out[{output.at(r, col)}] =")

    def store4(r: str, col: str, accs: list[str]) -> list[str]:
        if epilogue(node) is None:
            return [f"      out[({output.at(r, col)}) / 4u] = vec4<f32>({', '.join(accs)});"]
        lines = ["      var o = vec4<f32>();"]
        for q, acc in enumerate(accs):
            at = (f"({r} + {q}u)", col) if output.along == "row" else (r, f"({col} + {q}u)")
            lines += ["      {", *epilogue_store(node, index(*at), acc, f"o[{q}] =", "        "),
                      "      }"]
        return [*lines, f"      out[({output.at(r, col)}) / 4u] = o;"]

    return gemm.generate(
        f"{node.op}_{'x'.join(map(str, node.shape))}", caps, buffers(node, wide, wide_out), m,
        cols, chunk, groups * pieces, a, b, store, tiling,
        setup=setup or [f"  let g = z / {pieces}u; let s = z % {pieces}u;"],
        k_range=k_range or (f"s * {chunk}u", f"min(s * {chunk}u + {chunk}u, {depth}u)"),
        depth=depth, ragged=k_range is not None,
        prelude=[*(["enable f16;"] if after else []), *prelude,
                 *helper_functions(epilogue(node))],
        flops=2 * m * cols * depth * groups if flops is None else flops,
        nbytes=4 * (read + node.size + sum(x.size for x in node.inputs[2:])),
        wide_store=gemm.WideStore(output.along, store4) if wide_out else None)


def dims_conv2d(node: Tensor, caps: Capabilities) -> tuple[int, int, int, int]:
    """GEMM shape (m, n, k, grid layers) of a conv2d node (channels-last: k over the padded
    channels)."""
    o, cpg, kh, kw = weight_shape(node)
    groups = node.attrs["groups"]
    if is_channels_last(node):
        cpg = padded_channels(cpg)
    return (input_shape(node)[0] * node.shape[-2] * node.shape[-1], o // groups, cpg * kh * kw,
            groups)


def dims_conv2d_input_grad(node: Tensor, caps: Capabilities) -> tuple[int, int, int, int]:
    """GEMM shape of an input gradient; where phased, of one layer: a phase's pixels and the
    output channels, over groups x phases x taps (before its split)."""
    d, w = node.inputs[:2]
    o, cpg, kh, kw = w.shape
    n, _, h, wd = node.attrs["in_shape"]
    groups = node.attrs["groups"]
    if not phased(node, caps):
        return n * h * wd, cpg, (o // groups) * kh * kw, groups
    (sh, sw), _, _, _ = params(node)
    return (n * h * wd // (sh * sw), cpg, o // groups,
            groups * sh * sw * phase_taps(node, caps))


def dims_conv2d_weight_grad(node: Tensor, caps: Capabilities) -> tuple[int, int, int, int]:
    _, dy = node.inputs
    o, cpg, kh, kw = node.attrs["w_shape"]
    groups = node.attrs["groups"]
    return o // groups, cpg * kh * kw, dy.shape[0] * dy.shape[2] * dy.shape[3], groups


# Accelerated inference reads a convolution's operands channels-last in f16 (`channels_last`)
# where its GEMM is at least this large in every dimension, by the kind of f16 products the
# device has (Capabilities.f16_products); None: never (every convolution reads NCHW f32 as in
# training). tools/kernel_lab.py --channels-last times both; it was measured on cooperative
# matrices only, so the staged f16 tiles of devices without them keep NCHW operands.
CHANNELS_LAST_MIN: dict[str, int | None] = {"cooperative": 0, "simt": None}
CHANNEL_QUAD = 4  # channels-last operands pad their channels to a multiple of this


def padded_channels(c: int) -> int:
    return -(-c // CHANNEL_QUAD) * CHANNEL_QUAD


def is_channels_last(node: Tensor) -> bool:
    """Whether a convolution reads channels-last f16 operands (`channels_last`'s rewrite)."""
    return node.attrs.get("operands") == CHANNELS_LAST


def channels_last(node: Tensor, caps: Capabilities) -> bool:
    """Whether a forward convolution of an inference (the rewrite asks only there:
    compiler/layouts.py) reads its operands channels-last in f16 on this target: at precision
    "f16" where CHANNELS_LAST_MIN allows (its f16 tiles: cooperative ones, or the staged f16
    tiles of devices without them), undilated, its groups' channels multiples of 4 (or one
    group, padded), not already so."""
    # not at precision "bf16": its copies would be bfloat16 tensors in memory, where the
    # bfloat16 SPIR-V pass (vk/spirv.py) was checked on workgroup staging only
    least = CHANNELS_LAST_MIN.get(caps.f16_products) if caps.f16_products else None
    if (least is None or caps.precision != "f16" or caps.scaled_operands or is_channels_last(node)
            or node.op not in ("conv2d", "fused_conv2d")):
        return False
    _, cpg, _, _ = weight_shape(node)
    (_, _), _, dilation, groups = params(node)
    if dilation != (1, 1) or (groups > 1 and cpg % CHANNEL_QUAD):
        return False
    m, n, k, _ = dims_conv2d(node, caps)
    return min(m, n, k) >= least


def weight_copied(node: Tensor) -> bool:
    """Whether a channels-last convolution reads its weight through a copy too: not where the
    f32 weight's rows are already a patch row's order (a 1 x 1 window) over whole quads of
    channels, which the tiles read four at a time and convert as they stage them."""
    _, cpg, kh, kw = weight_shape(node)
    return (kh, kw) != (1, 1) or cpg % CHANNEL_QUAD != 0


# The channels-last copy's tile: pixels by channels a workgroup moves through workgroup memory,
# so both its reads (along an NCHW plane's pixels) and its writes (along a pixel's channels)
# run along memory.
LAYOUT_PIXELS, LAYOUT_CHANNELS, LAYOUT_THREADS = 64, 64, 256


def generate_channels_last(node: Tensor, caps: Capabilities) -> Kernel:
    """(A, C, H, W) f32 -> (A, H, W, C padded to a multiple of 4) f16, the padding zero: a
    workgroup reads a LAYOUT_CHANNELS x LAYOUT_PIXELS tile along the pixels into workgroup
    memory, then writes it four channels (one vec4<f16>) at a time along the channels."""
    (x,) = node.inputs
    a, c, h, w = x.shape
    hw, quads = h * w, padded_channels(c) // CHANNEL_QUAD
    tp, tc, threads = LAYOUT_PIXELS, LAYOUT_CHANNELS, LAYOUT_THREADS
    entry = ["fn main(@builtin(local_invocation_index) tid: u32, "
             "@builtin(workgroup_id) wid: vec3<u32>) {",
             f"  let p0 = wid.x * {tp}u; let c0 = wid.y * {tc}u; let base = wid.z * {c * hw}u;",
             f"  for (var e = tid; e < {tp * tc}u; e += {threads}u) {{",
             f"    let p = p0 + e % {tp}u; let ch = c0 + e / {tp}u; var v = 0.0;",
             f"    if (p < {hw}u && ch < {c}u) {{ v = in0[base + ch * {hw}u + p]; }}",
             f"    tile[(e / {tp}u) * {tp + 1}u + e % {tp}u] = v;", "  }",
             "  workgroupBarrier();",
             f"  for (var e = tid; e < {tp * tc // CHANNEL_QUAD}u; e += {threads}u) {{",
             f"    let q = e % {tc // CHANNEL_QUAD}u; let pl = e / {tc // CHANNEL_QUAD}u;",
             "    let p = p0 + pl; let quad = c0 / 4u + q;",
             f"    if (p < {hw}u && quad < {quads}u) {{",
             f"      let at = (q * 4u) * {tp + 1}u + pl;",
             f"      out[(wid.z * {hw}u + p) * {quads}u + quad] = vec4<f16>(vec4<f32>(tile[at], "
             f"tile[at + {tp + 1}u], tile[at + {2 * (tp + 1)}u], tile[at + {3 * (tp + 1)}u]));",
             "    }", "  }", "}"]
    return assemble(f"{CHANNELS_LAST}_{'x'.join(map(str, x.shape))}", caps,
                    [Buf("in0"), Buf("out", "vec4<f16>", writable=True)], (threads,), entry,
                    (-(-hw // tp), -(-padded_channels(c) // tc), a),
                    prelude=["enable f16;", f"var<workgroup> tile: array<f32, {tc * (tp + 1)}>;"],
                    nbytes=4 * x.size + 2 * a * hw * quads * CHANNEL_QUAD)


def _channels_last_conv2d(node: Tensor, caps: Capabilities, tiling: gemm.Tiling | None
                          ) -> Kernel:
    """conv2d over channels-last f16 operands: rows = output pixels (n, oy, ox), columns =
    output channels of the group, depth = (ky, kx, ci) over the group's channels padded to 4
    (the padding is zero in both operands). A patch row's four channels are one vec4<f16>
    (zero in the image's padding), the weight's rows are plain rows."""
    n, c, h, wd = input_shape(node)
    o, cpg, kh, kw = weight_shape(node)
    oh, ow = node.shape[-2:]
    (sh, sw), (ph, pw), _, groups = params(node)
    cp, cpgp = padded_channels(c), padded_channels(cpg)
    opg, depth = o // groups, kh * kw * cpgp
    m = n * oh * ow
    # a patch row's quad at pixel row i, depth d (a multiple of 4), zero in the image's padding
    # (a pointwise convolution's rows are its input's pixels)
    patch = ["fn patch_quad(i: u32, d: u32) -> vec4<f16> {",
             f"  return in0[(i * {cp}u + g * {cpg}u + d) / 4u];", "}"] if pointwise(node) else [
             "fn patch_quad(i: u32, d: u32) -> vec4<f16> {",
             "  " + _split("i", (n, oh, ow), ("nb", "oy", "ox")),
             "  " + _split("d", (kh, kw, cpgp), ("ky", "kx", "ci")),
             f"  let iy = i32(oy * {sh}u + ky) - {ph}; let ix = i32(ox * {sw}u + kx) - {pw};",
             f"  if ({inside('iy', 'ix', h, wd)}) {{",
             f"    return in0[(((nb * {h}u + u32(iy)) * {wd}u + u32(ix)) * {cp}u + g * {cpg}u "
             f"+ ci) / 4u];",
             "  }", "  return vec4<f16>();", "}"]
    # the group g is the grid layer's, passed by the setup line as a module variable
    a = gemm.Operand(lambda i, d: [f"v = f32(patch_quad({i}, {d} - {d} % 4u)[{d} % 4u]);"], "depth",
                     lambda i, d: f"patch_quad({i}, {d})", half=True)
    # the weight's rows: its copy's, or the f32 weight itself where its rows are already
    # (ky, kx, ci) with ci fastest, unpadded (pointwise convolutions: `weight_copied`)
    b = gemm.Operand(
        lambda j, d: [f"{{ let e = (g * {opg}u + {j}) * {depth}u + {d}; "
                      f"v = f32(in1[e / 4u][e % 4u]); }}"],
        "depth", lambda j, d: f"in1[((g * {opg}u + {j}) * {depth}u + {d}) / 4u]", half=True
    ) if node.inputs[1].dtype == "i32" else gemm.indexed(
        "in1", True, lambda j, d: f"(g * {opg}u + {j}) * {depth}u + {d}", "depth")

    def at(r: str, col: str) -> str:
        return (f"s * {n * o * oh * ow}u + (({r} / {oh * ow}u) * {o}u + g * {opg}u + {col}) "
                f"* {oh * ow}u + {r} % {oh * ow}u")

    def index(r: str, col: str) -> list[str]:
        return pixel_index(r, col, opg, (n, oh, ow))

    pieces = node.attrs.get("splits", 1)
    return _product(node, caps, m, opg, depth, groups, a, b,
                    Output(at, "row", oh * ow, index), tiling,
                    (n * h * wd * cp + o * kh * kw * cpgp) // 2, (True, True),
                    setup=[f"  g = z / {pieces}u; let s = z % {pieces}u;"],
                    prelude=["enable f16;", "var<private> g: u32;", "\n".join(patch)])


def _window_max(x: Tensor, a: dict) -> str:
    """WGSL function: the flat window offset (ky * kw + kx) of the first maximum of the pooling
    window at output (oy, ox) of the plane starting at `base`, or of its last NaN, as PyTorch
    picks it."""
    _, _, h, wd = x.shape
    (kh, kw), (sh, sw), (ph, pw) = a["kernel"], a["stride"], a["padding"]
    lines = ["fn window_argmax(base: u32, oy: i32, ox: i32) -> i32 {",
             "  var best = -3.4028235e38; var at = -1;"]
    for ki in range(kh):
        for kj in range(kw):
            lines.append(f"  {{ let y = oy * {sh} + {ki - ph}; let x = ox * {sw} + {kj - pw}; "
                         f"if (y >= 0 && y < {h} && x >= 0 && x < {wd}) {{ "
                         f"let v = in0[base + u32(y * {wd} + x)]; "
                         f"if ((v > best && !{is_nan('best')}) || {is_nan('v')} || at < 0) {{ "
                         f"best = v; at = {ki * kw + kj}; }} }} }}")
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
            ly, cy = tap("i2", ph - ki, sh, oh, "y", "0u", 1)
            lx, cx = tap("i3", pw - kj, sw, ow, "x", "0u", 1)
            body.append(f"  {{ {ly} {lx} if ({cy} && {cx}) {{ "
                        f"if (window_argmax(base, y, x) == {ki * kw + kj}) {{ "
                        f"acc += in1[db + u32(y * {ow} + x)]; }} }} }}")
    return gather.generate(node, caps, [*body, "  out[idx] = acc;"],
                           [_window_max(x, node.attrs)], flops=node.size * (kh * kw) ** 2)
