"""Matrix multiplication, with either operand read transposed (no transpose copy is made), and
batched over leading dimensions: (..., M, K) @ (..., K, N) with numpy broadcasting of the leading
dimensions (the kernel carries the batch in the z dimension of its dispatch grid); einsum in
terms of it."""

from __future__ import annotations

import math
from collections.abc import Sequence

from vkml.errors import GraphError
from vkml.graph import Graph, OpDef, Tensor, builder, register
from vkml.kernels import matmul as kernels
from vkml.ops.pointwise import broadcast_shapes, sum_to


def _matmul(inputs, attrs):
    a, b = inputs[:2]
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise GraphError(f"matmul takes operands of rank >= 2, got shapes {a.shape} and {b.shape}")
    if a.dtype != "f32" or b.dtype != "f32":
        raise GraphError(f"matmul takes f32 operands, got {a.dtype} and {b.dtype}")
    m, ka = a.shape[-2:][::-1] if attrs["transpose_a"] else a.shape[-2:]
    kb, n = b.shape[-2:][::-1] if attrs["transpose_b"] else b.shape[-2:]
    if ka != kb:
        ta = "^T" if attrs["transpose_a"] else ""
        tb = "^T" if attrs["transpose_b"] else ""
        raise GraphError(f"inner dimensions differ: a{ta} is ({m}, {ka}) and b{tb} is "
                         f"({kb}, {n}); {ka} != {kb}")
    try:
        leading = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except GraphError as e:
        raise GraphError(f"leading (batch) dimensions: {e}") from None
    return (*leading, m, n), "f32"


def _matmul_grad(g, node, d):
    # C = op(A) op(B); each case writes dA, dB in the stored layout of A and B, then sums over
    # the leading dimensions along which A or B was broadcast.
    a, b = node.inputs
    ta, tb = node.attrs["transpose_a"], node.attrs["transpose_b"]
    if not ta and not tb:
        da, db = g.matmul(d, b, transpose_b=True), g.matmul(a, d, transpose_a=True)
    elif not ta and tb:
        da, db = g.matmul(d, b), g.matmul(d, a, transpose_a=True)
    elif ta and not tb:
        da, db = g.matmul(b, d, transpose_b=True), g.matmul(a, d)
    else:
        da = g.matmul(b, d, transpose_a=True, transpose_b=True)
        db = g.matmul(d, a, transpose_a=True, transpose_b=True)
    return [sum_to(g, da, a.shape), sum_to(g, db, b.shape)]


register(OpDef("matmul", _matmul, "kernel", grad=_matmul_grad, lower=kernels.generate,
               splits=kernels.splits, fusion="product", fused="fused_matmul",
               scaled=kernels.scaled))


@builder
def matmul(g: Graph, a: Tensor, b: Tensor, transpose_a: bool = False,
           transpose_b: bool = False) -> Tensor:
    """op(a) @ op(b), op transposing the last two axes when asked (no copy is made); operands
    of rank > 2 are batches of matrices, their leading axes broadcast as numpy's. A vector
    (rank 1) is a row on the left and a column on the right, its axis then dropped from the
    result, as torch.matmul's."""
    if len(a.shape) == 1 or len(b.shape) == 1:
        rows = a if len(a.shape) != 1 else g.reshape(a, (1, a.shape[0]))
        columns = b if len(b.shape) != 1 else g.reshape(b, (b.shape[0], 1))
        out = g.matmul(rows, columns, transpose_a and rows is a, transpose_b and columns is b)
        kept = out.shape[:-2] + out.shape[-2:-1] * (len(a.shape) != 1) + \
            out.shape[-1:] * (len(b.shape) != 1)
        return g.reshape(out, kept)
    return g.apply("matmul", [a, b], transpose_a=bool(transpose_a),
                   transpose_b=bool(transpose_b))


# ---- einsum: matmuls, transposes, reshapes and sums of the graph, so it differentiates and fuses
# as they do --------------------------------------------------------------------------------------
Labels = list[str]


def _parse_einsum(equation: str, operands: Sequence[Tensor]) -> tuple[list[Labels], Labels]:
    """Each operand's labels and the output's; an ellipsis stands for the same leading axes
    (right-aligned, as numpy's) wherever it appears, as labels "...0", "...1", ..."""
    def refuse(why: str) -> GraphError:
        return GraphError(f"einsum '{equation}': {why}")

    spec = equation.replace(" ", "")
    inputs, arrow, output = spec.partition("->")
    terms = inputs.split(",")
    if len(terms) != len(operands):
        raise refuse(f"{len(terms)} operand terms for {len(operands)} operands")
    for term in [*terms, output]:
        if any(not (c.isascii() and c.isalpha()) for c in term.replace("...", "")):
            raise refuse(f"term '{term}' holds other than letters and one '...'")
    spans = [len(x.shape) - len(t.replace("...", "")) for t, x in zip(terms, operands)]
    longest = max([s for t, s in zip(terms, spans) if "..." in t], default=0)
    labels = []
    for term, span, x in zip(terms, spans, operands):
        if span < 0 or ("..." not in term and span != 0):
            raise refuse(f"term '{term}' does not name the {len(x.shape)} axes of {x.label}")
        head, _, tail = term.partition("...")
        own = [*head, *[f"...{longest - span + i}" for i in range(span)], *tail]
        if any(x.shape[own.index(n)] != d for n, d in zip(own, x.shape)):
            raise refuse(f"term '{term}' repeats a label over axes of {x.label} of different "
                         "lengths")
        labels.append(own)
    if arrow:
        head, _, tail = output.partition("...")
        out = [*head, *([f"...{i}" for i in range(longest)] if "..." in output else []), *tail]
        if len(set(out)) != len(out) or not set(out) <= {a for own in labels for a in own}:
            raise refuse("the output repeats a label or names one no operand has")
    else:  # numpy's implicit output: the ellipsis, then the labels seen once, in order
        seen = [a for own in labels for a in own if not a.startswith("...")]
        out = [f"...{i}" for i in range(longest)] + sorted(a for a in set(seen)
                                                           if seen.count(a) == 1)
    return labels, out


def _pair(g: Graph, a: Tensor, la: Labels, b: Tensor, lb: Labels, keep: set[str]
          ) -> tuple[Tensor, Labels]:
    """a * b summed over their shared labels not in `keep`, as one (batched) matmul."""
    batch = [x for x in la if x in lb and x in keep]
    summed = [x for x in la if x in lb and x not in keep]
    free_a, free_b = [x for x in la if x not in lb], [x for x in lb if x not in la]
    size = dict(zip(la, a.shape)) | dict(zip(lb, b.shape))

    def arranged(x: Tensor, own: Labels, first: Labels, second: Labels) -> tuple[Tensor, bool]:
        """x as (batch, prod first, prod second), or read transposed where it lies the other
        way round already (a transpose only where neither order is how it lies)."""
        flipped = own == batch + second + first
        if not flipped and own != batch + first + second:
            x = g.transpose(x, [own.index(n) for n in batch + first + second])
        inner = (second, first) if flipped else (first, second)
        dims = [size[n] for n in batch] + [math.prod(size[n] for n in part) for part in inner]
        return g.reshape(x, dims), flipped

    ma, ta = arranged(a, la, free_a, summed)
    mb, tb = arranged(b, lb, summed, free_b)
    product = g.matmul(ma, mb, transpose_a=ta, transpose_b=tb)
    result = batch + free_a + free_b
    return g.reshape(product, [size[n] for n in result]), result


def _diagonals(g: Graph, x: Tensor, own: Labels) -> tuple[Tensor, Labels]:
    """x with each label it repeats taken once, along the diagonal: the two axes moved last,
    flattened, and every (n + 1)-th element sliced out."""
    while len(set(own)) != len(own):
        label = next(n for n in own if own.count(n) > 1)
        first = own.index(label)
        second = own.index(label, first + 1)
        rest = [a for a in range(len(own)) if a not in (first, second)]
        if rest + [first, second] != list(range(len(own))):
            x = g.transpose(x, rest + [first, second])
        n = x.shape[-1]
        x = g.slice(g.reshape(x, (*x.shape[:-2], n * n)), -1, 0, n * n, n + 1)
        own = [own[a] for a in rest] + [label]
    return x, own


def _sum_unused(g: Graph, x: Tensor, own: Labels, keep: set[str]) -> tuple[Tensor, Labels]:
    """x summed over its labels outside `keep`."""
    gone = [i for i, n in enumerate(own) if n not in keep]
    return (g.sum(x, gone) if gone else x), [n for n in own if n in keep]


@builder
def einsum(g: Graph, equation: str, *operands: Tensor) -> Tensor:
    """torch.einsum / ONNX Einsum, as matmuls (one a pair of operands, left to right), sums,
    transposes and reshapes: e.g. 'bhqd,bhkd->bhqk', 'bij,bjk->bik', 'ij->ji', '...ij,jk'.
    Axes of size 1 broadcast against their label's size; a label repeated within one term
    takes the diagonal ('ii->i', 'ii' the trace)."""
    if not operands:
        raise GraphError(f"einsum '{equation}': no operands")
    labels, out = _parse_einsum(equation, operands)
    size: dict[str, int] = {}
    for x, own in zip(operands, labels):
        for n, d in zip(own, x.shape):
            if size.get(n, 1) not in (1, d) and d != 1:
                raise GraphError(f"einsum '{equation}': label '{n}' is {size[n]} long in one "
                                 f"operand and {d} in {x.label}")
            size[n] = max(size.get(n, 1), d)
    items = []
    for k, (x, own) in enumerate(zip(operands, labels)):
        full = tuple(size[n] for n in own)
        x, own = _diagonals(g, x if x.shape == full else g.broadcast_to(x, full), own)
        # a label no other operand nor the output has is summed away first
        others = set(out).union(*[set(o) for j, o in enumerate(labels) if j != k])
        items.append(_sum_unused(g, x, own, others))
    x, own = items[0]
    for k, (y, other) in enumerate(items[1:], start=2):
        keep = set(out).union(*[set(o) for _, o in items[k:]])
        x, own = _pair(g, x, own, y, other, keep)
    x, own = _sum_unused(g, x, own, set(out))
    return x if own == out else g.transpose(x, [own.index(n) for n in out])
