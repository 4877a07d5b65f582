"""The compiler's stages in order, each a function of the previous one's output and the
compilation's options (compiler/options.py), the device's capabilities their target:

    Graph --autodiff--> Rooted --compose, rewrite, layouts--> Rooted --split, scale, stores-->
          (compiler/autodiff)  (compiler/compose,                   (compiler/split,
                                compiler/rewrite,                    compiler/scale,
                                compiler/layouts: inference only)    compiler/layouts)
          Rooted --schedule--> Plan --codegen--> Plan with kernels
            (compiler/schedule,  (compiler/codegen, vkml/kernels/)
             compiler/memory_plan)

A Rooted (compiler/rooted.py) is a graph with its named outputs and gradients: every graph pass
takes one and returns one. `lower()` runs them all (`_lower` is the pipeline) and keeps every
intermediate, so `python -m vkml dump` and tests can print any of them. The backend turns each
kernel's WGSL into what its driver takes when a session binds the plan to a device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
import warnings
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from vkml.compiler import autodiff, codegen, plan_cache
from vkml.compiler.compose import fuse_compositions
from vkml.compiler.layouts import relayout_operands, store_layouts
from vkml.compiler.options import CompileOptions
from vkml.compiler.plan import Plan
from vkml.compiler.rebuild import rebuild
from vkml.compiler.rewrite import fuse
from vkml.compiler.rooted import Rooted
from vkml.compiler.scale import scale_operands
from vkml.compiler.schedule import make_plan
from vkml.compiler.split import split_sums
from vkml.errors import GraphError, VkmlError
from vkml.graph import OPS, Graph, Tensor, user_stacklevel
from vkml.hal import Capabilities

STAGES = ("graph", "rewritten", "split", "plan", "memory", "wgsl")


@dataclass
class Stages:
    graph: Rooted  # the user's graph extended with the backward pass
    rewritten: Rooted
    # long sums split, and the backward pass's f16 products scaled, for the device
    # (compiler/split.py, compiler/scale.py)
    split: Rooted
    plan: Plan
    nodes: tuple[Tensor | None, ...]  # per dispatch of the plan, the node it computes
    prologue_nodes: tuple[Tensor | None, ...]  # and per dispatch of its prologue
    # Seconds per stage of this lowering: autodiff, rewrite, split, schedule, memory, codegen
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    def kernels(self) -> dict[str, str]:
        """Each distinct kernel's WGSL, by kernel name."""
        return {d.kernel.name: d.kernel.wgsl
                for d in (*self.plan.prologue, *self.plan.dispatches)}

    def dump(self, stage: str) -> str:
        if stage in ("graph", "rewritten", "split"):
            return getattr(self, stage).dump()
        if stage == "plan":
            return self.plan.dump()
        if stage == "memory":
            return self.plan.dump_memory()
        if stage == "wgsl":
            return "\n".join(f"// ---- kernel {name}\n{wgsl}" for name, wgsl in
                             self.kernels().items())
        raise GraphError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")


def _index_operands(rooted: Rooted) -> Iterator[tuple[Tensor, int, Tensor, int, int, str]]:
    """Every index operand of the nodes the roots reach (OpDef.indexes): (the node, which
    input, what computes that input's values seen through views, the valid [first, end), what
    it indexes)."""
    for node in rooted.graph.reachable(rooted.roots):
        indexes = OPS[node.op].indexes
        if indexes is None:
            continue
        k, first, end, what = indexes(node)
        source = node.inputs[k]
        while OPS[source.op].kind == "view":
            source = source.inputs[0]
        yield node, k, source, first, end, what


def index_ranges(rooted: Rooted) -> dict[str, tuple[int, int, str]]:
    """Per i32 input that selects classes or rows (through views), the valid [first, end) and
    what it indexes (OpDef.indexes), so set_input refuses values PyTorch would raise on instead
    of computing a silently wrong loss."""
    ranges: dict[str, tuple[int, int, str]] = {}
    names = {t.id: n for n, t in rooted.graph.inputs.items()}
    for node, _, source, first, end, what in _index_operands(rooted):
        if source.id in names:
            name = names[source.id]
            old = ranges.get(name)
            if old is None:
                ranges[name] = (first, end, f"{what} made at {node.where}")
            elif first > old[0] or end < old[1]:  # valid for every use: the intersection
                ranges[name] = (max(first, old[0]), min(end, old[1]),
                                f"{what} made at {node.where}")
    return ranges


def _braces(text: str) -> str:
    """`text` as itself inside a str.format template."""
    return text.replace("{", "{{").replace("}", "}}")


def _within(source: Tensor, first: int, end: int) -> bool:
    """Whether every value `source` computes lies in [first, end) by construction."""
    produced = OPS[source.op].index_range
    if produced is None:
        return False
    low, high = produced(source)
    return first <= low and high <= end


def index_checks(rooted: Rooted, max_operands: int) -> Rooted:
    """`rooted` with checks of the index operands set_input cannot see: a constant's values
    are checked now (GraphError); values computed on the GPU (a slice, concat or transpose of
    an input, another op's result) by `index_check` nodes (vkml/ops/indexing.py) of up to
    `max_operands` operands each, added to the graph with what each operand is, for the error
    the session raises (Rooted.checks)."""
    graph = rooted.graph
    inputs = {t.id for t in graph.inputs.values()}
    operands: dict[tuple[int, int, int], tuple[Tensor, str]] = {}
    for node, k, source, first, end, what in _index_operands(rooted):
        operand = node.inputs[k]
        # {value} and {at} are filled in by the session (Session._check_indices)
        about = (_braces(f"{node.label} made at {node.where}") + " read {value} at flat "
                 f"position {{at}} of its {what} operand " + _braces(operand.label)
                 + f", outside [{first}, {end})")
        if source.op == "constant":
            values = graph.initial_values[source.id]
            bad = np.flatnonzero((values < first) | (values >= end))
            if bad.size:
                raise GraphError(about.format(value=int(values.flat[bad[0]]), at=int(bad[0]))
                                 + ": a constant index out of range")
        elif source.id not in inputs and not _within(source, first, end):
            operands.setdefault((operand.id, first, end), (operand, about))
    found = list(operands.items())
    checks = []
    for at in range(0, len(found), max_operands):
        group = found[at:at + max_operands]
        node = graph.apply("index_check", [t for _, (t, _) in group],
                           ranges=tuple((first, end) for (_, first, end), _ in group))
        checks.append((node, tuple(about for _, (_, about) in group)))
    return dataclasses.replace(rooted, checks=(*rooted.checks, *checks))


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off, as it was after. Lowering makes millions of
    objects and frees few of them until it returns, so the collector's full passes, each over
    every object of the process, found little and grew with the graph: a third of a large
    graph's lowering. What lowering leaves in cycles is collected later, as usual."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def lower(graph: Graph, caps: Capabilities, options: CompileOptions | None = None,
          **keywords: Any) -> Stages:
    """Graph -> Plan, keeping each stage. `options`, or CompileOptions(**keywords): as for
    `vkml.compile`."""
    options = options or CompileOptions(**keywords)
    options.check(graph)
    with _collector_paused():
        return _lower(graph, caps, options)


def compile_plan(graph: Graph, caps: Capabilities, options: CompileOptions | None = None,
                 **keywords: Any) -> Plan:
    """`lower(...).plan` through the plan cache (compiler/plan_cache.py): what `vkml.compile`
    binds. The intermediate stages are not kept (call `lower` for them)."""
    options = options or CompileOptions(**keywords)
    options.check(graph)  # before hashing what was handed
    with _collector_paused():  # a cached plan is many small objects too
        cache_key = _cache_key(graph, caps, options)
        plan = (plan_cache.load(cache_key, graph, options.optimizer) if cache_key is not None
                else None)
        if plan is None:
            plan = _lower(graph, caps, options).plan
            if cache_key is not None:
                plan_cache.store(cache_key, plan, graph, options.optimizer)
    if plan.trainable is not None:
        _warn_unreached(graph, options, plan.trainable)
    return plan


def _warn_unreached(graph: Graph, options: CompileOptions, trained: Collection[str]) -> None:
    """One warning naming the trainable parameters the loss does not depend on (`trained`:
    those that got a gradient): they train as in PyTorch, which leaves their .grad None and
    whose optimizers then skip them, but a parameter left out by mistake should not go
    unnoticed."""
    unreached = [n for n in options.trained(graph) if n not in trained]
    if unreached:
        warnings.warn(
            f"vkml.compile: the loss does not depend on the trainable parameter(s) "
            f"{unreached[:8]}{f' and {len(unreached) - 8} more' if len(unreached) > 8 else ''}"
            ": they get no gradient and no optimizer update, not even weight decay (as "
            "torch.optim skips a parameter whose .grad is None); params(), save and load keep "
            "them. Freeze them (graph.param(..., trainable=False) or compile(..., trainable=...)) "
            "to silence this", stacklevel=user_stacklevel())


def _cache_key(graph: Graph, caps: Capabilities, options: CompileOptions) -> str | None:
    if not plan_cache.enabled():
        return None
    try:
        loss = options.loss
        named = {**options.outputs, **({"loss": loss} if loss is not None else {})}
        trained = tuple(options.trained(graph)) if loss is not None else None
        keyed = (options.rewrite, options.keep_grads, options.precision,
                 options.optimizer is not None, options.check_finite, options.hoist)
        return plan_cache.key(graph, options.target(caps), named, loss, options.optimizer,
                              keyed, trained)
    except VkmlError:  # bad arguments: lowering says what is wrong
        return None


class _Clock:
    """Seconds per stage, into `timings`."""

    def __init__(self, timings: dict[str, float]) -> None:
        self.timings, self.last = timings, time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.timings[stage] = now - self.last
        self.last = now


def inference_forms(rooted: Rooted) -> Rooted:
    """Compiled without a loss, every step is inference: a node of an op that acts in training
    steps alone (OpDef.training_only: dropout) is its first input."""
    if not any(OPS[t.op].training_only for t in rooted.graph.reachable(rooted.roots)):
        return rooted
    return rebuild(rooted, lambda node, inputs, emit: (
        inputs[0] if OPS[node.op].training_only
        else emit(node.op, inputs, node.shape, node.attrs, node)))


def _lower(graph: Graph, caps: Capabilities, options: CompileOptions) -> Stages:
    """The pipeline."""
    caps = options.target(caps)
    timings: dict[str, float] = {}
    clock = _Clock(timings)
    differentiated = autodiff.differentiate(graph, options)
    if options.loss is None:
        differentiated = inference_forms(differentiated)
    differentiated = index_checks(differentiated, caps.max_bindings_per_stage - 1)
    clock.lap("autodiff")
    rewritten = differentiated
    if options.rewrite == "greedy":
        rewritten = fuse(fuse_compositions(differentiated, caps), caps.max_bindings_per_stage - 1)
    if options.loss is None:
        rewritten = relayout_operands(rewritten, caps)
    clock.lap("rewrite")
    split = split_sums(rewritten, caps)
    if caps.precision == "f16":
        split = scale_operands(split, caps)
    if options.loss is None:
        split = store_layouts(split)
    clock.lap("split")
    scheduled = make_plan(split, options, caps, index_ranges(differentiated), timings=timings)
    clock.last = time.perf_counter()  # make_plan timed schedule and memory
    plan = codegen.generate(scheduled, caps)
    clock.lap("codegen")
    hoisted = len(plan.prologue)
    return Stages(differentiated, rewritten, split, plan, scheduled.nodes[hoisted:],
                  scheduled.nodes[:hoisted], timings)
