"""Matmul archetype: C = op(A) @ op(B) (either operand read transposed, no copy made), batched
over leading dimensions with numpy broadcasting (grid z is the flat batch index), an epilogue
body applied before the store (bias, activation, scaling: made by the rewrite stage). The tiles
and their variants are the GEMM core's (vkml/kernels/gemm.py)."""

from __future__ import annotations

import numpy as np

from vkml.expr import Arg, Body, broadcast_strides
from vkml.graph import Tensor
from vkml.hal import Capabilities, Kernel
from vkml.kernels import gemm
from vkml.kernels.common import (
    Buf,
    body_lines,
    epilogue_reads,
    helper_functions,
    offset,
    unflatten,
)


def generate(node: Tensor, caps: Capabilities, tiling: gemm.Tiling | None = None) -> Kernel:
    """Bindings: A, B, the largest magnitudes of each scaled operand (attribute "scales", made
    by compiler/scale.py), the epilogue's extra inputs, C. In the epilogue x0 is the
    accumulator."""
    modes = node.attrs.get("scales", (None, None))  # compiler/scale.py
    a, b, *rest = node.inputs
    scaled = [x for x, mode in zip(("a", "b"), modes) if mode]
    extras = rest[len(scaled):]
    ta, tb = node.attrs["transpose_a"], node.attrs["transpose_b"]
    epilogue: Body = node.attrs.get("epilogue", Body(Arg(0), ((),)))
    *leading, m, n = node.shape
    k = a.shape[-2] if ta else a.shape[-1]
    # Partial sums (the split stage's `splits`): a leading axis of the result; grid layer
    # z = split * batch + batch index, each split summing its own range of k.
    pieces = node.attrs.get("splits", 1)
    if pieces > 1:
        leading = leading[1:]
    # Each operand's batch offset follows numpy broadcasting of its own leading dimensions
    # (stride 0 where it is broadcast).
    names = [f"i{x}" for x in range(len(leading) + 2)]
    batch = int(np.prod(leading, dtype=np.int64))
    chunk = -(-k // pieces)
    setup = [f"  let zb = z % {batch}u; let s = z / {batch}u;",
             *unflatten("zb", tuple(leading), "i")]
    for src, x in (("a", a), ("b", b)):
        mat = x.shape[-2] * x.shape[-1]
        strides = broadcast_strides(x.shape[:-2], tuple(leading))
        setup.append(f"  let {src}_base = {offset(names[:-2], tuple(s * mat for s in strides))};")
        if src in scaled:  # its largest magnitudes: one for each of its rows in memory
            rows = x.shape[-2]
            setup.append(f"  let {src}_scale_base = "
                         f"{offset(names[:-2], tuple(s * rows for s in strides))};")
    setup.append(f"  let c_base = z * {m * n}u;")
    # Four elements a read where both ends of the contiguous index are multiples of 4 (then
    # the binding is an array of vec4, which is what lets a read be 16 bytes wide).
    wide = {"a": not gemm.on_cpu(caps) and (m % 4 == 0 if ta else k % 4 == chunk % 4 == 0),
            "b": not gemm.on_cpu(caps) and (k % 4 == chunk % 4 == 0 if tb else n % 4 == 0)}
    a_op = gemm.indexed("mat_a", wide["a"], (lambda i, d: f"a_base + {d} * {m}u + {i}") if ta
                        else (lambda i, d: f"a_base + {i} * {k}u + {d}"), "row" if ta else "depth")
    b_op = gemm.indexed("mat_b", wide["b"], (lambda j, d: f"b_base + {j} * {k}u + {d}") if tb
                        else (lambda j, d: f"b_base + {d} * {n}u + {j}"), "depth" if tb else "row")
    ir, ic = names[-2], names[-1]

    def c_at(row: str, col: str) -> str:  # C[row, col]'s flat index, in every store below
        return f"c_base + {row} * {n}u + {col}"

    def reads(acc: str) -> dict[int, str]:
        return epilogue_reads(epilogue, acc, names, lambda e: f"ep{e}")

    def store(row: str, col: str, acc: str) -> list[str]:
        return [f"      let {ir} = {row}; let {ic} = {col};",
                *body_lines(epilogue, reads(acc), "      ",
                            f"mat_c[{c_at(ir, ic)}] =")]

    def store4(row: str, col: str, accs: list[str]) -> list[str]:
        lines = [f"      let {ir} = {row}; var o = vec4<f32>();"]
        for q, acc in enumerate(accs):
            lines += [f"      {{ let {ic} = {col} + {q}u;",
                      *body_lines(epilogue, reads(acc), "        ", f"o[{q}] ="), "      }"]
        return [*lines, f"      mat_c[({c_at(ir, col)}) / 4u] = o;"]

    tiling = tiling or choose(node, caps)
    # rows of C whose length is a multiple of 4 are stored four columns at a time
    wide_c = n % 4 == 0 and gemm.stores_wide(tiling, chunk)
    buffers = [gemm.binding("mat_a", wide["a"]), gemm.binding("mat_b", wide["b"]),
               *[Buf(f"{src}_scale") for src in scaled],
               *[Buf(f"ep{e + 1}", x.dtype) for e, x in enumerate(extras)],
               Buf("mat_c", "vec4<f32>" if wide_c else "f32", writable=True)]
    # no epilogue: the cooperative variant may store fragments straight to C (rows of a
    # multiple of 4 elements, so each fragment starts 16-byte aligned: the layouts measured)
    plain = (gemm.PlainStore(lambda r, c: f"mat_c[{c_at(f'({r})', c)}]", n)
             if "epilogue" not in node.attrs and not wide_c and n % 4 == 0 else None)
    tag = ("t" if ta else "n") + ("t" if tb else "n")
    prefix = f"b{'x'.join(map(str, leading))}_" if leading else ""
    split = f"_split{pieces}" if pieces > 1 else ""
    layers = batch * pieces
    return gemm.generate(f"{node.op}_{tag}_{prefix}{m}x{n}x{k}{split}", caps, buffers, m, n,
                         chunk, layers, a_op, b_op, store, tiling, setup=setup,
                         k_range=(f"s * {chunk}u", f"min(s * {chunk}u + {chunk}u, {k}u)"),
                         depth=k,
                         prelude=helper_functions(epilogue), flops=2 * batch * m * n * k,
                         nbytes=4 * (a.size + b.size + layers * m * n),
                         wide_store=gemm.WideStore("col", store4) if wide_c else None,
                         plain_store=plain,
                         scales=tuple(None if mode is None else gemm.Scale(
                             lambda i, src=src: f"{src}_scale[{src}_scale_base + {i}]",
                             per_row=mode == "rows") for src, mode in zip("ab", modes)))


def choose(node: Tensor, caps: Capabilities) -> gemm.Tiling | gemm.CoopTiling:
    """The tiling `generate` takes for a matmul node (split or not) on `caps`."""
    m, n, k, batch = dims(node)
    pieces = node.attrs.get("splits", 1)
    return gemm.choose(m, n, k, batch // pieces, caps, plain=True, coop_min=_coop_min(node, caps))


def scaled(node: Tensor, caps: Capabilities) -> bool:
    """Whether the node's kernel takes f16 tiles, which scale the operands into f16's range on
    a target with `scaled_operands` (OpDef.scaled)."""
    return gemm.in_f16(choose(node, caps))


def splits(node: Tensor, caps: Capabilities) -> int:
    """Partial sums the split stage cuts a matmul node into (OpDef.splits)."""
    return gemm.splits(*dims(node), caps, plain=True, coop_min=_coop_min(node, caps))


# Products whose cooperative fragments store straight to C (no epilogue, outside the backward
# pass, whose products may be scaled) take cooperative tiles from this depth, where they beat f32
# tiles (64-deep attention scores); through workgroup memory (an epilogue: SmolLM2's causal
# mask) they lost.
COOP_MIN_DIRECT_DEPTH = 64


def _coop_min(node: Tensor, caps: Capabilities) -> tuple[int, int]:
    """The fewest rows and columns, and the shallowest depth, of a matmul on cooperative
    tiles (gemm.choose's `coop_min`)."""
    direct = ("epilogue" not in node.attrs and not caps.scaled_operands
              and node.shape[-1] % 4 == 0)
    outputs, depth = gemm.COOP_MIN_MATMUL
    return outputs, COOP_MIN_DIRECT_DEPTH if direct else depth


def dims(node: Tensor) -> tuple[int, int, int, int]:
    """The GEMM shape (m, n, k, batch) of a matmul node."""
    a = node.inputs[0]
    *leading, m, n = node.shape
    k = a.shape[-2] if node.attrs["transpose_a"] else a.shape[-1]
    return m, n, k, int(np.prod(leading, dtype=np.int64))
