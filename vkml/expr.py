"""Elementwise computations as expression trees: what a pointwise op computes per element, what
fusion composes, and what the kernel generators render to WGSL.

An expression reads its inputs' elements (`Arg(k)`: input k at the element being computed), the
output's multi-index (`Axis(a)`), literals, and applies WGSL templates (`Call("max({0}, 0.0)",
(Arg(0),))`). Fusion substitutes one body's expression for another body's argument, so no WGSL
text is ever parsed or renamed; rendering gives each call a `let` of its own, and a subtree
shared by several parents (the same object) is computed once.

Fusion grows a body one producer at a time, so substituting eagerly would copy the growing body
at every step (quadratic in a chain of pointwise ops). The rewrite stage substitutes lazily
instead (`Subst`: an expression and what its arguments stand for) and `materialize` carries out
all the nested substitutions of a final body in one pass, building exactly the expression eager
substitution would have built (the same calls shared, the same ones copied).
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


def in_order(strides: Shape, shape: Shape) -> bool:
    """Whether `strides` read a tensor of `shape` at the reader's own flat index. A dimension
    of size 1 may carry any stride (broadcast_strides gives it 0): at batch size 1 every
    activation has one, and comparing strides exactly once left SmolLM2's chains unfused."""
    return all(s == c or d == 1 for s, c, d in zip(strides, contiguous_strides(shape), shape,
                                                   strict=True))


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


@dataclass(frozen=True, eq=False)
class Subst:
    """`substitute(expr, dict(enumerate(env)))`, not carried out yet (see the module's doc): only
    the rewrite stage makes these, and it materializes every body before it returns."""

    expr: Lazy
    env: tuple[Lazy, ...]


Lazy = Expr | Subst


def call(template: str, *args: Expr, helper: str = "") -> Call:
    return Call(template, tuple(args), helper)


def substitute(expr: Expr, mapping: Mapping[int, Expr]) -> Expr:
    """`expr` with every Arg(k) replaced by mapping[k] (Args not in the mapping stay)."""
    done: dict[int, Expr] = {}
    for e in postorder(expr):
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


# lvl (see _Materializer) of a value that reads some input of the final body: never constant
_NEVER = 1 << 62


class _Frame:
    """A Subst being carried out: its Arg(k) stand for env[k] evaluated in `outer`."""

    __slots__ = ("outer", "sub")

    def __init__(self, sub: Subst, outer: _Frame | None) -> None:
        self.sub, self.outer = sub, outer


class _Materializer:
    """Carries out nested `Subst`s, copying each call once for all the substitutions around it.

    Eager substitution, `substitute(substitute(e, m1), m2)`, copies every call of `e` that reads
    an argument once per substitution, and keeps a call that reads none (a constant, e.g. from
    literals) as the same object from then on, so parents share it. Here a call `c` of the
    expression of a Subst is evaluated in a context, the chain of Substs whose expression it
    lies in (innermost first), and copied once per context; `lvl` counts how many of those
    substitutions it takes until the value reads no argument. A copy that ends up constant is
    the one eager substitution made at that level, so it is keyed by the chain up to there and
    shared by every context that chain continues into, as eager substitution shares it.
    Iterative (bodies are deeper than Python's recursion limit); linear in the result."""

    def __init__(self) -> None:
        self._done: dict[tuple[int, int], tuple[Expr, int]] = {}
        self._frames: dict[tuple[int, int], _Frame] = {}
        self._copies: dict[tuple, Call] = {}

    def _frame(self, sub: Subst, outer: _Frame | None) -> _Frame:
        key = (id(sub), id(outer))
        frame = self._frames.get(key)
        if frame is None:
            frame = self._frames[key] = _Frame(sub, outer)
        return frame

    def __call__(self, root: Lazy) -> Expr:
        done = self._done
        stack: list[tuple[Lazy, _Frame | None, bool]] = [(root, None, False)]
        while stack:
            e, ctx, ready = stack.pop()
            key = (id(e), id(ctx))
            if key in done:
                continue
            if isinstance(e, Arg):
                if ctx is None:
                    done[key] = (e, _NEVER)
                    continue
                value = ctx.sub.env[e.k]
                if ready:
                    found, lvl = done[id(value), id(ctx.outer)]
                    done[key] = (found, lvl if lvl == _NEVER else lvl + 1)
                else:
                    stack += [(e, ctx, True), (value, ctx.outer, False)]
            elif isinstance(e, Subst):
                frame = self._frame(e, ctx)
                if ready:
                    found, lvl = done[id(e.expr), id(frame)]
                    done[key] = (found, lvl if lvl == _NEVER else max(lvl - 1, 0))
                else:
                    stack += [(e, ctx, True), (e.expr, frame, False)]
            elif isinstance(e, Call):
                if ready:
                    done[key] = self._copy(e, ctx)
                else:
                    stack.append((e, ctx, True))
                    stack += [(a, ctx, False) for a in reversed(e.args)]
            else:  # Lit, Axis: kept as they are
                done[key] = (e, 0)
        return done[id(root), id(None)][0]

    def _copy(self, c: Call, ctx: _Frame | None) -> tuple[Expr, int]:
        done = self._done
        results = [done[id(a), id(ctx)] for a in c.args]
        lvl = max((r[1] for r in results), default=0)
        if lvl == 0:  # reads no argument: every substitution keeps it
            return c, 0
        if lvl == _NEVER:
            key: tuple = (id(c), id(ctx))
        else:  # constant after `lvl` substitutions: the copy the lvl-th one made
            chain, frame = [id(c)], ctx
            for _ in range(lvl):
                assert frame is not None
                chain.append(id(frame.sub))
                frame = frame.outer
            key = tuple(chain)
        copy = self._copies.get(key)
        if copy is None:
            copy = self._copies[key] = Call(c.template, tuple(r[0] for r in results), c.helper)
        return copy, lvl


def materialize(exprs: list[Lazy]) -> list[Expr]:
    """Each expression with its `Subst`s carried out, as eager `substitute` would give it
    (calls that several expressions share stay shared)."""
    run = _Materializer()
    return [run(e) for e in exprs]


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
    of input k along each output axis; 0 broadcasts). `result` holds `Subst`s only inside the
    rewrite stage."""

    result: Lazy
    strides: tuple[Shape, ...]

    def __str__(self) -> str:
        lines = self.render({k: f"x{k}" for k in range(len(self.strides))}, "", "return")
        return "{ " + " ".join(lines) + " }"

    def structure(self) -> tuple:
        """Everything rendering reads, as a hashable value: bodies with equal structures render
        to the same WGSL (each distinct node once, children by position; a literal by its repr,
        which tells 0.0 from -0.0 and 1 from 1.0)."""
        order = postorder(self.result)
        index = {id(e): i for i, e in enumerate(order)}
        nodes: list[tuple] = []
        for e in order:
            if isinstance(e, Call):
                nodes.append((e.template, e.helper, tuple(index[id(a)] for a in e.args)))
            elif isinstance(e, Arg):
                nodes.append(("arg", e.k))
            elif isinstance(e, Lit):
                nodes.append(("lit", repr(e.value)))
            else:
                nodes.append(("axis", e.axis))
        return self.strides, tuple(nodes)

    def reads_axes(self) -> bool:
        """Whether the result uses an output index (`Axis`), which a kernel must then define."""
        return any(isinstance(e, Axis) for e in postorder(self.result))

    def helpers(self) -> list[str]:
        """The WGSL helper functions the body's calls need, each once, in first-use order."""
        found: dict[str, None] = {}
        for e in postorder(self.result):
            if isinstance(e, Call) and e.helper:
                found.setdefault(e.helper.strip(), None)
        return list(found)

    def render(self, reads: Mapping[int, str], indent: str, target: str) -> list[str]:
        """WGSL lines: bind input k to the expression `reads[k]` (`let xk = ...`), compute the
        calls (`let vN = ...`, children first) and finish with `{target} <result>;` (e.g.
        `out[idx] =` or `acc +=`)."""
        lines = [f"{indent}let x{k} = {reads[k]};" for k in sorted(reads)]
        names: dict[int, str] = {}
        for e in postorder(self.result):
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


def postorder(root: Lazy) -> list[Expr]:
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
        elif isinstance(e, Subst):
            raise TypeError("an expression with a Subst in it was used before it was "
                            "materialized (expr.materialize)")
    return order
