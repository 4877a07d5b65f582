"""Reduction archetypes: one workgroup per output element (sum, max or min over any axes, a sum
with a fused prologue and epilogue; on GPUs one per few neighbouring outputs of a sum over
leading axes), and one workgroup per row for softmax / log-softmax (max, sum of exponentials,
write)."""

from __future__ import annotations

import numpy as np

from vkml.errors import GraphError
from vkml.expr import Arg, Body, call, contiguous_strides, in_order
from vkml.graph import Tensor
from vkml.hal import Capabilities, Kernel
from vkml.kernels.common import (
    ENTRY_ARGS,
    LINEAR_WORKGROUP,
    MAX_HELPER,
    MIN_HELPER,
    NEG_INF,
    POS_INF,
    Buf,
    assemble,
    body_lines,
    epilogue_reads,
    grid,
    helper_functions,
    is_finite,
    offset,
    result_store,
    tree_reduce,
    unflatten,
)

WORKGROUP = 64
# Reductions this short, into at least a workgroup's worth of outputs, run one thread per output
# element, looping over its terms: a workgroup per output would leave most of its threads idle.
SHORT = 64
# On GPUs a long reduction's workgroup grows until each thread sums about this many terms (its
# workgroups are few: one per output).
TERMS_PER_THREAD = 32
UNROLL = 4  # see unroll()


def workgroup_for(iterations: int, caps: Capabilities, node: Tensor) -> int:
    """The power-of-two workgroup (from WORKGROUP up) for a reduction of `iterations` terms per
    output: larger on GPUs for long ones, and large enough everywhere that no thread loops past
    the device's limit (lavapipe stops an invocation's loops after 65535 and keeps what it
    has)."""
    size = WORKGROUP
    limit = caps.max_loop_iterations
    while (limit is not None and -(-iterations // size) > limit) or (
            caps.device_type != "cpu" and iterations > TERMS_PER_THREAD * size
            and 2 * size <= min(1024, caps.max_workgroup_invocations)):
        size *= 2
        if size > caps.max_workgroup_invocations:
            raise GraphError(f"{node.label} (made at {node.where}): {iterations} "
                             f"terms per output are more than {caps.max_workgroup_invocations} "
                             f"threads can sum on {caps.device_name} without looping past its "
                             "limit: reduce in two steps (reshape the axis into two, sum each)")
    return size


def canonical(shape: tuple[int, ...], axes: tuple[int, ...]
              ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The same reduction over the fewest axes: axes of size 1 dropped, and neighbours that are
    both reduced or both kept merged into one. The flat (row-major) order of the input, of the
    outputs and of each output's terms is unchanged, so offsets computed on the result are the
    same. E.g. (1, 32, 16, 16) over (0, 2, 3) is (32, 256) over (1,): rows, no divisions."""
    dims: list[list[int]] = []  # [size, reduced]
    for a, n in enumerate(shape):
        if n == 1:
            continue
        reduced = int(a in axes)
        if dims and dims[-1][1] == reduced:
            dims[-1][0] *= n
        else:
            dims.append([n, reduced])
    return (tuple(n for n, _ in dims), tuple(i for i, (_, r) in enumerate(dims) if r))


def _input_offset(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[list[str], str]:
    """WGSL lines and the expression of the input offset of (output `o`, reduced index `r`)."""
    shape, axes = canonical(shape, axes)
    strides = contiguous_strides(shape)
    kept = [a for a in range(len(shape)) if a not in axes]
    reduced_count = int(np.prod([shape[a] for a in axes], dtype=np.int64))
    kept_count = int(np.prod([shape[a] for a in kept], dtype=np.int64))
    if all(a >= len(shape) - len(axes) for a in axes):  # trailing axes: rows of a matrix
        return [], f"o * {reduced_count}u + r"
    if all(a < len(axes) for a in axes):  # leading axes: columns of a matrix
        return [], f"r * {kept_count}u + o"
    lines = unflatten("o", tuple(shape[a] for a in kept), "k")
    lines += ["    " + line.strip() for line in unflatten("r", tuple(shape[a] for a in axes), "j")]
    indices = {a: f"k{n}" for n, a in enumerate(kept)} | {a: f"j{n}" for n, a in enumerate(axes)}
    return lines, offset([indices[a] for a in range(len(shape))], strides)


def generate_sum(node: Tensor, caps: Capabilities) -> Kernel:
    (x,) = node.inputs
    return _reduction(node, caps, x.shape, node.attrs["axes"],
                      Body(Arg(0), (contiguous_strides(x.shape),)), Body(Arg(0), ((),)), 1, "sum")


def generate_fused_sum(node: Tensor, caps: Capabilities) -> Kernel:
    """A sum whose summand is a prologue body over the first `n_prologue` inputs and whose
    result passes through an epilogue body (made by the rewrite stage)."""
    a = node.attrs
    return _reduction(node, caps, a["in_shape"], a["axes"], a["prologue"], a["epilogue"],
                      a["n_prologue"], "sum")


def generate_amax(node: Tensor, caps: Capabilities, magnitude: bool = False) -> Kernel:
    """The maximum, or with `magnitude` the largest finite absolute value (the powers of two
    of compiler/scale.py: an infinity or NaN stays what it is under any power of two, and
    one that chose the power would flush or overflow the numbers that share it), over the
    node's axes."""
    (x,) = node.inputs
    term = call(f"select(0.0, abs({{0}}), {is_finite('{0}')})", Arg(0)) if magnitude else Arg(0)
    return _reduction(node, caps, x.shape, node.attrs["axes"],
                      Body(term, (contiguous_strides(x.shape),)), Body(Arg(0), ((),)), 1, "max")


def generate_amin(node: Tensor, caps: Capabilities) -> Kernel:
    """The minimum over the node's axes."""
    (x,) = node.inputs
    return _reduction(node, caps, x.shape, node.attrs["axes"],
                      Body(Arg(0), (contiguous_strides(x.shape),)), Body(Arg(0), ((),)), 1, "min")


# combine -> (the accumulator's start, folding one term in, folding two partial results, helper
# functions)
_COMBINE = {"sum": ("0.0", "acc +=", "{a} + {b}", ()),
            "max": (NEG_INF, "acc = vkml_max(acc, term);", "vkml_max({a}, {b})", (MAX_HELPER,)),
            "min": (POS_INF, "acc = vkml_min(acc, term);", "vkml_min({a}, {b})", (MIN_HELPER,))}


def _reduction(node: Tensor, caps: Capabilities, in_shape: tuple[int, ...],
               axes: tuple[int, ...], prologue: Body, epilogue: Body, n_prologue: int,
               combine: str) -> Kernel:
    """A workgroup per output element, or on GPUs per `columns` neighbouring ones of a sum over
    leading axes (`_column_layout`): each output's threads (lanes) stride over the reduced
    elements (the prologue computing each term as it is read), then a tree reduction of the
    lanes, column by column, and the epilogue. Short reductions into many outputs take a
    thread per output instead (`_per_thread`)."""
    start, fold, merge, helper = _COMBINE[combine]
    reduced = int(np.prod([in_shape[a] for a in axes], dtype=np.int64))
    outputs = node.size
    setup, at = _input_offset(in_shape, axes)
    layout = _column_layout(in_shape, axes, caps)
    if layout is None and reduced <= SHORT and outputs >= WORKGROUP:
        return _per_thread(node, caps, in_shape, axes, prologue, epilogue, n_prologue, combine)
    columns, lanes = layout or (1, workgroup_for(reduced, caps, node))
    threads = columns * lanes
    per_output, per_term, terms = _prologue_reads(in_shape, axes, prologue, n_prologue)
    epilogue_reads, term, buffers = _parts(node, prologue, epilogue, n_prologue, terms, fold,
                                           "partial[0]" if columns == 1 else "partial[lid]",
                                           "      ")
    # thread lid sums output o over the terms lane, lane + lanes, ...
    index = ([f"  let o = {LINEAR_WORKGROUP};"] if columns == 1 else
             [f"  let o = ({LINEAR_WORKGROUP}) * {columns}u + lid % {columns}u;",
              f"  let lane = lid / {columns}u;"])
    entry = [f"fn main({ENTRY_ARGS}) {{", *index,
             f"  var acc = {start};",
             # Surplus workgroups of the 2-D grid, and columns past the end, skip the loads but
             # join the barriers.
             f"  if (o < {outputs}u) {{",
             *[line for line in setup if line.lstrip().startswith("let k")], *per_output,
             *_term_loops(reduced, lanes, unroll(reduced, lanes, caps),
                          [*["  " + line for line in setup if line.lstrip().startswith("let j")],
                           *["    " + line for line in per_term], f"      let at = {at};",
                           *term], first="lid" if columns == 1 else "lane"),
             "  }",
             "  partial[lid] = acc;",
             *tree_reduce("partial", threads, merge, kept=columns),
             f"  if ({'lid == 0u' if columns == 1 else f'lid < {columns}u'} && o < {outputs}u) {{",
             *unflatten("o", node.shape, "i"),
             *_store(node, epilogue, epilogue_reads, "    "), "  }", "}"]
    total = outputs * reduced
    return assemble(f"{node.op}_{'x'.join(map(str, in_shape))}_axes{''.join(map(str, axes))}",
                    caps, buffers, (threads,), entry, grid(-(-outputs // columns), caps),
                    prelude=[*_enables(node), *helper_functions(prologue, epilogue), *helper,
                             f"var<workgroup> partial: array<f32, {threads}>;"],
                    flops=2 * total, nbytes=4 * (total * n_prologue + outputs))


def unroll(reduced: int, wg: int, caps: Capabilities) -> int:
    """Terms a GPU thread reads per trip of its loop: a workgroup per output leaves few
    workgroups when outputs are few (a batch norm's channels), so each thread's loads must be in
    flight together (one a trip is a chain of memory latencies). CPU drivers keep one."""
    return UNROLL if caps.device_type != "cpu" and reduced >= UNROLL * wg else 1


def _term_loops(reduced: int, wg: int, times: int, body: list[str], first: str = "lid"
                ) -> list[str]:
    """The loop of a thread over terms r = first, first + wg, ... < `reduced`, `body` once per
    term (it uses `r`), `times` terms a trip and then one a trip for the rest: the terms are
    folded in the same order either way."""
    loops = []
    if times > 1:
        loops = [f"    var rt = {first};",
                 f"    for (; rt + {(times - 1) * wg}u < {reduced}u; rt += {times * wg}u) {{",
                 *[line for u in range(times)
                   for line in ["      {", f"      let r = rt + {u * wg}u;",
                                *["  " + b for b in body], "      }"]], "    }"]
    start = "rt" if times > 1 else first
    return [*loops, f"    for (var r = {start}; r < {reduced}u; r += {wg}u) {{", *body, "    }"]


# Sums over leading axes on GPUs (the columns of a matrix: a bias's gradient over 1500 tokens)
# take a workgroup of COLUMNS neighbouring columns x lanes of rows (COLUMN_THREADS in all), so a
# warp reads whole 32-byte sectors along each row; one workgroup per column, its threads
# reading down the column, touched a sector for each 4 bytes and chained its loads.
COLUMN_THREADS = 256
COLUMNS = 8
COLUMN_TERMS = 64  # terms a thread sums at most; longer columns take the workgroup per output
# Shorter columns (the split stage's partial sums: at most 16) keep a thread per output, which
# reads them along rows too and needs no workgroup memory.
COLUMN_MIN_ROWS = 32


def _column_layout(in_shape: tuple[int, ...], axes: tuple[int, ...], caps: Capabilities
                   ) -> tuple[int, int] | None:
    """(columns, lanes) of the column kernel for this reduction, or None where it does not
    apply: on CPU drivers, for reductions over other than leading axes, and for columns too
    short (COLUMN_MIN_ROWS) or too long for the largest workgroup's lanes to sum in
    COLUMN_TERMS each."""
    shape, reduced = canonical(in_shape, axes)
    if (caps.device_type == "cpu" or len(shape) != 2 or reduced != (0,)
            or shape[0] < COLUMN_MIN_ROWS):
        return None
    rows, columns = shape[0], COLUMNS
    lanes = COLUMN_THREADS // COLUMNS
    while rows > COLUMN_TERMS * lanes:
        if 2 * lanes * columns > min(1024, caps.max_workgroup_invocations):
            return None
        lanes *= 2
    return columns, lanes


def _prologue_reads(in_shape: tuple[int, ...], axes: tuple[int, ...], prologue: Body,
                    n_prologue: int) -> tuple[list[str], list[str], dict[int, str]]:
    """WGSL lines once per output, lines per term, and each prologue input's read: at the
    term's offset `at` where the input is laid out as the summand, else through its own strides
    (a norm's statistics broadcast over the reduced axis) from the summand's index i0, i1, ...,
    which a body that reads an axis (one_hot's comparison) gets too."""
    terms = {k: f"in{k}[at]" for k in range(n_prologue) if in_order(prologue.strides[k], in_shape)}
    if len(terms) == n_prologue and not prologue.reads_axes():
        return [], [], terms
    kept = [a for a in range(len(in_shape)) if a not in axes]
    index = ({a: f"kx{n}" for n, a in enumerate(kept)}
             | {a: f"jx{n}" for n, a in enumerate(axes)})
    per_term = [*unflatten("r", tuple(in_shape[a] for a in axes), "jx"),
                *[f"  let i{a} = {index[a]};" for a in range(len(in_shape))]]
    names = [f"i{a}" for a in range(len(in_shape))]
    return (unflatten("o", tuple(in_shape[a] for a in kept), "kx"), per_term,
            terms | {k: f"in{k}[{offset(names, prologue.strides[k])}]"
                     for k in range(n_prologue) if k not in terms})


def _parts(node: Tensor, prologue: Body, epilogue: Body, n_prologue: int,
           terms: dict[int, str], fold: str, total: str, indent: str
           ) -> tuple[dict[int, str], list[str], list[Buf]]:
    """What both reduction kernels share: the epilogue's reads (x0 = `total`, the others at the
    output index), the lines folding one term (the prologue over the inputs' `terms`) into
    `acc`, and the bindings (the inputs, then the output)."""
    out_index = [f"i{a}" for a in range(len(node.shape))]
    reads = epilogue_reads(epilogue, total, out_index, lambda k: f"in{n_prologue + k - 1}")
    fold_lines = (body_lines(prologue, terms, indent, fold) if fold.endswith("+=")
                  else [*body_lines(prologue, terms, indent, "let term ="), f"{indent}{fold}"])
    return reads, fold_lines, [*[Buf(f"in{k}", x.dtype) for k, x in enumerate(node.inputs)],
                               result_store(node, "")[2]]


def _store(node: Tensor, epilogue: Body, reads: dict[int, str], indent: str) -> list[str]:
    """The epilogue's result stored at output o (indices i0... in scope), in the node's layout
    (common.result_store)."""
    target, after, _ = result_store(node, "out[o] =")
    return [*body_lines(epilogue, reads, indent, target), *(indent + line for line in after)]


def _enables(node: Tensor) -> list[str]:
    return ["enable f16;"] if result_store(node, "")[2].dtype == "f16" else []


def _per_thread(node: Tensor, caps: Capabilities, in_shape: tuple[int, ...],
                axes: tuple[int, ...], prologue: Body, epilogue: Body, n_prologue: int,
                combine: str) -> Kernel:
    """One thread per output element summing its `reduced` terms in order."""
    start, fold, _, helper = _COMBINE[combine]
    reduced = int(np.prod([in_shape[a] for a in axes], dtype=np.int64))
    setup, at = _input_offset(in_shape, axes)
    per_output, per_term, terms = _prologue_reads(in_shape, axes, prologue, n_prologue)
    epilogue_reads, term, buffers = _parts(node, prologue, epilogue, n_prologue, terms, fold,
                                           "acc", "    ")
    entry = [f"fn main({ENTRY_ARGS}) {{",
             f"  let o = ({LINEAR_WORKGROUP}) * {WORKGROUP}u + lid;",
             f"  if (o >= {node.size}u) {{ return; }}",
             *[line for line in setup if line.lstrip().startswith("let k")], *per_output,
             f"  var acc = {start};",
             f"  for (var r = 0u; r < {reduced}u; r++) {{",
             *[line for line in setup if line.lstrip().startswith("let j")],
             *["  " + line for line in per_term],
             f"    let at = {at};", *term, "  }",
             *unflatten("o", node.shape, "i"),
             *_store(node, epilogue, epilogue_reads, "  "), "}"]
    total = node.size * reduced
    return assemble(f"{node.op}_{'x'.join(map(str, in_shape))}_axes{''.join(map(str, axes))}",
                    caps, buffers, (WORKGROUP,), entry, grid(-(-node.size // WORKGROUP), caps),
                    prelude=[*_enables(node), *helper_functions(prologue, epilogue), *helper],
                    flops=2 * total,
                    nbytes=4 * (total * n_prologue + node.size))


def generate_softmax(node: Tensor, caps: Capabilities) -> Kernel:
    return _rowwise(node, caps, log=False)


def generate_log_softmax(node: Tensor, caps: Capabilities) -> Kernel:
    return _rowwise(node, caps, log=True)


# A row this many elements a thread or fewer is held in registers: read once, each exponential
# computed once, where passes over memory read the row three times (max, sum, write).
HELD = 32


def _rowwise(node: Tensor, caps: Capabilities, log: bool) -> Kernel:
    """One workgroup per row of the last axis: the row's maximum, the sum of exponentials,
    then softmax (`log`: log-softmax) written for each element. As torch: a row of -inf is NaN
    (exp(-inf - -inf)), or 0 with the node's `masked_zero` (attention's fully masked rows, as
    torch's scaled_dot_product_attention gives them); a NaN or +inf makes its row NaN."""
    (x,) = node.inputs
    length = x.shape[-1]
    rows = x.size // length
    wg = workgroup_for(length, caps, node)
    held = -(-length // wg)
    if held <= HELD:
        # element lid + i * wg of the row is v{i}; past the row's end it is -inf, whose
        # exponential is 0
        full = length // wg
        values = [f"v{i}" for i in range(held)]
        read = [*[f"  let v{i} = inp[base + lid + {i * wg}u];" for i in range(full)],
                *[f"  let v{i} = select({NEG_INF}, inp[base + min(lid + {i * wg}u, "
                  f"{length - 1}u)], lid + {i * wg}u < {length}u);" for i in range(full, held)]]
        local_max = _fold("vkml_max", values)
        exps = [f"  let e{i} = exp(v{i} - row_max);" for i in range(held)]
        local_sum = " + ".join(f"e{i}" for i in range(held))
        write = [f"  {'' if i < full else f'if (lid + {i * wg}u < {length}u) '}"
                 f"{{ out[base + lid + {i * wg}u] = "
                 f"{f'v{i} - row_max - log_sum' if log else f'e{i} / row_sum'}; }}"
                 for i in range(held)]
    else:  # three passes over the row
        wg = workgroup_for(3 * length, caps, node)
        result = ("inp[base + c] - row_max - log_sum" if log
                  else "exp(inp[base + c] - row_max) / row_sum")
        read = [f"  var m = {NEG_INF};",
                f"  for (var c = lid; c < {length}u; c += {wg}u) {{",
                "    m = vkml_max(m, inp[base + c]);", "  }"]
        local_max = "m"
        exps = ["  var s = 0.0;",
                f"  for (var c = lid; c < {length}u; c += {wg}u) {{",
                "    s += exp(inp[base + c] - row_max);", "  }"]
        local_sum = "s"
        write = [f"  for (var c = lid; c < {length}u; c += {wg}u) {{",
                 f"    out[base + c] = {result};", "  }"]
    # every element is -inf exactly when the maximum is (a NaN makes the maximum NaN)
    masked_zero = [f"  if (row_max == {NEG_INF}) {{",
                   f"    for (var c = lid; c < {length}u; c += {wg}u) {{ out[base + c] = 0.0; }}",
                   "    return;", "  }", *write]
    entry = [f"fn main({ENTRY_ARGS}) {{",
             f"  let row = {LINEAR_WORKGROUP};",
             f"  let valid = row < {rows}u;",
             f"  let base = min(row, {rows - 1}u) * {length}u;",
             *read,
             f"  partial[lid] = {local_max};",
             *tree_reduce("partial", wg, "vkml_max({a}, {b})"),
             "  let row_max = partial[0];",
             "  workgroupBarrier();",
             *exps,
             f"  partial[lid] = {local_sum};",
             *tree_reduce("partial", wg, "{a} + {b}"),
             "  let row_sum = partial[0];",
             "  if (!valid) { return; }",
             *(["  let log_sum = log(row_sum);"] if log else []),
             *(masked_zero if node.attrs.get("masked_zero") else write), "}"]
    return assemble(f"{node.op}_{rows}x{length}", caps, [Buf("inp"), Buf("out", writable=True)],
                    (wg,), entry, grid(rows, caps),
                    prelude=[MAX_HELPER, f"var<workgroup> partial: array<f32, {wg}>;"],
                    flops=5 * x.size, nbytes=(8 if held <= HELD else 12) * x.size)


def _fold(fn: str, terms: list[str]) -> str:
    """fn(fn(t0, t1), fn(t2, t3)) ...: a balanced tree of a two-argument WGSL function."""
    while len(terms) > 1:
        terms = [f"{fn}({a}, {b})" if b else a
                 for a, b in zip(terms[::2], [*terms[1::2], None])]
    return terms[0]
