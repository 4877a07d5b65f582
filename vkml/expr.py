"""Elementwise computations as expression trees: what a pointwise op computes per element, what
fusion composes, and what the kernel generators render to WGSL.

An expression reads its inputs' elements (`Arg(k)`: input k at the element being computed), the
output's multi-index (`Axis(a)`), literals, and applies WGSL templates (`Call("max({0}, 0.0)",
(Arg(0),))`). Fusion substitutes one body's expression for another body's argument, so no WGSL
text is ever parsed or renamed; rendering gives each call a `let` of its own, and a subtree
shared by several parents (the same object) is computed once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

Shape = tuple[int, ...]


def contiguous_strides(shape: Shape) -> Shape:
    """Element strides of a row-major array of `shape`."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


def broadcast_strides(shape: Shape, out_shape: Shape) -> Shape:
    """Strides that read `shape` (numpy-broadcast to `out_shape`) at each output index."""
    own = contiguous_strides(shape)
    pad = len(out_shape) - len(shape)
    return tuple(0 if i < pad or shape[i - pad] == 1 else own[i - pad]
                 for i in range(len(out_shape)))


# eq=False: expressions are compared and shared by identity, so a fused body of thousands of
# nodes hashes in constant time and shared subtrees stay shared.
@dataclass(frozen=True, eq=False)
class Arg:
    """Element of input `k`, read at the input's strides for the current output index."""

    k: int


@dataclass(frozen=True, eq=False)
class Axis:
    """The current output index along `axis` (a u32)."""

    axis: int


@dataclass(frozen=True, eq=False)
class Lit:
    """An f32 literal (scalar constants fold into the kernel text)."""

    value: float


@dataclass(frozen=True, eq=False)
class Call:
    """A WGSL expression template over its arguments ({0}, {1}, ...); `helper`: WGSL functions
    the template calls (e.g. an erf approximation), emitted once per kernel."""

    template: str
    args: tuple[Expr, ...]
    helper: str = ""


Expr = Arg | Axis | Lit | Call


def call(template: str, *args: Expr, helper: str = "") -> Call:
    return Call(template, tuple(args), helper)


def substitute(expr: Expr, mapping: Mapping[int, Expr]) -> Expr:
    """`expr` with every Arg(k) replaced by mapping[k] (Args not in the mapping stay)."""
    done: dict[int, Expr] = {}
    for e in _postorder(expr):
        if isinstance(e, Arg):
            new: Expr = mapping.get(e.k, e)
        elif isinstance(e, Call):
            args = tuple(done[id(a)] for a in e.args)
            new = e if all(a is b for a, b in zip(args, e.args)) else Call(e.template, args,
                                                                          e.helper)
        else:
            new = e
        done[id(e)] = new
    return done[id(expr)]


def args_used(expr: Expr) -> set[int]:
    """The input indices `expr` reads."""
    seen: set[int] = set()
    used: set[int] = set()
    stack = [expr]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, Arg):
            used.add(e.k)
        elif isinstance(e, Call):
            stack.extend(e.args)
    return used


@dataclass(frozen=True)
class Body:
    """A pointwise computation: `result` over inputs read at `strides[k]` (the element stride
    of input k along each output axis; 0 broadcasts)."""

    result: Expr
    strides: tuple[Shape, ...]

    def __str__(self) -> str:
        lines = self.render({k: f"x{k}" for k in range(len(self.strides))}, "", "return")
        return "{ " + " ".join(lines) + " }"

    def helpers(self) -> list[str]:
        """The WGSL helper functions the body's calls need, each once, in first-use order."""
        found: dict[str, None] = {}
        for e in _postorder(self.result):
            if isinstance(e, Call) and e.helper:
                found.setdefault(e.helper.strip(), None)
        return list(found)

    def render(self, reads: Mapping[int, str], indent: str, target: str) -> list[str]:
        """WGSL lines: bind input k to the expression `reads[k]` (`let xk = ...`), compute the
        calls (`let vN = ...`, children first) and finish with `{target} <result>;` (e.g.
        `out[idx] =` or `acc +=`)."""
        lines = [f"{indent}let x{k} = {reads[k]};" for k in sorted(reads)]
        names: dict[int, str] = {}
        for e in _postorder(self.result):
            if isinstance(e, Call):
                text = e.template.format(*(_name(a, names) for a in e.args))
                if e is self.result:
                    names[id(e)] = text
                else:
                    names[id(e)] = f"v{len(names) + 1}"
                    lines.append(f"{indent}let {names[id(e)]} = {text};")
        lines.append(f"{indent}{target} {_name(self.result, names)};")
        return lines


def _name(e: Expr, names: Mapping[int, str]) -> str:
    if isinstance(e, Arg):
        return f"x{e.k}"
    if isinstance(e, Axis):
        return f"i{e.axis}"
    if isinstance(e, Lit):
        return f"({e.value:.9e})"
    return names[id(e)]


def _postorder(root: Expr) -> list[Expr]:
    """Each distinct node once, every node after its arguments (iterative: fused bodies can be
    deeper than Python's recursion limit)."""
    order: list[Expr] = []
    seen: set[int] = set()
    stack: list[tuple[Expr, bool]] = [(root, False)]
    while stack:
        e, expanded = stack.pop()
        if expanded:
            order.append(e)
            continue
        if id(e) in seen:
            continue
        seen.add(id(e))
        stack.append((e, True))
        if isinstance(e, Call):
            stack.extend((a, False) for a in reversed(e.args))
    return order
