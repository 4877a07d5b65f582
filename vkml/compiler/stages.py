"""The compiler's stages in order, each a function of the previous one's output:

    Graph --autodiff--> Graph --rewrite--> Graph --split--> Graph --schedule--> Plan
          (compiler/autodiff)  (compiler/compose,  (compiler/split) (compiler/schedule,
                                compiler/rewrite)                     compiler/memory_plan)
    Plan --codegen--> Plan + Kernels (compiler/codegen, vkml/kernels/)

`lower()` runs them all and keeps every intermediate, so `python -m vkml dump` and tests can print
any of them. The backend turns each kernel's WGSL into what its driver takes when a session binds
the plan to a device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass

from vkml.compiler import autodiff, codegen, plan_cache
from vkml.compiler.compose import fuse_compositions
from vkml.compiler.rewrite import fuse
from vkml.compiler.scale import scale_operands
from vkml.compiler.schedule import Plan, make_plan
from vkml.compiler.split import split_sums
from vkml.errors import DeviceError, GraphError, VkmlError
from vkml.graph import OPS, Graph, Tensor, user_stacklevel
from vkml.hal import Capabilities
from vkml.optim import Optimizer

# Which parameters a compilation trains: None keeps each parameter's own `trainable` flag; a
# collection of names or a predicate on the name overrides it.
Trainable = Collection[str] | Callable[[str], bool] | None


def trainable_params(graph: Graph, trainable: Trainable) -> dict[str, Tensor]:
    """The parameters that get gradients (and optimizer updates)."""
    if trainable is None:
        return {n: t for n, t in graph.params.items() if t.attrs.get("trainable", True)}
    if callable(trainable):
        return {n: t for n, t in graph.params.items() if trainable(n)}
    if isinstance(trainable, str):
        raise GraphError(f"trainable={trainable!r}: give a collection of parameter names or a "
                         "predicate, e.g. trainable=lambda name: name.startswith('decoder.')")
    unknown = sorted(set(trainable) - set(graph.params))
    if unknown:
        raise GraphError(f"trainable names unknown parameters {unknown}; parameters: "
                         f"{sorted(graph.params)}")
    return {n: t for n, t in graph.params.items() if n in trainable}


PRECISIONS = ("f32", "f16")


def target(caps: Capabilities, precision: str) -> Capabilities:
    """The capabilities codegen compiles for: the device's, with the arithmetic asked for."""
    if precision not in PRECISIONS:
        raise GraphError(f"unknown precision {precision!r}; use 'f32' (strict) or 'f16' "
                         "(matrix products and convolutions on f16 cooperative matrices with f32 "
                         "accumulation)")
    if precision == "f16" and not (caps.cooperative_matrix and caps.shader_f16):
        raise DeviceError(f"precision='f16' needs cooperative matrices (VK_KHR_cooperative_matrix "
                          f"with shaderFloat16), which {caps.device_name!r} does not offer; "
                          "compile with precision='f32'")
    return dataclasses.replace(caps, precision=precision)


STAGES = ("graph", "rewritten", "split", "plan", "memory", "wgsl")
REWRITES = ("greedy", "none")


@dataclass
class Stages:
    graph: Graph  # the user's graph extended with the backward pass
    roots: list[Tensor]  # outputs and gradients in `graph`
    rewritten: Graph
    rewritten_roots: list[Tensor]
    # long sums split, and the backward pass's f16 products scaled, for the device
    # (compiler/split.py, compiler/scale.py)
    split: Graph
    split_roots: list[Tensor]
    plan: Plan
    # Seconds per stage of this lowering: autodiff, rewrite, split, schedule, memory, codegen
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    def kernels(self) -> dict[str, str]:
        """Each distinct kernel's WGSL, by kernel name."""
        return {d.kernel.name: d.kernel.wgsl for d in self.plan.dispatches}

    def dump(self, stage: str) -> str:
        if stage == "graph":
            return self.graph.dump(self.roots)
        if stage == "rewritten":
            return self.rewritten.dump(self.rewritten_roots)
        if stage == "split":
            return self.split.dump(self.split_roots)
        if stage == "plan":
            return self.plan.dump()
        if stage == "memory":
            return self.plan.dump_memory()
        if stage == "wgsl":
            return "\n".join(f"// ---- kernel {name}\n{wgsl}" for name, wgsl in
                             self.kernels().items())
        raise GraphError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")


def check_arguments(graph: Graph, loss: object, optimizer: object, outputs: object) -> None:
    """What vkml.compile is handed, checked before anything is built from it."""
    if not isinstance(graph, Graph):
        raise GraphError(f"compile takes a vkml.Graph first, got {type(graph).__name__}")
    if optimizer is not None:
        if isinstance(optimizer, type):
            raise GraphError(f"optimizer={optimizer.__name__} is the class: pass an instance, "
                             f"e.g. optimizer=vkml.{optimizer.__name__}(lr=1e-3)")
        if not isinstance(optimizer, Optimizer):
            raise GraphError(f"optimizer must be a vkml optimizer (vkml.SGD, vkml.Adam, "
                             f"vkml.AdamW), got {type(optimizer).__name__}")
        if loss is None:
            raise GraphError("an optimizer needs a loss to minimise: compile(graph, loss=..., "
                             "optimizer=...)")
    if outputs is not None and not isinstance(outputs, Mapping):
        raise GraphError(f"outputs must map names to tensors, e.g. outputs={{'y': y}}; got "
                         f"{type(outputs).__name__}")
    for name, t in [*(outputs or {}).items(), *([("loss", loss)] if loss is not None else [])]:
        what = "the loss" if name == "loss" and t is loss else f"output '{name}'"
        if not isinstance(name, str) or not name:
            raise GraphError(f"output names must be non-empty strings, got {name!r}")
        if not isinstance(t, Tensor):
            raise GraphError(f"{what} must be a Tensor of this graph, got "
                             f"{t.__name__ if isinstance(t, type) else type(t).__name__}")
        if not graph._owns(t):
            raise GraphError(f"{what} {t.label} belongs to another Graph (created at "
                             f"{t.graph.created_at}) than the one compiled (created at "
                             f"{graph.created_at}); build it on the graph you compile")
    if loss is not None and loss.dtype != "f32":  # type: ignore[union-attr]
        raise GraphError(f"the loss must be f32 to differentiate, got {loss.label}")  # type: ignore[union-attr]


def index_ranges(graph: Graph, roots: list[Tensor]) -> dict[str, tuple[int, int, str]]:
    """Per i32 input that selects classes or rows (through views), the valid [first, end) and
    what it indexes (OpDef.indexes), so set_input refuses values PyTorch would raise on instead
    of computing a silently wrong loss."""
    ranges: dict[str, tuple[int, int, str]] = {}
    names = {t.id: n for n, t in graph.inputs.items()}
    for node in graph.reachable(roots):
        indexes = OPS[node.op].indexes
        if indexes is None:
            continue
        k, first, end, what = indexes(node)
        source = node.inputs[k]
        while OPS[source.op].kind == "view":
            source = source.inputs[0]
        if source.id in names:
            name = names[source.id]
            old = ranges.get(name)
            if old is None:
                ranges[name] = (first, end, f"{what} made at {node.where}")
            elif first > old[0] or end < old[1]:  # valid for every use: the intersection
                ranges[name] = (max(first, old[0]), min(end, old[1]),
                                f"{what} made at {node.where}")
    return ranges


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


def lower(graph: Graph, caps: Capabilities, loss: Tensor | None = None,
          optimizer: Optimizer | None = None, outputs: Mapping[str, Tensor] | None = None,
          rewrite: str = "greedy", keep_grads: bool | None = None,
          trainable: Trainable = None, precision: str = "f32",
          check_finite: bool = False) -> Stages:
    """Graph -> Plan, keeping each stage. Arguments as for `vkml.compile`."""
    with _collector_paused():
        return _lower(graph, caps, loss, optimizer, outputs, rewrite, keep_grads, trainable,
                      precision, check_finite)


def compile_plan(graph: Graph, caps: Capabilities, loss: Tensor | None = None,
                 optimizer: Optimizer | None = None,
                 outputs: Mapping[str, Tensor] | None = None, rewrite: str = "greedy",
                 keep_grads: bool | None = None, trainable: Trainable = None,
                 precision: str = "f32", check_finite: bool = False) -> Plan:
    """`lower(...).plan` through the plan cache (compiler/plan_cache.py): what `vkml.compile`
    binds. The intermediate stages are not kept (call `lower` for them)."""
    with _collector_paused():  # a cached plan is many small objects too
        return _compile_plan(graph, caps, loss, optimizer, outputs, rewrite, keep_grads,
                             trainable, precision, check_finite)


def _compile_plan(graph: Graph, caps: Capabilities, loss: Tensor | None,
                  optimizer: Optimizer | None, outputs: Mapping[str, Tensor] | None,
                  rewrite: str, keep_grads: bool | None, trainable: Trainable,
                  precision: str, check_finite: bool) -> Plan:
    check_arguments(graph, loss, optimizer, outputs)  # before hashing what was handed
    cache_key = None
    if plan_cache.enabled():
        try:
            named = {**(outputs or {}), **({"loss": loss} if loss is not None else {})}
            trained = (tuple(trainable_params(graph, trainable)) if loss is not None
                       else None)
            options = (rewrite, keep_grads, precision, optimizer is not None, check_finite)
            cache_key = plan_cache.key(graph, target(caps, precision), named, loss, optimizer,
                                       options, trained)
        except VkmlError:  # bad arguments: lowering says what is wrong
            cache_key = None
    plan = plan_cache.load(cache_key, graph, optimizer) if cache_key is not None else None
    if plan is None:
        plan = lower(graph, caps, loss=loss, optimizer=optimizer, outputs=outputs,
                     rewrite=rewrite, keep_grads=keep_grads, trainable=trainable,
                     precision=precision, check_finite=check_finite).plan
        if cache_key is not None:
            plan_cache.store(cache_key, plan, graph, optimizer)
    if plan.trainable is not None:
        _warn_unreached(graph, trainable, plan.trainable)
    return plan


def _warn_unreached(graph: Graph, trainable: Trainable, trained: Collection[str]) -> None:
    """One warning naming the trainable parameters the loss does not depend on (`trained`:
    those that got a gradient): they train as in PyTorch, which leaves their .grad None and
    whose optimizers then skip them, but a parameter left out by mistake should not go
    unnoticed."""
    unreached = [n for n in trainable_params(graph, trainable) if n not in trained]
    if unreached:
        warnings.warn(
            f"vkml.compile: the loss does not depend on the trainable parameter(s) "
            f"{unreached[:8]}{f' and {len(unreached) - 8} more' if len(unreached) > 8 else ''}"
            ": they get no gradient and no optimizer update, not even weight decay (as "
            "torch.optim skips a parameter whose .grad is None); params(), save and load keep "
            "them. Freeze them (graph.param(..., trainable=False) or compile(..., trainable=...)) "
            "to silence this", stacklevel=user_stacklevel())


def _lower(graph: Graph, caps: Capabilities, loss: Tensor | None,
           optimizer: Optimizer | None, outputs: Mapping[str, Tensor] | None, rewrite: str,
           keep_grads: bool | None, trainable: Trainable, precision: str,
           check_finite: bool) -> Stages:
    caps = target(caps, precision)
    if rewrite not in REWRITES:
        raise GraphError(f"unknown rewrite {rewrite!r}; use one of {REWRITES}")
    check_arguments(graph, loss, optimizer, outputs)
    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[stage] = now - clock
        clock = now

    work = graph.copy()
    named = dict(graph.outputs)
    for name, t in {**(outputs or {}), **({"loss": loss} if loss is not None else {})}.items():
        if named.get(name, t) is not t:
            raise GraphError(f"two different tensors are named '{name}'")
        named[name] = t
    if not named:
        raise GraphError("nothing to compute: pass loss=..., or mark tensors with "
                         "graph.output(name, tensor)")
    grads = (autodiff.gradients(work, loss, trainable_params(graph, trainable))
             if loss is not None else {})
    roots = [*named.values(), *grads.values()]
    lap("autodiff")
    fused, fused_named, fused_grads = work, named, grads
    if rewrite == "greedy":
        attended, attended_of = fuse_compositions(work, roots, caps)
        fused, fused_of = fuse(attended, [attended_of[t.id] for t in roots],
                               caps.max_bindings_per_stage - 1)
        fused_named = {n: fused_of[attended_of[t.id].id] for n, t in named.items()}
        fused_grads = {n: fused_of[attended_of[t.id].id] for n, t in grads.items()}
    fused_roots = [*fused_named.values(), *fused_grads.values()]
    lap("rewrite")
    split, new_of = split_sums(fused, fused_roots, caps, list(fused_named.values()))
    if caps.precision == "f16":
        split, scaled_of = scale_operands(split, [new_of[t.id] for t in fused_roots], caps,
                                          [new_of[t.id] for t in fused_named.values()])
        new_of = {i: scaled_of[t.id] for i, t in new_of.items() if t.id in scaled_of}
    split_named = {n: new_of[t.id] for n, t in fused_named.items()}
    split_grads = {n: new_of[t.id] for n, t in fused_grads.items()}
    lap("split")
    keep = optimizer is None if keep_grads is None else keep_grads
    plan = make_plan(split, split_named, split_grads, optimizer, caps, keep_grads=keep,
                     has_loss=loss is not None, check_finite=check_finite, timings=timings)
    clock = time.perf_counter()
    plan = codegen.generate(plan, caps)
    plan.input_ranges = index_ranges(work, roots)
    lap("codegen")
    return Stages(work, roots, fused, fused_roots, split,
                  [*split_named.values(), *split_grads.values()], plan, timings)
