"""Pieces shared by the kernel generators: assembling a kernel from its bindings and entry
point, the dispatch grid, workgroup reductions, index arithmetic, the loop-length limit."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from vkml.errors import GraphError
from vkml.expr import Body
from vkml.hal import Capabilities, Kernel
from vkml.hal.kernel import BFLOAT16_MARK

if TYPE_CHECKING:
    from vkml.graph import Tensor


@dataclass(frozen=True)
class Buf:
    """A storage binding as a generator names it; bindings are numbered in list order."""

    name: str
    dtype: str = "f32"
    writable: bool = False


# The layout a kernel may write its 4-D (N, C, H, W) result in instead of NCHW f32 (node attribute
# "store", set by compiler/layouts.py `store_layouts` where a channels-last copy would be its
# only reader): (N, H, W, C) f16, the copy's layout (ops/conv.py), in the first half of the
# node's slot.
CHANNELS_LAST = "channels_last_f16"


def result_store(node: Tensor, target: str) -> tuple[str, list[str], Buf]:
    """How a kernel whose store is the assignment `target` (e.g. "out[o] =") writes the node's
    result: the assignment to write the value with, the lines after it, and the output binding.
    Where the node stores channels-last (attribute "store") the value goes to a `let`, then to
    its (N, H, W, C) place as f16: the lines need i0..i3, the NCHW indices, in scope."""
    if node.attrs.get("store") != CHANNELS_LAST:
        return target, [], Buf("out", writable=True)
    _, c, h, w = node.shape
    return "let stored =", [f"out[((i0 * {h}u + i2) * {w}u + i3) * {c}u + i1] = f16(stored);"], \
        Buf("out", "f16", writable=True)


def check_loop(node: Tensor, caps: Capabilities, trips: int, fix: str) -> None:
    """Refuse a kernel whose threads would loop more than the device runs: lavapipe stops an
    invocation's loops after 65535 trips in all and keeps what it has, a silent wrong number.
    `fix`: what the user can do instead."""
    limit = caps.max_loop_iterations
    if limit is not None and trips > limit:
        raise GraphError(f"{node.label} (made at {node.where}) needs loops of {trips} "
                         f"trips per thread, and {caps.device_name} stops a shader's loops after "
                         f"{limit}: {fix}")


def assemble(name: str, caps: Capabilities, buffers: Sequence[Buf],
             workgroup: Sequence[int], entry: Sequence[str], groups: tuple[int, int, int], *,
             prelude: Sequence[str] = (), flops: int = 0, nbytes: int = 0,
             independent_workgroups: bool = True) -> Kernel:
    """A Kernel from its parts: `prelude` (helper functions, workgroup variables), the storage
    bindings (declared read-only only where the target allows it, see
    Capabilities.read_only_storage), the entry point `entry` (from `fn main(...) {` to its
    closing brace) with its workgroup size, the grid, and the work estimates.
    `independent_workgroups` (Kernel's): true of every generator here, whose workgroups
    never meet (a kernel that shares work between them through atomics says False).
    Where the target passes a dispatch's base workgroup in a uniform (caps.base_in_uniform),
    a kernel that may be cut reads it there (`offset_workgroup_id`). At precision "bf16" a
    kernel with f16 values (the cooperative ones) is marked as having bfloat16 ones instead
    (hal.kernel.BFLOAT16_MARK)."""
    declared = [f"@group(0) @binding({i}) var<storage, "
                f"{'read_write' if b.writable or not caps.read_only_storage else 'read'}> "
                f"{b.name}: array<{b.dtype}>;" for i, b in enumerate(buffers)]
    size = (*workgroup, 1, 1)[:3]
    kernel = Kernel(name, "", tuple("read_write" if b.writable else "read" for b in buffers),
                    (int(size[0]), int(size[1]), int(size[2])), groups, int(flops), int(nbytes),
                    independent_workgroups)
    if caps.base_in_uniform and kernel.cut_axis is not None:
        declared.append(f"@group(0) @binding({len(buffers)}) var<uniform> {BASE_UNIFORM}: "
                        "vec4<u32>;")
        entry = offset_workgroup_id(entry, kernel.workgroup_size)
    mark = [BFLOAT16_MARK] if caps.precision == "bf16" and "enable f16;" in prelude else []
    if mark:
        entry, prelude = to_bfloat16_rounded(entry), [*prelude, *BF16_ROUNDING]
    # each helper once, where a fused body and the generator both bring it (Body.helpers()
    # strips them)
    helpers = list({p.strip(): p for p in prelude}.values())
    wgsl = "\n".join([*mark, *helpers, *declared,
                      f"@compute @workgroup_size({', '.join(map(str, workgroup))})", *entry])
    if independent_workgroups and "atomic" in wgsl:
        raise ValueError(f"kernel {name!r} uses atomics: say independent_workgroups=False, or "
                         "a step cut between its workgroups could change its results")
    return replace(kernel, wgsl=wgsl + "\n")


# caps.base_in_uniform: the dispatch's base workgroup (x, y, z, unused), which the backend binds
# right after a cuttable kernel's storage bindings.
BASE_UNIFORM = "vkml_base"
# The entry point's parameters that a base workgroup changes (builtin, name).
_BASED_IDS = re.compile(r"@builtin\((workgroup_id|global_invocation_id)\)\s*(\w+)\s*:\s*vec3<u32>")


def offset_workgroup_id(entry: Sequence[str], workgroup: tuple[int, int, int]) -> list[str]:
    """The entry point `entry` (workgroup size `workgroup`) with its workgroup and global
    invocation ids counted from the base workgroup in BASE_UNIFORM: the ids a dispatch with a
    base (vkCmdDispatchBase) gives, on a backend that has no such dispatch. num_workgroups
    needs nothing: as with a base, it is the range's count, which LINEAR_WORKGROUP allows."""
    text = "\n".join(entry)
    brace = text.index("{") + 1  # the signature's end: no parameter holds a brace
    signature, body = text[:brace], text[brace:]
    size = ", ".join(f"{n}u" for n in workgroup)
    offsets = {"workgroup_id": f"{BASE_UNIFORM}.xyz",
               "global_invocation_id": f"{BASE_UNIFORM}.xyz * vec3<u32>({size})"}
    lets = [f"  let {name} = {name}_in_range + {offsets[builtin]};"
            for builtin, name in _BASED_IDS.findall(signature)]
    signature = _BASED_IDS.sub(r"@builtin(\1) \2_in_range: vec3<u32>", signature)
    return [signature, *lets, body.lstrip("\n")]


def grid(workgroups: int, caps: Capabilities) -> tuple[int, int, int]:
    """Spread a 1-D count of workgroups over x and y, since x alone is capped (65535 typically).
    Kernels recover the linear index with `LINEAR_WORKGROUP` and ignore any surplus."""
    cap = caps.max_workgroup_count[0]
    if workgroups <= cap:
        return (max(workgroups, 1), 1, 1)
    return (cap, -(-workgroups // cap), 1)


# The only use of num_workgroups a kernel may make and keep independent_workgroups (Kernel's):
# a dispatch cut along y into ranges keeps nwg.x whole, and one cut along x has wid.y = 0.
LINEAR_WORKGROUP = "wid.x + wid.y * nwg.x"
# NaN as torch (CPU) treats it, in a form no driver can change: WGSL leaves max(), min() and
# clamp() of a NaN to the driver (lavapipe's return the other operand), drivers fold a select of
# a comparison into them (on the H200 relu's select gave 0 for NaN), and WGSL lets them assume
# that no float compares unequal to itself. So a NaN is told by its bits, and where torch passes
# it through, a select on that test picks it, whatever the rest of the expression became.
# Maxima and minima start from -inf or +inf (a maximum over -inf is -inf, not the lowest float);
# WGSL has no infinity literal.
NEG_INF = "bitcast<f32>(0xff800000u)"
POS_INF = "bitcast<f32>(0x7f800000u)"


def is_nan(value: str) -> str:
    """WGSL: whether the f32 `value` is NaN (exponent all ones, mantissa not zero)."""
    return f"((bitcast<u32>({value}) & 0x7fffffffu) > 0x7f800000u)"


def is_finite(value: str) -> str:
    """WGSL: whether the f32 `value` is neither infinite nor NaN (exponent not all ones)."""
    return f"((bitcast<u32>({value}) & 0x7fffffffu) < 0x7f800000u)"


def is_infinite(value: str) -> str:
    """WGSL: whether the f32 `value` is +inf or -inf (exponent all ones, mantissa zero)."""
    return f"((bitcast<u32>({value}) & 0x7fffffffu) == 0x7f800000u)"


def unless_nan(value: str, x: str, instead: str | None = None) -> str:
    """WGSL: `value`, except where `x` is NaN: there `instead` (x itself, NaN, by default)."""
    return f"select({value}, {x if instead is None else instead}, {is_nan(x)})"


# torch's maximum and minimum of two numbers: NaN where either is (a + b is then NaN)
MAX_HELPER, MIN_HELPER = (f"""
fn vkml_{name}(a: f32, b: f32) -> f32 {{
  return select(select(b, a, a {wins} b), a + b, {is_nan("a")} || {is_nan("b")});
}}
""" for name, wins in (("max", ">"), ("min", "<")))
ENTRY_ARGS = ("@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, "
              "@builtin(local_invocation_index) lid: u32")


def tree_reduce(scratch: str | Sequence[str], size: int, combine: str, kept: int = 1,
                index: str = "lid") -> list[str]:
    """WGSL lines folding `scratch[0..size)` into `scratch[0..kept)` across the workgroup
    (several arrays at once, sharing the barriers, where `scratch` names several): entry i gets
    the entries i + kept, i + 2 kept, ...; `combine` is a format string of `a` and `b` (e.g.
    "{a} + {b}"); `index`: the invocation's index in the workgroup. Unrolled: naga does not
    unroll loops."""
    arrays = [scratch] if isinstance(scratch, str) else list(scratch)
    lines = ["  workgroupBarrier();"]
    step = size // 2
    while step >= kept:
        folds = " ".join(f"{s}[{index}] = "
                         f"{combine.format(a=f'{s}[{index}]', b=f'{s}[{index} + {step}u]')};"
                         for s in arrays)
        lines.append(f"  if ({index} < {step}u) {{ {folds} }}")
        lines.append("  workgroupBarrier();")
        step //= 2
    return lines


def split_index(index: str, shape: Sequence[int], names: Sequence[str]) -> list[str]:
    """WGSL lets splitting a flat row-major `index` over `shape` into `names` (the divisors are
    constants, which drivers turn into multiplies)."""
    lines, inner = [], 1
    for axis in reversed(range(len(shape))):
        value = f"{index} / {inner}u" if inner > 1 else index
        if axis > 0:
            value = f"({value}) % {shape[axis]}u"
        lines.append(f"let {names[axis]} = {value};")
        inner *= shape[axis]
    return list(reversed(lines))


def unflatten(index: str, shape: tuple[int, ...], prefix: str) -> list[str]:
    """WGSL `let` lines splitting a flat row-major `index` into per-axis indices prefix0, ..."""
    return ["  " + line for line in
            split_index(index, shape, [f"{prefix}{a}" for a in range(len(shape))])]


def offset(indices: list[str], strides: tuple[int, ...]) -> str:
    terms = [f"{i} * {s}u" if s != 1 else i for i, s in zip(indices, strides) if s != 0]
    return " + ".join(terms) if terms else "0u"


def helper_functions(*bodies: Body | None) -> list[str]:
    """The WGSL helper functions the bodies use, each once."""
    seen: dict[str, None] = {}
    for body in bodies:
        for h in body.helpers() if body else ():
            seen.setdefault(h, None)
    return list(seen)


def epilogue_reads(body: Body, acc: str, indices: list[str],
                   buffer: Callable[[int], str]) -> dict[int, str]:
    """An epilogue's inputs as body_lines binds them: x0 the accumulator `acc`, each other input
    k its element at the output index `indices` (one name per axis), from binding `buffer(k)`."""
    return {0: acc} | {k: f"{buffer(k)}[{offset(indices, body.strides[k])}]"
                       for k in range(1, len(body.strides))}


def body_lines(body: Body, reads: dict[int, str], indent: str, target: str) -> list[str]:
    """Bind each input k of `body` to the WGSL expression `reads[k]`, compute it and assign the
    result to `target` (`acc +=` style targets work too)."""
    return body.render(reads, indent, target)


# f32 to bfloat16 rounded to nearest, ties to even, in f32 arithmetic: the kernel's f16
# conversions become these at precision "bf16", so the conversion the backend retypes
# (vk/spirv.py) meets a value bfloat16 holds exactly, whatever rounding the driver's applies
# (the H200's rounds toward zero: every probability of an attention row rounded down, 1.2% off
# its output). NaN stays NaN (rounding would carry a small payload into the exponent).
BF16_ROUNDED = "\n".join([
    "fn vkml_bf16_f32(x: f32) -> f32 {",
    "  let b = bitcast<u32>(x);",
    "  let r = bitcast<f32>((b + 0x7fffu + ((b >> 16u) & 1u)) & 0xffff0000u);",
    f"  return select(r, x, {is_nan('x')});",
    "}"])
# prelude entries, each a whole function (assemble writes each entry once); they return f32,
# since the SPIR-V pass allows bfloat16 values only in conversions, memory and composites
BF16_ROUNDING = [
    BF16_ROUNDED,
    "fn vkml_bf16x4_f32(v: vec4<f32>) -> vec4<f32> {\n  return vec4<f32>(vkml_bf16_f32(v.x), "
    "vkml_bf16_f32(v.y), vkml_bf16_f32(v.z), vkml_bf16_f32(v.w));\n}"]
_F16_CONVERSION = re.compile(r"(?<![\w<])f16\(|vec4<f16>\(")


def to_bfloat16_rounded(entry: Sequence[str]) -> list[str]:
    """`entry` with the argument of each conversion to f16 (`f16(x)`, `vec4<f16>(v)`) rounded
    first (BF16_ROUNDING): `f16(vkml_bf16_f32(x))`."""
    def line(text: str) -> str:
        out, at = [], 0
        for m in _F16_CONVERSION.finditer(text):
            if m.start() < at:
                continue
            depth, end = 1, m.end()
            while depth:  # the conversion's closing parenthesis
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                end += 1
            rounding = "vkml_bf16x4_f32(" if m.group(0).startswith("vec4") else "vkml_bf16_f32("
            inner = line(text[m.end():end - 1])
            out += [text[at:m.end()], rounding, inner, "))"]
            at = end
        return "".join([*out, text[at:]])
    return [line(text) for text in entry]
