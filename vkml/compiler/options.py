"""What a compilation is asked for besides the graph and the device: `vkml.compile`'s keywords as
one frozen record, checked once when it is made, which every stage reads from."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from vkml.errors import DeviceError, GraphError
from vkml.graph import STATE_PREFIX, Graph, Tensor
from vkml.hal import Capabilities
from vkml.optim import Optimizer

# Which parameters a compilation trains: None keeps each parameter's own `trainable` flag; a
# collection of names or a predicate on the name overrides it.
Trainable = Collection[str] | Callable[[str], bool] | None

PRECISIONS = ("f32", "f16", "bf16")
REWRITES = ("greedy", "none")


@dataclass(frozen=True)
class CompileOptions:
    """`vkml.compile`'s options (its docstring says what each does). Made once per compilation
    and checked as it is made; `check(graph)` adds what needs the graph."""

    loss: Tensor | None = None
    optimizer: Optimizer | None = None
    outputs: Mapping[str, Tensor] = field(default_factory=dict)
    rewrite: str = "greedy"
    keep_grads: bool | None = None
    trainable: Trainable = None
    precision: str = "f32"
    check_finite: bool = False
    hoist: bool = True

    def __post_init__(self) -> None:
        loss, optimizer, outputs = self.loss, self.optimizer, self.outputs
        if self.precision not in PRECISIONS:
            raise GraphError(f"unknown precision {self.precision!r}; use 'f32' (strict), "
                             "'f16' (matrix products in f16: on cooperative matrices where "
                             "the device has them, else in f16 arithmetic) or 'bf16' "
                             "(matrix products on bfloat16 cooperative matrices)")
        if self.rewrite not in REWRITES:
            raise GraphError(f"unknown rewrite {self.rewrite!r}; use one of {REWRITES}")
        for name in ("keep_grads", "check_finite", "hoist"):  # "no" would be true
            value = getattr(self, name)
            if not isinstance(value, bool | np.bool_) and (name != "keep_grads"
                                                           or value is not None):
                raise GraphError(f"{name} takes True or False"
                                 + (" (or None: the default)" if name == "keep_grads" else "")
                                 + f", got {value!r}")
        if optimizer is not None:
            if isinstance(optimizer, type):
                raise GraphError(f"optimizer={optimizer.__name__} is the class: pass an "
                                 f"instance, e.g. optimizer=vkml.{optimizer.__name__}(lr=1e-3)")
            if not isinstance(optimizer, Optimizer):
                raise GraphError(f"optimizer must be a vkml optimizer (vkml.SGD, vkml.Adam, "
                                 f"vkml.AdamW), got {type(optimizer).__name__}")
            if loss is None:
                raise GraphError("an optimizer needs a loss to minimise: compile(graph, "
                                 "loss=..., optimizer=...)")
        if outputs is None:
            outputs = {}
        if not isinstance(outputs, Mapping):
            raise GraphError(f"outputs must map names to tensors, e.g. outputs={{'y': y}}; got "
                             f"{type(outputs).__name__}")
        for name, t in self._named(outputs):
            if not isinstance(name, str) or not name:
                raise GraphError(f"output names must be non-empty strings, got {name!r}")
            if not isinstance(t, Tensor):
                raise GraphError(f"{self._what(name, t)} must be a Tensor of this graph, got "
                                 f"{t.__name__ if isinstance(t, type) else type(t).__name__}")
        if loss is not None and loss.dtype != "f32":
            raise GraphError(f"the loss must be f32 to differentiate, got {loss.label}")
        object.__setattr__(self, "outputs", MappingProxyType(dict(outputs)))
        trainable = self.trainable
        if isinstance(trainable, str):
            raise GraphError(f"trainable={trainable!r}: give a collection of parameter names "
                             "or a predicate, e.g. trainable=lambda name: "
                             "name.startswith('decoder.')")
        if trainable is not None and not callable(trainable):
            # Read once: a generator's names would be gone by the second pass that asks
            # (every parameter then frozen, in silence).
            try:
                object.__setattr__(self, "trainable", frozenset(trainable))
            except TypeError:
                raise GraphError(f"trainable={trainable!r}: give a collection of parameter "
                                 "names or a predicate on the name") from None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The options' names, as `vkml.compile` takes them."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def _named(self, outputs: Mapping[str, Tensor]) -> list[tuple[str, Tensor]]:
        return [*outputs.items(), *([("loss", self.loss)] if self.loss is not None else [])]

    def _what(self, name: str, t: object) -> str:
        return "the loss" if name == "loss" and t is self.loss else f"output '{name}'"

    def check(self, graph: Graph) -> None:
        """That the graph is one and owns every tensor named here, and that an optimizer has
        something to train (torch.optim refuses an empty parameter list too)."""
        if not isinstance(graph, Graph):
            raise GraphError(f"compile takes a vkml.Graph first, got {type(graph).__name__}")
        if self.optimizer is not None and not self.trained(graph):
            chosen = ("the graph's parameters are all frozen (trainable=False)"
                      if self.trainable is None else "the trainable predicate accepts none"
                      if callable(self.trainable) else "trainable names no parameter")
            raise GraphError(f"nothing to train: {chosen}; parameters: "
                             f"{sorted(graph.params)[:8]}{' ...' if len(graph.params) > 8 else ''}"
                             ". Name some to train, or compile without an optimizer (the loss "
                             "and gradients alone)")
        for name, t in self._named(self.outputs):
            if not graph.owns(t):
                raise GraphError(f"{self._what(name, t)} {t.label} belongs to another Graph "
                                 f"(created at {t.graph.created_at}) than the one compiled "
                                 f"(created at {graph.created_at}); build it on the graph you "
                                 "compile")

    @property
    def keeps_grads(self) -> bool:
        """Gradients stay readable after a step: by default only without an optimizer."""
        return self.optimizer is None if self.keep_grads is None else self.keep_grads

    def named(self, graph: Graph) -> dict[str, Tensor]:
        """What the compilation computes by name: the graph's outputs, these, and the loss."""
        named = dict(graph.outputs)
        for name, t in self._named(self.outputs):
            if named.get(name, t) is not t:
                raise GraphError(f"two different tensors are named '{name}'")
            # read(name) would return that input's or parameter's value instead (the graph's
            # own outputs were checked by graph.output)
            taken = graph.inputs.get(name, graph.params.get(name))
            if (taken is not None and taken is not t) or name in graph.extras or (
                    name in graph.unsupported_tensors or name.startswith(STATE_PREFIX)):
                what = (taken.label if taken is not None else
                        "the optimizer state in checkpoints" if name.startswith(STATE_PREFIX)
                        else "a checkpoint entry of the graph")
                loss = name == "loss" and t is self.loss
                raise GraphError(("the loss is read as 'loss', a name" if loss else
                                  f"the output name '{name}' is") + f" already used by "
                                 f"{what}: " + ("rename that one" if loss else
                                                "give the output another name"))
            named[name] = t
        if not named:
            raise GraphError("nothing to compute: pass loss=..., or mark tensors with "
                             "graph.output(name, tensor)")
        return named

    def trained(self, graph: Graph) -> dict[str, Tensor]:
        """The parameters that get gradients (and optimizer updates)."""
        trainable = self.trainable
        if trainable is None:
            return {n: t for n, t in graph.params.items() if t.attrs.get("trainable", True)}
        if callable(trainable):
            return {n: t for n, t in graph.params.items() if trainable(n)}
        unknown = sorted(set(trainable) - set(graph.params))
        if unknown:
            raise GraphError(f"trainable names unknown parameters {unknown}; parameters: "
                             f"{sorted(graph.params)}")
        return {n: t for n, t in graph.params.items() if n in trainable}

    def target(self, caps: Capabilities) -> Capabilities:
        """The capabilities codegen compiles for: the device's, with the arithmetic asked
        for."""
        target = dataclasses.replace(caps, precision=self.precision)
        if self.precision == "f16" and target.f16_products is None:
            raise DeviceError(f"precision='f16' needs f16 arithmetic (shaderFloat16 with "
                              f"storageBuffer16BitAccess), which {caps.device_name!r} does not "
                              "offer; compile with precision='f32'")
        if self.precision == "bf16" and target.f16_products is None:
            instead = "precision='f16' or 'f32'" if caps.shader_f16 else "precision='f32'"
            raise DeviceError(f"precision='bf16' needs cooperative matrices with bfloat16 "
                              "operands (VK_KHR_cooperative_matrix, and VK_KHR_shader_bfloat16 "
                              "with shaderBFloat16CooperativeMatrix and a 16x16x16 bfloat16 "
                              f"configuration), which {caps.device_name!r} does not offer; "
                              f"compile with {instead}")
        return target
