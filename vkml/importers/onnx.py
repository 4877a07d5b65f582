"""The ONNX front end: an ONNX model (opset 13 and newer; older ones converted to 13 first)
-> a vkml Graph.

Only this module imports `onnx` (the optional extra `vkml[onnx]`). Shapes are fixed at import:
open dimensions of the inputs come from `shapes=` (by input, or by dimension name), and every
node whose inputs are all known on the host (shape arithmetic: Shape, Gather, Concat, Range,
ConstantOfShape, ...) is computed there by onnx's reference implementation of the op and becomes
a constant. The other nodes become vkml ops through the table below (one function an op type),
onnxruntime's contrib ops (com.microsoft) among them. Float initializers that computations
read become parameters under their own names (trainable; batch-norm running statistics and a
loss's class weights frozen); integer initializers, one-element ones (an exporter's scalars) and
those read only where a value must be known at import (a Reshape's shape) stay host constants.

`training=True` keeps the training behaviour the export recorded: a Dropout whose training_mode
input is true drops, a BatchNormalization with training_mode=1 normalises by the batch's
statistics. `training=False` computes the inference forms whatever the export recorded.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vkml.errors import ModelImportError
from vkml.files import write_atomic
from vkml.graph import Graph, Tensor
from vkml.importers import patterns
from vkml.importers.common import (
    ImportedModel,
    Refusals,
    Refuse,
    convert_guarded,
    fold,
    fourier,
    gather_points,
    last_axis,
    matmul,
    power,
    scatter_along,
    slice_along,
    take,
)
from vkml.models.common import heads as split_heads
from vkml.models.common import merge_heads
from vkml.ops.composite import COORDINATE_MODES

MIN_OPSET = 13
# save_onnx writes the tensors of a larger model to an external-data file beside it
EXTERNAL_DATA_ABOVE = 1 << 30
FLOAT_TYPES = {"FLOAT", "FLOAT16", "DOUBLE", "BFLOAT16"}
INT_TYPES = {"INT64", "INT32", "INT16", "INT8", "UINT8", "UINT16", "UINT32", "BOOL"}
# Ops whose result depends on the values of their data at run time (its shape, or which
# branch runs): a static graph cannot hold them unless those values are known at import.
DATA_DEPENDENT = {
    "NonZero": "its output's length is the number of non-zero elements, known only at run time",
    "NonMaxSuppression": "the number of boxes it keeps is known only at run time",
    "Unique": "its output's length depends on the data",
    "Compress": "its output's length depends on the condition's values",
    "Loop": "vkml does not unroll loops, not even over a trip count known at import: export "
            "the model with the loop written out in Python (traced), not scripted",
    "Scan": "vkml does not unroll scans: export the recurrence written out (traced)",
    "If": "the branch taken depends on a value computed at run time",
}
# onnxruntime's ops that its optimizer writes in the standard domain (LayerNormalization
# also below opset 17, where ONNX has none)
ORT_STANDARD_DOMAIN = {"LayerNormalization", "SimplifiedLayerNormalization"}
# Never computed at import even when their inputs are known.
NOT_FOLDED = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
              "Bernoulli", "Multinomial", "Dropout", "Loop", "Scan", "If"}

Value = Any  # a vkml Tensor (on the device), a numpy array (known at import) or an Initializer


@dataclass(eq=False)
class Initializer:
    """A float initializer: a parameter of the graph once a computation reads it; its array
    where a value must be known at import (a shape, a scale)."""

    name: str
    array: np.ndarray


@dataclass(frozen=True)
class TensorSequence:
    """An ONNX sequence (SplitToSequence, SequenceConstruct, ...) of values the device
    computes: its items, whose number is known at import, each a Tensor or a known array."""

    items: tuple


def _onnx():
    try:
        import onnx
    except ImportError as e:
        raise ModelImportError("importing ONNX models needs the onnx package: "
                               "pip install 'vkml[onnx]'") from e
    return onnx


def import_onnx(model: Any, shapes: Mapping[str, Sequence[int]] | None = None,
                training: bool = False, seed: int = 0) -> ImportedModel:
    """Import an ONNX model: a path (external-data files beside it are read), bytes or an
    onnx.ModelProto. `shapes`: the full shape of an input with open dimensions, or the size
    of a named dimension ("batch": 2) for every input that has it.
    Raises ModelImportError for an unreadable, malformed or truncated file, an opset out of
    range, a missing external-data file, or (all at once) every op that cannot be imported."""
    onnx = _onnx()
    original, source = _read(onnx, model)
    proto, opset = _standard_opset(onnx, _inlined(onnx, original), source)
    refusals = Refusals(source)
    builder = _Builder(onnx, proto, opset, dict(shapes or {}), training, refusals, seed, source)
    builder.run()
    refusals.check()
    return builder.result(original)


def _given(key: str, value: Any, whole: bool) -> Any:
    """A shapes= entry: an input's whole shape (a sequence of ints) or a dimension's size (an
    int), else a ModelImportError naming it."""
    ints = (list(value) if isinstance(value, Sequence | np.ndarray) and not isinstance(value, str)
            else [value] if not whole else None)
    if ints is None or not all(isinstance(v, numbers.Integral) for v in ints):
        raise ModelImportError(f"shapes['{key}'] = {value!r}: give an input's whole shape as a "
                               "tuple of ints, or a named dimension's size as an int")
    return tuple(int(v) for v in ints) if whole else int(ints[0])


# ---- reading and checking the file ---------------------------------------------------------------
def _read(onnx, model: Any) -> tuple[Any, str]:
    if isinstance(model, onnx.ModelProto):
        proto, source, base = model, "the ONNX model", None
    elif isinstance(model, (bytes, bytearray)):
        source, base = "the ONNX model bytes", None
        proto = _parse(onnx, lambda: onnx.load_from_string(bytes(model)), source)
    else:
        try:
            path = os.fsdecode(os.fspath(model))
        except TypeError:
            raise ModelImportError(f"import_onnx takes a path, bytes or an onnx.ModelProto, got "
                                   f"{type(model).__name__}") from None
        source, base = f"'{path}'", os.path.dirname(os.path.abspath(path))
        if not os.path.isfile(path):
            raise ModelImportError(f"{source}: no such file")
        proto = _parse(onnx, lambda: onnx.load(path, load_external_data=False), source)
    missing = []
    for tensor in _all_tensors(proto):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            location = {e.key: e.value for e in tensor.external_data}.get("location", "")
            where = os.path.join(base, location) if base is not None else location
            if base is None or not os.path.isfile(where):
                missing.append(f"'{tensor.name}' in '{where}'")
    if missing:
        fix = ("keep the data files beside the model" if base is not None else
               "pass the file's path (vkml reads the data files beside it), or a model loaded "
               "with its external data (onnx.load(path))")
        raise ModelImportError(f"{source} keeps tensors in external-data files that are not "
                               f"there: {', '.join(missing[:5])}" + (" (and more)" if
                                                                    len(missing) > 5 else "")
                               + f"; {fix}")
    if base is not None:
        try:
            onnx.load_external_data_for_model(proto, base)
        except Exception as e:  # a data file shorter than the offsets it should hold
            raise ModelImportError(f"{source}: its external data cannot be read: {e}") from e
    if not proto.graph.node or not proto.graph.output:
        raise ModelImportError(f"{source} has no nodes or no outputs: a truncated or empty "
                               "ONNX file?")
    proto = _type_outputs(onnx, proto)
    try:
        onnx.checker.check_model(_checkable(onnx, proto))
    except onnx.checker.ValidationError as e:
        raise ModelImportError(f"{source} is not a valid ONNX model: {e}") from e
    return proto, source


def _checkable(onnx, proto):
    """The model as onnx's checker can read it: onnxruntime's own ops that its optimizer writes
    in the standard domain (ORT_STANDARD_DOMAIN, at opsets where ONNX has no such op) moved,
    in a copy, to onnxruntime's domain, which the checker leaves alone."""
    opset = {o.domain: o.version for o in proto.opset_import}.get("", 0)
    if not any(n.op_type in ORT_STANDARD_DOMAIN and n.domain in ("", "ai.onnx") and
               not onnx.defs.has(n.op_type, opset) for n in proto.graph.node):
        return proto
    checked = onnx.ModelProto()
    checked.CopyFrom(proto)
    for node in checked.graph.node:
        if node.op_type in ORT_STANDARD_DOMAIN and not onnx.defs.has(node.op_type, opset):
            node.domain = "com.microsoft"
    if all(o.domain != "com.microsoft" for o in checked.opset_import):
        checked.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return checked


def _type_outputs(onnx, proto):
    """Graph outputs declared by name alone (onnxruntime runs such files; onnx's checker
    requires a type) given, in a copy, the type onnx's shape inference finds for them."""
    if all(o.HasField("type") for o in proto.graph.output):
        return proto
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception:  # the checker names the missing type
        return proto
    found = {v.name: v.type for v in [*inferred.graph.value_info, *inferred.graph.output,
                                      *inferred.graph.input] if v.HasField("type")}
    typed = onnx.ModelProto()
    typed.CopyFrom(proto)
    for output in typed.graph.output:
        if not output.HasField("type") and output.name in found:
            output.type.CopyFrom(found[output.name])
    return typed


def _parse(onnx, load: Callable[[], Any], source: str) -> Any:
    try:
        return load()
    except Exception as e:  # protobuf's DecodeError and the like
        raise ModelImportError(f"{source} cannot be read as an ONNX model (truncated, or not "
                               f"ONNX): {type(e).__name__}: {e}") from e


def _all_tensors(proto) -> list:
    tensors = list(proto.graph.initializer)
    for node in proto.graph.node:
        tensors += [a.t for a in node.attribute if a.HasField("t")]
    return tensors


def _inlined(onnx, proto):
    """The model with its local functions (torch.onnx's export_modules_as_functions, onnxscript
    functions) inlined into the graph, as onnx's inliner writes them; the model as it is
    without any."""
    if not proto.functions:
        return proto
    from onnx import inliner
    return inliner.inline_local_functions(proto)


def _standard_opset(onnx, proto, source: str) -> tuple[Any, int]:
    """The model and its standard opset; a model older than MIN_OPSET converted to it by
    onnx's version converter (whose adapters rewrite what changed: attributes that became
    inputs, Softmax's flattening before opset 13), which save_onnx leaves as it was."""
    versions = {o.domain: o.version for o in proto.opset_import}
    opset = versions.get("", versions.get("ai.onnx"))
    newest = onnx.defs.onnx_opset_version()
    if opset is None:
        raise ModelImportError(f"{source} imports no version of the standard ONNX opset")
    if opset > newest:
        raise ModelImportError(f"{source} uses opset {opset}, newer than this onnx package "
                               f"knows ({newest}): upgrade onnx, or export with an older opset")
    if opset >= MIN_OPSET:
        return proto, opset
    from onnx import version_converter
    try:
        return version_converter.convert_version(proto, MIN_OPSET), MIN_OPSET
    except Exception as e:  # an op the converter has no adapter for, a vendor domain
        raise ModelImportError(
            f"{source} uses opset {opset}, which vkml reads by converting it to opset "
            f"{MIN_OPSET} with onnx.version_converter, and that failed: {e}; export it at "
            f"opset {MIN_OPSET} or newer") from None


# ---- the conversion ----------------------------------------------------------------------------
def _dtype(onnx, elem_type: int) -> str:
    name = onnx.TensorProto.DataType.Name(elem_type)
    if name in FLOAT_TYPES:
        return "f32"
    if name in INT_TYPES:
        return "i32"
    raise Refuse(f"element type {name} is not supported (vkml computes in f32 and i32)")


class _Builder:
    """One import: walks the nodes in order, folding what is known at import and building the
    rest, and records every refusal instead of stopping at the first."""

    def __init__(self, onnx, proto, opset: int, shapes: dict, training: bool,
                 refusals: Refusals, seed: int, source: str) -> None:
        self.onnx, self.proto, self.opset, self.training = onnx, proto, opset, training
        self.shapes, self.refusals, self.source = shapes, refusals, source
        self.g = Graph(seed=seed)
        self.env: dict[str, Value] = {}
        self.poisoned: set[str] = set()
        self.params: dict[str, Tensor] = {}  # initializer name -> its parameter
        self.frozen: list[str] = []
        self.inputs: dict[str, Tensor] = {}
        self.outputs: dict[str, Tensor] = {}
        self.consumers = _consumers(proto.graph)
        self._elem_types: dict[str, int] | None = None  # filled where a type must be known

    # -- values ----
    def device(self, value: Value, trainable: bool = True) -> Tensor:
        """`value` as a tensor of the graph: an initializer becomes its parameter, an array
        known at import a constant."""
        if isinstance(value, Tensor):
            return value
        if isinstance(value, Initializer):
            if value.name not in self.params:
                self.params[value.name] = self.g.param(value.name, value.array.shape,
                                                       value.array, trainable=trainable)
                if not trainable:
                    self.frozen.append(value.name)
            return self.params[value.name]
        array = np.asarray(value)
        if array.dtype.kind in "fb":  # vkml's booleans are f32 masks
            return self.g.constant(array.astype(np.float32))
        if array.dtype.kind in "iu":
            return self.g.constant(array, "i32")
        raise Refuse(f"a constant of dtype {array.dtype} cannot be used on the device")

    def is_bool(self, name: str, value: Value) -> bool:
        """Whether the ONNX value `name` is boolean (vkml holds booleans as f32 masks, or i32
        where they are the graph's inputs): its array's dtype where known at import, else its
        declared type, else the type onnx's shape inference gives it."""
        if isinstance(value, Initializer):
            return False  # float
        if not isinstance(value, Tensor):
            return np.asarray(value).dtype == bool
        if self._elem_types is None:
            graph = self.proto.graph
            try:
                graph = self.onnx.shape_inference.infer_shapes(self.proto).graph
            except Exception:  # a model too large for inference in memory: the declared types
                pass
            self._elem_types = {v.name: v.type.tensor_type.elem_type for v in
                                [*graph.input, *graph.value_info, *graph.output]}
        if name not in self._elem_types:
            raise Refuse(f"the type of '{name}' is unknown (onnx's shape inference gives none); "
                         "declare it in the graph's value_info")
        return self._elem_types[name] == self.onnx.TensorProto.BOOL

    @staticmethod
    def host(value: Value, what: str) -> np.ndarray:
        """`value` as it is known at import; a refusal where it is computed at run time."""
        if isinstance(value, Initializer):
            return value.array
        if isinstance(value, Tensor):
            raise Refuse(f"its {what} must be known at import, but it is computed at run time "
                         f"({value.type})")
        return np.asarray(value)

    def operand(self, value: Value) -> Tensor | float:
        """A binary op's operand: a one-element constant as a number (as a hand-written
        `x * 0.5` makes it), anything else as a tensor."""
        if isinstance(value, np.ndarray) and value.size == 1 and value.ndim == 0:
            return float(value)
        return self.device(value)

    # -- walking the graph ----
    def run(self) -> None:
        graph = self.proto.graph
        initializers = {t.name for t in graph.initializer} | {
            t.values.name for t in graph.sparse_initializer}
        self.initializers(graph)
        self._inputs(graph, initializers)
        self.walk(graph.node)
        for out in graph.output:
            if out.name in self.poisoned:
                continue
            value = self.env.get(out.name)
            tensor = convert_guarded(self.refusals, out.name, "output",
                                     lambda v=value: self.device(v))
            if tensor is None:
                continue
            if out.name in self.g.inputs or out.name in self.g.params:
                # an output that is an input or an initializer as it is: a session reads a
                # parameter by that name already, and an input is the caller's own array
                self.outputs[out.name] = tensor
            else:
                self.outputs[out.name] = self.g.output(out.name, tensor)

    def initializers(self, graph) -> None:
        """A graph's (or an inlined branch's) initializers into the environment: floats of
        more than one element as Initializers, the rest as arrays known at import."""
        for t in graph.initializer:
            array = _numeric(self.onnx.numpy_helper.to_array(t))
            float_param = array.dtype.kind == "f" and array.size > 1
            self.env[t.name] = Initializer(t.name, array) if float_param else array
        # sparse ones stay constants: save_onnx writes trained values as dense initializers
        for t in graph.sparse_initializer:
            self.env[t.values.name] = _dense(t)

    def _inputs(self, graph, initializers) -> None:
        """The graph's inputs at fixed shapes: each dimension the model fixes, else the one
        `shapes` gives, by input (a whole shape) or by the dimension's name ("batch": 2, which
        every input with that dimension shares; the names an input's given shape fixes too)."""
        declared = {i.name: _declared_dims(i) for i in graph.input if i.name not in initializers}
        names = {d for dims in declared.values() for d in dims if isinstance(d, str)}
        unknown = sorted(set(self.shapes) - set(declared) - names)
        if unknown:
            raise ModelImportError(
                f"shapes= names {unknown}, which are neither inputs of {self.source} (its "
                f"inputs: {list(declared)}) nor names of their dimensions "
                f"({sorted(names) or 'it names none'})")
        sizes = {k: _given(k, v, whole=False) for k, v in self.shapes.items()
                 if k not in declared}
        for name, dims in declared.items():
            given = self.shapes.get(name)
            if given is None:
                continue
            given = _given(name, given, whole=True)
            if len(given) != len(dims) or any(isinstance(d, int) and d != s
                                              for d, s in zip(dims, given)):
                raise ModelImportError(f"shapes['{name}'] = {given} does not fit the model's "
                                       f"input shape {_shown(dims)}")
            for d, s in zip(dims, given):
                if isinstance(d, str) and sizes.setdefault(d, s) != s:
                    raise ModelImportError(f"shapes= gives dimension '{d}' two sizes, "
                                           f"{sizes[d]} and {s} ('{name}' has it too)")
        unresolved = []
        for name, dims in declared.items():
            given = self.shapes.get(name)
            if given is not None:
                shape = _given(name, given, whole=True)
            else:
                shape = tuple(sizes.get(d, d) if isinstance(d, str) else d for d in dims)
                open_axes = [f"axis {a} {_dim_label(d)}" for a, (d, s) in
                             enumerate(zip(dims, shape)) if not isinstance(s, int) or s <= 0]
                if open_axes:
                    unresolved.append(f"'{name}' {_shown(dims)}: {', '.join(open_axes)}")
                    continue
            if any(s <= 0 for s in shape):
                raise ModelImportError(f"input '{name}': shape {shape} has an axis of size "
                                       "below 1; shapes= takes positive sizes")
            t = next(i for i in graph.input if i.name == name).type.tensor_type
            try:
                dtype = _dtype(self.onnx, t.elem_type)
            except Refuse as e:
                raise ModelImportError(f"input '{name}': {e}") from None
            self.env[name] = self.inputs[name] = self.g.input(name, shape, dtype)
        if unresolved:
            raise ModelImportError(
                f"{self.source} has inputs whose dimensions are not fixed: "
                f"{'; '.join(unresolved)}. vkml compiles for fixed shapes: pass them with "
                f"shapes=, by input or by dimension name, e.g. shapes={_example(declared)}")

    def walk(self, nodes) -> None:
        producer = {out: node for node in nodes for out in node.output}
        for index, node in enumerate(nodes):
            composite = patterns.onnx_composite(self, node, producer)
            if composite is not None:
                self._fused(node, composite)
            else:
                self.node(node, index)

    def _fused(self, node, build: Callable[[], Tensor]) -> None:
        """A recognised pattern ending at `node`: its composite op replaces its nodes."""
        name = _node_name(node, 0)
        result = convert_guarded(self.refusals, name, node.op_type, build)
        self._bind(node, [result] if result is not None else None)

    def node(self, node, index: int) -> None:
        name = _node_name(node, index)
        op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        handler = HANDLERS.get(op)
        ins = [self.env.get(i) if i else None for i in node.input]
        if any(i in self.poisoned for i in node.input if i):
            # what reads a value that could not be built is most likely computed on the device
            if handler is None and op not in DATA_DEPENDENT:
                self.refusals.unsupported(op, name)
            self._bind(node, None)
            return
        missing = [i for i, v in zip(node.input, ins) if i and v is None]
        if missing:
            self.refusals.refuse(name, op, f"reads {missing}, which nothing before it defines")
            self._bind(node, None)
            return
        known = all(not isinstance(v, (Tensor, Initializer, TensorSequence))
                    for v in ins if v is not None)
        if known and op not in NOT_FOLDED and node.domain in ("", "ai.onnx"):
            outs = convert_guarded(self.refusals, name, op, lambda: self.fold(node, ins))
        elif handler is not None:
            outs = convert_guarded(self.refusals, name, op, lambda: handler(self, node, ins,
                                                                           _attrs(node)))
        elif op in DATA_DEPENDENT:
            self.refusals.refuse(name, op, f"data-dependent: {DATA_DEPENDENT[op]}")
            outs = None
        elif known:
            outs = convert_guarded(self.refusals, name, op, lambda: self.fold(node, ins))
        else:
            self.refusals.unsupported(op, name)
            outs = None
        self._bind(node, outs)

    def _bind(self, node, outs) -> None:
        if outs is None:
            self.poisoned.update(o for o in node.output if o)
            return
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        for name, value in zip(node.output, outs):
            if name and value is not None:
                self.env[name] = value
        # the outputs vkml does not compute (None, or past those given): refused where read
        left = [o for o, v in zip(node.output, outs) if v is None] + node.output[len(outs):]
        for name in left:
            if name and name in self.consumers:
                self.refusals.refuse(_node_name(node, 0), node.op_type,
                                     f"its output '{name}' is read, and vkml does not compute it")
                self.poisoned.add(name)

    def fold(self, node, ins: list) -> list[np.ndarray]:
        """The node computed at import by onnx's reference implementation of it (numpy's
        where that implementation fails on valid input)."""
        if node.op_type in HOST_FOLDS and node.domain in ("", "ai.onnx"):
            return HOST_FOLDS[node.op_type](ins, _attrs(node))
        from onnx.reference.ops import load_op
        try:
            cls = load_op(node.domain, node.op_type, self.opset)
        except Exception:
            raise Refuse("no reference implementation to compute it at import") from None
        run = cls(node, {"log": lambda *a: None, "opsets": {"": self.opset}, "verbose": 0,
                         "new_ops": None, "evaluator_cls": None})
        outs = run.run(*[np.asarray(v) if v is not None else None for v in ins])
        return [np.asarray(o) for o in outs]

    def result(self, original) -> ImportedModel:
        """The imported model; save_onnx writes `original` (the file as it was read, before
        any opset conversion) with the trained initializers."""
        onnx, proto = self.onnx, original
        dtypes = {t.name: onnx.numpy_helper.to_array(t).dtype for t in proto.graph.initializer
                  if t.name in self.params}

        def save(values: dict[str, np.ndarray], path: str) -> None:
            out = onnx.ModelProto()
            out.CopyFrom(proto)
            for t in out.graph.initializer:
                if t.name in values:
                    t.CopyFrom(onnx.numpy_helper.from_array(
                        np.asarray(values[t.name]).astype(dtypes[t.name]), t.name))
            size = sum(len(t.raw_data) for t in out.graph.initializer)
            if size < EXTERNAL_DATA_ABOVE:
                write_atomic(os.fspath(path), out.SerializeToString())
            else:  # protobuf's 2 GiB limit: the tensors go to a file beside the model
                onnx.save(out, path, save_as_external_data=True, all_tensors_to_one_file=True,
                          location=os.path.basename(path) + ".data", size_threshold=0)

        return ImportedModel(self.g, dict(self.inputs), dict(self.outputs), self.source,
                             params={n: n for n in self.params}, frozen=tuple(self.frozen),
                             _save_onnx=save)


def _declared_dims(value_info) -> list[int | str | None]:
    """An input's declared dimensions: a size, a name (dim_param), or None where neither is
    given or the size is not positive (exporters write 0 or -1 for 'any'). onnx's checker
    refuses an input without a shape before this is read."""
    t = value_info.type.tensor_type
    return [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else
            (d.dim_param or None) for d in t.shape.dim]


def _dim_label(d: int | str | None) -> str:
    return f"'{d}'" if isinstance(d, str) else "(unnamed)"


def _shown(dims) -> str:
    return "(" + ", ".join(str(d) if isinstance(d, int) else _dim_label(d) for d in dims) + ")"


def _example(declared: dict) -> str:
    """A shapes= argument of the right form for these inputs: the model's sizes kept, a 1 for
    each open one, named dimensions by name where there are any."""
    named = sorted({d for dims in declared.values() for d in dims if isinstance(d, str)})
    whole = {name: tuple(d if isinstance(d, int) else 1 for d in dims)
             for name, dims in declared.items() if any(d is None for d in dims)}
    parts = [f"'{d}': 1" for d in named] + [f"'{n}': {s}" for n, s in whole.items()]
    return "{" + ", ".join(parts) + "}"


def _numeric(array: np.ndarray) -> np.ndarray:
    """An initializer's array in a numpy dtype: ml_dtypes' bfloat16 and small floats (which
    numpy sees as opaque) as float32, its int4 and uint4 as int8 and uint8, exactly; save_onnx
    writes them back in their own."""
    if array.dtype.kind != "V":
        return array
    return array.astype(np.float32 if "float" in array.dtype.name else
                        np.uint8 if array.dtype.name.startswith("u") else np.int8)


def _consumers(graph) -> set[str]:
    names = {o.name for o in graph.output}
    for node in graph.node:
        names.update(node.input)
    return names


def _gather_elements(ins: list, attrs: dict) -> list[np.ndarray]:
    data, indices = (np.asarray(v) for v in ins)
    axis = attrs.get("axis", 0) % data.ndim
    indices = np.where(indices < 0, indices + data.shape[axis], indices)
    return [np.take_along_axis(data, indices.astype(np.int64), axis)]


def _dequantize(ins: list, attrs: dict) -> list[np.ndarray]:
    """(x - zero point) * scale, per tensor or along `axis` (opsets 13 to 18, which onnx's
    reference implements only from 19 on, have no block_size)."""
    x, scale = np.asarray(ins[0]), np.asarray(ins[1], np.float32)
    zero = np.asarray(ins[2]) if len(ins) > 2 and ins[2] is not None else np.zeros((), x.dtype)
    if attrs.get("block_size", 0):
        raise Refuse("blocked quantization (block_size) is not supported")
    along = [1] * x.ndim
    if scale.size > 1:
        along[int(attrs.get("axis", 1)) % x.ndim] = -1
    centred = x.astype(np.float32) - zero.astype(np.float32).reshape(along if zero.size > 1
                                                                       else ())
    return [(centred * scale.reshape(along if scale.size > 1 else ())).astype(np.float32)]


def _dense(sparse) -> np.ndarray:
    """A SparseTensorProto as the dense array it stands for."""
    from onnx import numpy_helper
    values = _numeric(numpy_helper.to_array(sparse.values))
    indices = numpy_helper.to_array(sparse.indices).astype(np.int64)
    dense = np.zeros(tuple(sparse.dims), values.dtype)
    # indices: (nnz,) linear positions, or (nnz, rank) coordinates
    at = indices if indices.ndim == 1 else np.ravel_multi_index(tuple(indices.T), dense.shape)
    dense.reshape(-1)[at] = values
    return dense


def _constant(ins: list, attrs: dict) -> list[np.ndarray]:
    """Constant in each of its forms; a sparse_value made dense (the reference implementation
    returns its own SparseTensor type)."""
    if "sparse_value" in attrs:
        return [_dense(attrs["sparse_value"])]
    (name, value), = attrs.items()
    if name == "value":
        from onnx import numpy_helper
        return [numpy_helper.to_array(value)]
    if name in ("value_float", "value_floats"):
        return [np.asarray(value, np.float32)]
    if name in ("value_int", "value_ints"):
        return [np.asarray(value, np.int64)]
    return [np.asarray(value)]  # value_string(s): read only by ops vkml refuses


# Ops computed at import by numpy rather than onnx's reference implementation, which raises on
# valid input for them (GatherElements of a (1, 512) table at (1, 8) indices: BERT's token
# type ids) or has no version for an opset (DequantizeLinear before 19).
HOST_FOLDS: dict[str, Callable[[list, dict], list[np.ndarray]]] = {
    "GatherElements": _gather_elements, "DequantizeLinear": _dequantize, "Constant": _constant}


def _node_name(node, index: int) -> str:
    return node.name or (f"{node.op_type} -> {node.output[0]}" if node.output
                         else f"#{index} {node.op_type}")


def _attrs(node) -> dict[str, Any]:
    from onnx import helper
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


# ---- the op table ------------------------------------------------------------------------------
Handler = Callable[[_Builder, Any, list, dict], Any]
HANDLERS: dict[str, Handler] = {}


def onnx_op(*names: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        for n in names:
            HANDLERS[n] = fn
        return fn
    return register


UNARY = {"Relu": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh", "Exp": "exp", "Log": "log",
         "Neg": "neg", "Sqrt": "sqrt", "Abs": "abs", "Erf": "erf", "Floor": "floor",
         "Ceil": "ceil", "Round": "round", "Sign": "sign", "Sin": "sin", "Cos": "cos",
         "Reciprocal": "reciprocal", "Mish": "mish", "HardSwish": "hardswish",
         "IsNaN": "isnan", "IsInf": "isinf", "Not": "logical_not"}


@onnx_op(*UNARY)
def _unary(b: _Builder, node, ins, attrs):
    x = b.device(ins[0])
    if node.op_type == "Reciprocal" and patterns.rsqrt_of(x) is not None:
        return b.g.rsqrt(patterns.rsqrt_of(x))
    return getattr(b.g, UNARY[node.op_type])(x)


# ONNX op -> (vkml op, its parameters from the node's attributes with ONNX's defaults)
PARAMETRIC = {"LeakyRelu": ("leaky_relu", {"alpha": 0.01}), "Elu": ("elu", {"alpha": 1.0}),
              "Selu": ("selu", {})}


@onnx_op(*PARAMETRIC)
def _parametric(b, node, ins, attrs):
    name, defaults = PARAMETRIC[node.op_type]
    values = [float(attrs.get(k, v)) for k, v in defaults.items()]
    if node.op_type == "Selu" and (attrs.get("alpha", 1.67326319217681884765625) !=
                                   1.67326319217681884765625 or
                                   attrs.get("gamma", 1.05070102214813232421875) !=
                                   1.05070102214813232421875):
        raise Refuse("Selu with other than its standard alpha and gamma is not supported")
    return getattr(b.g, name)(b.device(ins[0]), *values)


@onnx_op("PRelu")
def _prelu(b, node, ins, attrs):
    # torch's form (x where x > 0), so x = 0 takes the slope's gradient as torch's prelu does
    x = b.device(ins[0])
    return b.g.where(b.g.greater(x, 0.0), x, b.g.mul(x, b.operand(ins[1])))


@onnx_op("Celu")
def _celu(b, node, ins, attrs):
    alpha = float(attrs.get("alpha", 1.0))
    return b.g.mul(b.g.elu(b.g.mul(b.device(ins[0]), 1.0 / alpha), 1.0), alpha)


@onnx_op("ThresholdedRelu")
def _thresholded_relu(b, node, ins, attrs):
    x = b.device(ins[0])
    return b.g.where(b.g.greater(x, float(attrs.get("alpha", 1.0))), x, 0.0)


@onnx_op("Shrink")
def _shrink(b, node, ins, attrs):
    """torch's hardshrink (bias 0) and softshrink (bias = lambd)."""
    x = b.device(ins[0])
    lambd, bias = float(attrs.get("lambd", 0.5)), float(attrs.get("bias", 0.0))
    above = b.g.where(b.g.greater(x, lambd), b.g.sub(x, bias), 0.0)
    return b.g.where(b.g.less(x, -lambd), b.g.add(x, bias), above)


@onnx_op("Softsign")
def _softsign(b, node, ins, attrs):
    x = b.device(ins[0])
    return b.g.div(x, b.g.add(b.g.abs(x), 1.0))


@onnx_op("Swish")
def _swish(b, node, ins, attrs):
    return _swish_of(b.g, b.device(ins[0]), float(attrs.get("alpha", 1.0)))


def _swish_of(g: Graph, x: Tensor, alpha: float) -> Tensor:
    return g.silu(x) if alpha == 1.0 else g.mul(x, g.sigmoid(g.mul(x, alpha)))


@onnx_op("SwiGLU")
def _swiglu(b, node, ins, attrs):
    a, value = b.device(ins[0]), b.device(ins[1])
    alpha = float(attrs.get("alpha", 1.0))
    return b.g.swiglu(a, value) if alpha == 1.0 else b.g.mul(_swish_of(b.g, a, alpha), value)


@onnx_op("Tan")
def _tan(b, node, ins, attrs):
    x = b.device(ins[0])
    return b.g.div(b.g.sin(x), b.g.cos(x))


@onnx_op("Sinh", "Cosh")
def _hyperbolic(b, node, ins, attrs):
    x = b.device(ins[0])
    half = b.g.mul(b.g.exp(x), 0.5), b.g.mul(b.g.exp(b.g.neg(x)), 0.5)
    return b.g.sub(*half) if node.op_type == "Sinh" else b.g.add(*half)


@onnx_op("Softplus")
def _softplus(b, node, ins, attrs):
    # ONNX's softplus is log(1 + exp(x)) without torch's linear tail above the threshold,
    # which differs from it by less than exp(-20) relatively
    return b.g.softplus(b.device(ins[0]), 1.0, 20.0)


@onnx_op("Identity")
def _identity(b, node, ins, attrs):
    return ins[0]


BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div"}
# comparisons and logic: f32 masks of 1 and 0 (vkml's booleans)
PREDICATES = {"Equal": "equal", "Less": "less", "LessOrEqual": "less_equal",
              "Greater": "greater", "GreaterOrEqual": "greater_equal", "And": "logical_and",
              "Or": "logical_or", "Xor": "logical_xor"}


@onnx_op(*BINARY)
def _binary(b, node, ins, attrs):
    x, y = ins
    if _is_int(x) or _is_int(y):
        # index arithmetic on the device (RoBERTa's position ids): i32, wrapping as ONNX's
        # int32 and int64 agree below 2**31, integer Div truncating toward zero
        op = "trunc_divide" if node.op_type == "Div" else BINARY[node.op_type]
        return getattr(b.g, op)(b.device(x), b.device(y))
    return getattr(b.g, BINARY[node.op_type])(b.operand(x), b.operand(y))


@onnx_op(*PREDICATES)
def _predicate(b, node, ins, attrs):
    x, y = ins
    if isinstance(x, Tensor) or not isinstance(y, Tensor):
        return getattr(b.g, PREDICATES[node.op_type])(b.device(x), b.operand(y))
    return getattr(b.g, PREDICATES[node.op_type])(b.operand(x), b.device(y))


@onnx_op("Where")
def _where(b, node, ins, attrs):
    cond, x, y = ins
    return b.g.where(b.device(cond), b.operand(x), b.operand(y))


@onnx_op("Min", "Max")
def _extremum(b, node, ins, attrs):
    fn = b.g.minimum if node.op_type == "Min" else b.g.maximum
    out = b.device(ins[0])
    for v in ins[1:]:
        out = fn(out, b.operand(v))
    return out


# past this, asinh(x) and acosh(x) are log(2x) to f32's precision (the next term, 1 / (4x^2),
# is below 2^-26 of it), where their formulas square x (inf past 1.8e19)
LOG_TWO_X_BEYOND = 4096.0


def _log_two_x_beyond(g: Graph, x: Tensor, formula: Callable[[Tensor], Tensor],
                      safe: float) -> Tensor:
    """formula(x), or log(x) + log 2 beyond LOG_TWO_X_BEYOND; the formula reads `safe`
    there, so that its infinities reach neither the result nor the gradient."""
    far = g.greater(x, LOG_TWO_X_BEYOND)
    return g.where(far, g.add(g.log(x), math.log(2.0)), formula(g.where(far, safe, x)))


@onnx_op("Asinh")
def _asinh(b, node, ins, attrs):
    """log1p(|x| + x^2 / (1 + sqrt(x^2 + 1))) with x's sign (precise near 0 and for large
    negative x, where log(x + sqrt(x^2 + 1)) cancels)."""
    g, x = b.g, b.device(ins[0])

    def of_positive(v: Tensor) -> Tensor:
        square = g.square(v)
        return g.log1p(g.add(v, g.div(square, g.add(g.sqrt(g.add(square, 1.0)), 1.0))))

    # one evaluation at |x| (a where, whose gradient keeps asinh'(0) = 1): a branch at -x
    # that the result leaves out would still send the gradient NaN from its squares
    negative = g.less(x, 0.0)
    y = _log_two_x_beyond(g, g.where(negative, g.neg(x), x), of_positive, 1.0)
    return g.where(negative, g.neg(y), y)


@onnx_op("Acosh")
def _acosh(b, node, ins, attrs):
    """log1p((x - 1) + sqrt((x - 1)(x + 1))): precise near 1."""
    g, x = b.g, b.device(ins[0])

    def formula(v: Tensor) -> Tensor:
        above = g.sub(v, 1.0)
        return g.log1p(g.add(above, g.sqrt(g.mul(above, g.add(v, 1.0)))))
    return _log_two_x_beyond(g, x, formula, 2.0)


@onnx_op("Atanh")
def _atanh(b, node, ins, attrs):
    g, x = b.g, b.device(ins[0])
    return g.mul(g.sub(g.log1p(x), g.log1p(g.neg(x))), 0.5)


@onnx_op("Sum", "Mean")
def _variadic_sum(b, node, ins, attrs):
    out = b.device(ins[0])
    for v in ins[1:]:
        out = b.g.add(out, b.operand(v))
    return b.g.mul(out, 1.0 / len(ins)) if node.op_type == "Mean" else out


@onnx_op("Mod")
def _mod(b, node, ins, attrs):
    x, y = ins
    truncating = bool(attrs.get("fmod", 0))
    if _is_int(x) or _is_int(y):
        fn = b.g.fmod if truncating else b.g.remainder
        return fn(b.g.cast(b.device(x), "i32"), b.g.cast(b.device(y), "i32"))
    if not truncating:
        raise Refuse("Mod of floats needs fmod=1 (the ONNX standard's rule)")
    # a - b * trunc(a / b), trunc rounding toward zero
    a, d = b.device(x), b.operand(y)
    q = b.g.div(a, d)
    whole = b.g.where(b.g.less(q, 0.0), b.g.ceil(q), b.g.floor(q))
    return b.g.sub(a, b.g.mul(whole, d))


def _is_int(v: Value) -> bool:
    if isinstance(v, Tensor):
        return v.dtype == "i32"
    return isinstance(v, np.ndarray) and v.dtype.kind in "iub"


@onnx_op("Pow")
def _pow(b, node, ins, attrs):
    x, e = ins
    if not isinstance(e, Tensor) and np.asarray(b.host(e, "exponent")).size == 1:
        return power(b.g, b.device(x), float(np.asarray(b.host(e, "exponent")).reshape(())))
    return b.g.pow(b.operand(x), b.operand(e))


@onnx_op("MatMul")
def _matmul(b, node, ins, attrs):
    x, w = b.device(ins[0]), b.device(ins[1])
    return patterns.attention_of(b.g, x, w) or matmul(b.g, x, w)


@onnx_op("Gemm")
def _gemm(b, node, ins, attrs):
    g = b.g
    a, w = b.device(ins[0]), b.device(ins[1])
    y = g.matmul(a, w, transpose_a=bool(attrs.get("transA", 0)),
                 transpose_b=bool(attrs.get("transB", 0)))
    if attrs.get("alpha", 1.0) != 1.0:
        y = g.mul(y, float(attrs["alpha"]))
    if len(ins) > 2 and ins[2] is not None:
        c = b.device(ins[2])
        if attrs.get("beta", 1.0) != 1.0:
            c = g.mul(c, float(attrs["beta"]))
        y = g.bias_add(y, c) if c.shape == y.shape[-1:] else g.add(y, c)
    return y


def _spatial(attrs: dict, name: str, rank: int, default: int) -> list[int]:
    return list(attrs.get(name, [default] * rank))


def _pad_amounts(shape: Sequence[int], attrs: dict, kernel: Sequence[int],
                 strides: Sequence[int], dilations: Sequence[int]) -> list[int]:
    """ONNX's pads, (begins..., ends...) per spatial axis, from auto_pad or the attribute."""
    rank = len(kernel)
    auto = attrs.get("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        begins, ends = [], []
        for i in range(rank):
            size = shape[2 + i]
            out = -(-size // strides[i])
            total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - size)
            small = total // 2
            begins.append(small if auto == "SAME_UPPER" else total - small)
            ends.append(total - begins[-1])
        return begins + ends
    if auto == "VALID":
        return [0] * (2 * rank)
    return list(attrs.get("pads", [0] * (2 * rank)))


def _pads(b: _Builder, x: Tensor, attrs: dict, kernel: Sequence[int], strides: Sequence[int],
          dilations: Sequence[int], value: float = 0.0) -> tuple[Tensor, list[int]]:
    """Symmetric padding per spatial axis, with any asymmetric part (SAME_UPPER/LOWER, or
    explicit pads) applied first, filled with `value`."""
    rank = len(kernel)
    pads = _pad_amounts(x.shape, attrs, kernel, strides, dilations)
    symmetric = []
    for i in range(rank):
        lo, hi = pads[i], pads[i + rank]
        common = min(lo, hi)
        if lo != hi:
            x = b.g.pad(x, 2 + i, lo - common, hi - common, value=value)
        symmetric.append(common)
    return x, symmetric


def _lift_1d(handler: Handler) -> Handler:
    """A 2-D handler that also takes 1-D inputs (N, C, L): as (N, C, 1, L), every spatial
    attribute given a leading height of its neutral value."""
    neutral = {"kernel_shape": 1, "strides": 1, "dilations": 1, "output_padding": 0}

    def handle(b, node, ins, attrs):
        x = b.device(ins[0])
        if len(x.shape) != 3:
            return handler(b, node, ins, attrs)
        lifted = {k: [neutral[k], *v] if k in neutral else v for k, v in attrs.items()}
        if "pads" in attrs:
            lifted["pads"] = [0, attrs["pads"][0], 0, attrs["pads"][1]]
        if "output_shape" in attrs:
            lifted["output_shape"] = [1, *attrs["output_shape"][-1:]]
        ins = [b.g.reshape(x, (x.shape[0], x.shape[1], 1, x.shape[2])), *ins[1:]]
        if len(ins) > 1 and ins[1] is not None and node.op_type == "ConvTranspose":
            w = b.device(ins[1])
            ins[1] = b.g.reshape(w, (w.shape[0], w.shape[1], 1, w.shape[2]))
        y = handler(b, node, ins, lifted)
        return b.g.reshape(y, (y.shape[0], y.shape[1], y.shape[3]))
    return handle


@onnx_op("Conv")
def _conv(b, node, ins, attrs):
    g = b.g
    x, w = b.device(ins[0]), b.device(ins[1])
    bias = b.device(ins[2]) if len(ins) > 2 and ins[2] is not None else None
    rank = len(w.shape) - 2
    if rank not in (1, 2, 3):
        raise Refuse(f"{rank}-D convolutions are not supported (1-D, 2-D and 3-D are)")
    strides = _spatial(attrs, "strides", rank, 1)
    dilations = _spatial(attrs, "dilations", rank, 1)
    x, pads = _pads(b, x, attrs, w.shape[2:], strides, dilations)
    groups = int(attrs.get("group", 1))
    if rank == 1:
        return g.conv1d(x, w, bias, strides[0], pads[0], dilations[0], groups)
    conv = g.conv2d if rank == 2 else g.conv3d
    return conv(x, w, bias, tuple(strides), tuple(pads), tuple(dilations), groups)


def _pool_geometry(attrs: dict, rank3: bool = False) -> tuple[list[int], list[int], list[int]]:
    kernel = list(attrs["kernel_shape"])
    if len(kernel) not in ((2, 3) if rank3 else (2,)):
        raise Refuse(f"{len(kernel)}-D pooling is not supported (1-D and 2-D are; 3-D max and "
                     "average pooling too)")
    rank = len(kernel)
    return kernel, _spatial(attrs, "strides", rank, 1), _spatial(attrs, "dilations", rank, 1)


def _window_geometry(attrs: dict, what: str, rank3: bool = False
                     ) -> tuple[list[int], list[int]]:
    """The kernel and strides of a pooling only max pooling dilates."""
    kernel, strides, dilations = _pool_geometry(attrs, rank3)
    if set(dilations) != {1}:
        raise Refuse(f"dilated {what} pooling is not supported")
    return kernel, strides


@onnx_op("MaxPool")
@_lift_1d
def _max_pool(b, node, ins, attrs):
    if isinstance(ins[0], Tensor) and ins[0].dtype == "i32":
        # quantized values (the QOperator format pools them as they are): exact in f32
        return b.g.cast(_max_pool(b, node, [b.g.cast(ins[0], "f32")], attrs), "i32")
    kernel, strides, dilations = _pool_geometry(attrs, rank3=True)
    if attrs.get("storage_order", 0):
        raise Refuse("storage_order=1 is not supported")
    x, pads = _pads(b, b.device(ins[0]), attrs, kernel, strides, dilations, -math.inf)
    ceil = bool(attrs.get("ceil_mode", 0))
    if set(dilations) == {1}:
        pool = b.g.max_pool2d if len(kernel) == 2 else b.g.max_pool3d
        return pool(x, tuple(kernel), tuple(strides), tuple(pads), ceil_mode=ceil)
    if len(kernel) == 3:
        raise Refuse("dilated 3-D max pooling is not supported")
    return _dilated_max_pool(b.g, x, kernel, strides, pads, dilations, ceil)


def _dilated_max_pool(g: Graph, x: Tensor, kernel, strides, pads, dilations,
                      ceil: bool) -> Tensor:
    """The maximum of the kernel's strided slices of the input padded with -inf (ceil_mode's
    last window, as torch's, starting inside the input or its leading pad)."""
    extents = []
    for axis, (k, s, p, d) in enumerate(zip(kernel, strides, pads, dilations), 2):
        span, n = d * (k - 1) + 1, x.shape[axis] + 2 * p
        out = (n - span) // s + 1
        if ceil and (n - span) % s and (out * s) < x.shape[axis] + p:
            out += 1
        x = g.pad(x, axis, p, p + max(0, (out - 1) * s + span - n), value=-math.inf)
        extents.append(out)
    best = None
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            window = x
            for axis, offset, out, s in zip((2, 3), (i * dilations[0], j * dilations[1]),
                                            extents, strides):
                window = g.slice(window, axis, offset, offset + (out - 1) * s + 1, s)
            best = window if best is None else g.maximum(best, window)
    return best


@onnx_op("AveragePool")
@_lift_1d
def _avg_pool(b, node, ins, attrs):
    kernel, strides = _window_geometry(attrs, "average", rank3=True)
    x, counted = b.device(ins[0]), bool(attrs.get("count_include_pad", 0))
    ceil = bool(attrs.get("ceil_mode", 0))
    rank = len(kernel)
    pads = _pad_amounts(x.shape, attrs, kernel, strides, [1] * rank)
    if counted or pads[:rank] == pads[rank:]:
        x, pads = _pads(b, x, attrs, kernel, strides, [1] * rank)
        pool = b.g.avg_pool2d if rank == 2 else b.g.avg_pool3d
        return pool(x, tuple(kernel), tuple(strides), tuple(pads), ceil_mode=ceil,
                    count_include_pad=counted)
    if rank == 3:
        raise Refuse("3-D average pooling with asymmetric pads not counted in the average is "
                     "not supported")
    if ceil:
        raise Refuse("ceil_mode with asymmetric pads not counted in the average is not "
                     "supported")
    # the sums over the zero-padded input, each over its count of the input's own elements
    counts = []
    for axis, (k, s) in enumerate(zip(kernel, strides)):
        n, lo, hi = x.shape[2 + axis], pads[axis], pads[axis + 2]
        starts = np.arange((n + lo + hi - k) // s + 1) * s - lo
        counts.append(np.minimum(starts + k, n) - np.maximum(starts, 0))
        x = b.g.pad(x, 2 + axis, lo, hi)
    sums = b.g.avg_pool2d(x, tuple(kernel), tuple(strides), divisor_override=1)
    return b.g.div(sums, b.g.constant(np.outer(*counts).astype(np.float32)))


def _lp_power(b, x: Tensor, p: float) -> Tensor:
    return b.g.square(x) if p == 2 else power(b.g, b.g.abs(x), p)


@onnx_op("LpPool")
@_lift_1d
def _lp_pool(b, node, ins, attrs):
    """(the sum of |x| ** p over each window) ** (1 / p): the window sums of average pooling."""
    kernel, strides = _window_geometry(attrs, "Lp")
    p = float(attrs.get("p", 2))
    x, pads = _pads(b, _lp_power(b, b.device(ins[0]), p), attrs, kernel, strides, [1, 1])
    sums = b.g.avg_pool2d(x, tuple(kernel), tuple(strides), tuple(pads),
                          ceil_mode=bool(attrs.get("ceil_mode", 0)), divisor_override=1)
    return power(b.g, sums, 1.0 / p)


@onnx_op("GlobalLpPool")
def _global_lp_pool(b, node, ins, attrs):
    x, p = b.device(ins[0]), float(attrs.get("p", 2))
    sums = b.g.sum(_lp_power(b, x, p), tuple(range(2, len(x.shape))), keepdims=True)
    return power(b.g, sums, 1.0 / p)


@onnx_op("GlobalAveragePool")
def _global_avg_pool(b, node, ins, attrs):
    x = b.device(ins[0])
    return b.g.mean(x, tuple(range(2, len(x.shape))), keepdims=True)


@onnx_op("GlobalMaxPool")
def _global_max_pool(b, node, ins, attrs):
    x = b.device(ins[0])
    return b.g.amax(x, tuple(range(2, len(x.shape))), keepdims=True)


@onnx_op("BatchNormalization")
def _batch_norm(b, node, ins, attrs):
    x, scale, bias = b.device(ins[0]), b.device(ins[1]), b.device(ins[2])
    mean, var = b.device(ins[3], trainable=False), b.device(ins[4], trainable=False)
    train = bool(attrs.get("training_mode", 0)) and b.training
    return b.g.batch_norm(x, mean, var, scale, bias, training=train,
                          eps=float(attrs.get("epsilon", 1e-5)))


@onnx_op("LayerNormalization")
def _layer_norm(b, node, ins, attrs):
    x = b.device(ins[0])
    axis = attrs.get("axis", -1) % len(x.shape)
    scale = b.device(ins[1])
    bias = b.device(ins[2]) if len(ins) > 2 and ins[2] is not None else None
    shape = x.shape[axis:]
    if scale.shape != shape:
        scale = b.g.broadcast_to(scale, shape)
    return b.g.layer_norm(x, shape, scale, bias, float(attrs.get("epsilon", 1e-5)))


@onnx_op("InstanceNormalization")
def _instance_norm(b, node, ins, attrs):
    return b.g.instance_norm(b.device(ins[0]), b.device(ins[1]), b.device(ins[2]),
                             float(attrs.get("epsilon", 1e-5)))


@onnx_op("GroupNormalization")
def _group_norm(b, node, ins, attrs):
    x = b.device(ins[0])
    groups = int(attrs["num_groups"])
    scale, bias = b.device(ins[1]), b.device(ins[2])
    if scale.shape != (x.shape[1],):
        raise Refuse("GroupNormalization with one scale per group (opset 18) is not supported; "
                     "export with opset 21 or newer (one per channel)")
    return b.g.group_norm(x, groups, scale, bias, float(attrs.get("epsilon", 1e-5)))


@onnx_op("RMSNormalization", "SimplifiedLayerNormalization")
def _rms_norm(b, node, ins, attrs):
    """Over the axes from `axis` on, flattened into one where there are several."""
    x = b.device(ins[0])
    axis = int(attrs.get("axis", -1)) % len(x.shape)
    width = math.prod(x.shape[axis:])
    scale = b.device(ins[1])
    if scale.shape != x.shape[axis:]:
        scale = b.g.broadcast_to(scale, x.shape[axis:])
    if axis == len(x.shape) - 1:
        return b.g.rms_norm(x, scale, float(attrs.get("epsilon", 1e-5)))
    flat = b.g.rms_norm(b.g.reshape(x, (*x.shape[:axis], width)), b.g.reshape(scale, (width,)),
                        float(attrs.get("epsilon", 1e-5)))
    return b.g.reshape(flat, x.shape)


@onnx_op("Softmax", "LogSoftmax")
def _softmax(b, node, ins, attrs):
    fn = b.g.softmax if node.op_type == "Softmax" else b.g.log_softmax
    return last_axis(b.g, b.device(ins[0]), int(attrs.get("axis", -1)), fn)


@onnx_op("Gelu")
def _gelu(b, node, ins, attrs):
    return b.g.gelu(b.device(ins[0]), attrs.get("approximate", "none"))


@onnx_op("HardSigmoid")
def _hard_sigmoid(b, node, ins, attrs):
    x = b.device(ins[0])
    if abs(attrs.get("alpha", 0.2) - 1 / 6) < 1e-7 and attrs.get("beta", 0.5) == 0.5:
        return b.g.hardsigmoid(x)  # torch's
    return b.g.clamp(b.g.add(b.g.mul(x, float(attrs.get("alpha", 0.2))),
                             float(attrs.get("beta", 0.5))), 0.0, 1.0)


@onnx_op("Clip")
def _clip(b, node, ins, attrs):
    x = b.device(ins[0])
    bounds = [float(b.host(v, "bound")) if v is not None else None
              for v in (ins[1:] + [None, None])[:2]]
    if bounds == [None, None]:
        return x
    return b.g.clamp(x, *bounds)


def _axes(b: _Builder, node, ins, attrs, rank: int) -> list[int] | None:
    """An op's axes, from its attribute or (newer opsets) its second input."""
    if len(ins) > 1 and ins[1] is not None:
        axes = b.host(ins[1], "axes").reshape(-1).tolist()
    else:
        axes = attrs.get("axes")
    return None if axes is None else [int(a) % rank for a in axes]


# ONNX reduction -> (graph, x, axes, keepdims) -> its composition of vkml ops
REDUCTIONS: dict[str, Callable[[Graph, Tensor, list[int], bool], Tensor]] = {
    "ReduceMean": lambda g, x, axes, keep: g.mean(x, axes, keepdims=keep),
    "ReduceSum": lambda g, x, axes, keep: g.sum(x, axes, keepdims=keep),
    "ReduceMax": lambda g, x, axes, keep: g.amax(x, axes, keepdims=keep),
    "ReduceMin": lambda g, x, axes, keep: g.amin(x, axes, keepdims=keep),
    "ReduceL2": lambda g, x, axes, keep: g.reduce_l2(x, axes, keepdims=keep),
    "ReduceLogSumExp": lambda g, x, axes, keep: g.logsumexp(x, axes, keepdims=keep),
    "ReduceL1": lambda g, x, axes, keep: g.sum(g.abs(x), axes, keepdims=keep),
    "ReduceSumSquare": lambda g, x, axes, keep: g.sum(g.square(x), axes, keepdims=keep),
    "ReduceLogSum": lambda g, x, axes, keep: g.log(g.sum(x, axes, keepdims=keep)),
    "ReduceProd": lambda g, x, axes, keep: _product(g, x, axes, keep),
}


def _product(g: Graph, x: Tensor, axes: list[int], keep: bool) -> Tensor:
    """The product over `axes` as halves multiplied together, log2(n) times: exact, and its
    gradient exact where elements are zero (a log-sum-exp form's is not)."""
    rest = [a for a in range(len(x.shape)) if a not in axes]
    flat = g.transpose(x, rest + axes) if rest + axes != list(range(len(x.shape))) else x
    flat = g.reshape(flat, (*[x.shape[a] for a in rest], -1))
    last = len(flat.shape) - 1
    while flat.shape[-1] > 1:
        half = flat.shape[-1] // 2
        product = g.mul(g.slice(flat, last, 0, half), g.slice(flat, last, half, 2 * half))
        odd = flat.shape[-1] % 2
        flat = g.concat([product, g.slice(flat, last, 2 * half, 2 * half + 1)], last) \
            if odd else product
    kept = [1 if a in axes else d for a, d in enumerate(x.shape)] if keep else \
        [x.shape[a] for a in rest]
    return g.reshape(flat, kept)


@onnx_op(*REDUCTIONS)
def _reduce(b, node, ins, attrs):
    x = b.device(ins[0])
    axes = _axes(b, node, ins, attrs, max(len(x.shape), 1))
    if not axes:
        if attrs.get("noop_with_empty_axes", 0):
            return x
        axes = list(range(len(x.shape)))
    return REDUCTIONS[node.op_type](b.g, x, axes, bool(attrs.get("keepdims", 1)))


@onnx_op("ArgMax", "ArgMin")
def _arg(b, node, ins, attrs):
    x = b.device(ins[0])
    axis, keep = int(attrs.get("axis", 0)) % len(x.shape), bool(attrs.get("keepdims", 1))
    fn = b.g.argmax if node.op_type == "ArgMax" else b.g.argmin
    if not attrs.get("select_last_index", 0):
        return fn(x, axis, keep)
    # the last extreme is the first one of the flipped axis
    last = b.g.constant(np.array(x.shape[axis] - 1, np.int32), "i32")
    return b.g.sub(last, fn(b.g.flip(x, (axis,)), axis, keep))


@onnx_op("CumSum")
def _cumsum(b, node, ins, attrs):
    return b.g.cumsum(b.device(ins[0]), int(b.host(ins[1], "axis").reshape(())),
                      bool(attrs.get("reverse", 0)), bool(attrs.get("exclusive", 0)))


@onnx_op("CumProd")
def _cumprod(b, node, ins, attrs):
    """Products of 1, 2, 4, ... neighbours (Hillis and Steele's scan), each step x times x
    shifted by the step with ones shifted in: exact, differentiable at zeros."""
    g, x = b.g, b.device(ins[0])
    axis = int(b.host(ins[1], "axis").reshape(())) % len(x.shape)
    n = x.shape[axis]
    reverse = bool(attrs.get("reverse", 0))
    if reverse:
        x = g.flip(x, (axis,))
    if attrs.get("exclusive", 0):
        x = g.pad(g.slice(x, axis, 0, n - 1), axis, 1, 0, value=1.0) if n > 1 else \
            g.constant(np.ones(x.shape, np.float32))
    step = 1
    while step < n:
        x = g.mul(x, g.pad(g.slice(x, axis, 0, n - step), axis, step, 0, value=1.0))
        step *= 2
    return g.flip(x, (axis,)) if reverse else x


@onnx_op("LpNormalization")
def _lp_normalization(b, node, ins, attrs):
    """x over its L1 or L2 norm along `axis` (no epsilon: a zero norm gives NaN, as ONNX's)."""
    x = b.device(ins[0])
    axis, p = int(attrs.get("axis", -1)) % len(x.shape), int(attrs.get("p", 2))
    if p not in (1, 2):
        raise Refuse(f"p={p} is not a norm ONNX defines here (1 or 2)")
    norm = REDUCTIONS["ReduceL1" if p == 1 else "ReduceL2"](b.g, x, [axis], True)
    return b.g.div(x, norm)


@onnx_op("MeanVarianceNormalization")
def _mean_variance_normalization(b, node, ins, attrs):
    """(x - mean) / (std + 1e-9) over `axes`, the biased deviation, as ONNX's function body."""
    x = b.device(ins[0])
    axes = [int(a) % len(x.shape) for a in attrs.get("axes", [0, 2, 3])]
    centred = b.g.sub(x, b.g.mean(x, axes, keepdims=True))
    std = b.g.sqrt(b.g.mean(b.g.square(centred), axes, keepdims=True))
    return b.g.div(centred, b.g.add(std, 1e-9))


@onnx_op("LRN")
def _lrn(b, node, ins, attrs):
    """AlexNet's local response normalization across channels: x over (bias + alpha / size *
    the sum of squares of a window of `size` channels around it) ** beta."""
    x = b.device(ins[0])
    size = int(attrs["size"])
    alpha, beta = float(attrs.get("alpha", 1e-4)), float(attrs.get("beta", 0.75))
    squares = b.g.pad(b.g.square(x), 1, (size - 1) // 2, size // 2)
    window = b.g.slice(squares, 1, 0, x.shape[1])
    for shift in range(1, size):
        window = b.g.add(window, b.g.slice(squares, 1, shift, shift + x.shape[1]))
    base = b.g.add(b.g.mul(window, alpha / size), float(attrs.get("bias", 1.0)))
    return b.g.mul(x, power(b.g, base, -beta))


@onnx_op("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
def _class_loss(b, node, ins, attrs):
    """torch's F.cross_entropy and F.nll_loss over classes on axis 1: per-class weights,
    ignore_index, reductions none, sum and mean (weighted: over the kept labels' weights)."""
    g = b.g
    scores, labels = b.device(ins[0]), g.cast(b.device(ins[1]), "i32")
    # class weights are a constant of the loss, as torch's (not differentiable there)
    weights = b.device(ins[2], trainable=False) if len(ins) > 2 and ins[2] is not None else None
    log_probs = (last_axis(g, scores, 1, g.log_softmax)
                 if node.op_type == "SoftmaxCrossEntropyLoss" else scores)
    kept = None
    if "ignore_index" in attrs:
        ignored = g.constant(np.array(attrs["ignore_index"], np.int32), "i32")
        kept = g.not_equal(labels, ignored)
        labels = g.where(kept, labels, g.constant(np.array(0, np.int32), "i32"))
    wide = g.reshape(labels, (labels.shape[0], 1, *labels.shape[1:]))
    losses = g.neg(g.reshape(g.gather_elements(log_probs, wide, 1), labels.shape))
    counts = kept
    if weights is not None:
        weight = g.gather(weights, labels, 0)
        counts = weight if kept is None else g.mul(weight, kept)
    if counts is not None:
        losses = g.mul(losses, counts)
    reduction = attrs.get("reduction", "mean")
    if reduction == "none":
        loss = losses
    elif reduction == "sum":
        loss = g.sum(losses)
    else:
        loss = g.mean(losses) if counts is None else g.div(g.sum(losses), g.sum(counts))
    return [loss, log_probs]


@onnx_op("Attention")
def _attention(b, node, ins, attrs):
    """ONNX's Attention (opset 23, what torch.onnx writes for scaled_dot_product_attention
    there): 4-D (batch, heads, length, head size) or 3-D (batch, length, heads x head size)
    inputs, grouped key/value heads, a boolean or additive mask, a key/value cache without
    causality. A boolean mask is additive -inf where false, so a row whose every key is masked
    gives zeros, as onnxruntime's, onnx's reference and torch's SDPA."""
    g = b.g
    ins = ins + [None] * (7 - len(ins))
    if attrs.get("softcap", 0.0) or ins[6] is not None:
        raise Refuse("softcap and nonpad_kv_seqlen are not supported")
    if attrs.get("softmax_precision") is not None and attrs["softmax_precision"] not in (
            b.onnx.TensorProto.FLOAT, b.onnx.TensorProto.DOUBLE):
        raise Refuse("a softmax in a precision below f32 is not supported (vkml's is f32)")
    q, k, v = (b.device(x) for x in ins[:3])
    packed = len(q.shape) == 3
    if packed:
        q = _heads(g, q, int(attrs["q_num_heads"]))
        k, v = (_heads(g, x, int(attrs["kv_num_heads"])) for x in (k, v))
    causal = bool(attrs.get("is_causal", 0))
    if ins[4] is not None or ins[5] is not None:
        if causal:
            raise Refuse("is_causal with a key/value cache is not supported")
        k, v = (g.concat([b.device(past), x], 2) for past, x in ((ins[4], k), (ins[5], v)))
    mask = ins[3]
    if mask is not None:
        if b.is_bool(node.input[3], mask):
            mask = (np.where(mask, 0.0, -np.inf).astype(np.float32)
                    if isinstance(mask, np.ndarray) else g.where(b.device(mask), 0.0, -math.inf))
        mask = b.device(mask)
    y = g.scaled_dot_product_attention(q, k, v, mask, causal, attrs.get("scale"))
    if packed:
        y = merge_heads(g, y)
    return [y, k, v]


@onnx_op("RotaryEmbedding")
def _rotary_embedding(b, node, ins, attrs):
    """ONNX's RotaryEmbedding (opset 23): the first rotary_embedding_dim of each head rotated by
    the cosines and sines of its position (cache rows picked by position_ids, known or
    computed), the halves or the interleaved pairs; the caches are constants (frozen)."""
    g = b.g
    x = b.device(ins[0])
    cos, sin = (b.device(v, trainable=False) for v in ins[1:3])
    ids = ins[3] if len(ins) > 3 else None
    if ids is not None:
        ids = b.device(ids)
        cos, sin = (g.gather(c, g.cast(ids, "i32"), 0) for c in (cos, sin))
    packed = len(x.shape) == 3
    if packed:  # (batch, length, heads x size) as (batch, length, heads, size)
        heads = int(attrs["num_heads"])
        x = g.reshape(x, (*x.shape[:2], heads, x.shape[2] // heads))
        along = (cos.shape[0], cos.shape[1], 1, cos.shape[2])
    else:  # (batch, heads, length, size)
        along = (cos.shape[0], 1, cos.shape[1], cos.shape[2])
    cos, sin = g.reshape(cos, along), g.reshape(sin, along)
    last, size = len(x.shape) - 1, x.shape[-1]
    width = int(attrs.get("rotary_embedding_dim", 0)) or size
    rotated = g.slice(x, last, 0, width) if width < size else x
    interleaved = bool(attrs.get("interleaved", 0))
    if interleaved:
        first, second = (g.slice(rotated, last, k, width, 2) for k in (0, 1))
    else:
        first, second = g.split(rotated, [width // 2] * 2, last)
    real = g.sub(g.mul(cos, first), g.mul(sin, second))
    imaginary = g.add(g.mul(sin, first), g.mul(cos, second))
    if interleaved:
        pairs = [g.reshape(v, (*v.shape, 1)) for v in (real, imaginary)]
        out = g.reshape(g.concat(pairs, last + 1), rotated.shape)
    else:
        out = g.concat([real, imaginary], last)
    if width < size:
        out = g.concat([out, g.slice(x, last, width, size)], last)
    return g.reshape(out, (*out.shape[:2], -1)) if packed else out


def _heads(g: Graph, x: Tensor, count: int) -> Tensor:
    """(batch, length, count x size) -> (batch, count, length, size)."""
    return split_heads(g, x, count, x.shape[2] // count)


# an integer type's range: QuantizeLinear saturates to it
QUANTIZED_RANGES = {"INT8": (-128, 127), "UINT8": (0, 255), "INT16": (-32768, 32767),
                    "UINT16": (0, 65535), "INT4": (-8, 7), "UINT4": (0, 15)}


def _quantization(b, x: Tensor, ins: list, attrs: dict) -> tuple[Any, Any]:
    """(scale, zero point) of a Quantize/DequantizeLinear, per tensor or broadcast along
    `axis`; a zero point of 0 where there is none."""
    if attrs.get("block_size", 0):
        raise Refuse("blocked quantization (block_size) is not supported")
    scale = ins[1]
    zero = ins[2] if len(ins) > 2 and ins[2] is not None else np.zeros((), np.int32)
    along = [1] * len(x.shape)
    if len(x.shape):
        along[int(attrs.get("axis", 1)) % len(x.shape)] = -1

    def broadcast(v):
        v = np.asarray(b.host(v, "scale and zero point"), np.float32)
        return float(v.reshape(())) if v.size == 1 else b.device(v.reshape(along))
    return broadcast(scale), broadcast(zero)


@onnx_op("QuantizeLinear")
def _quantize_linear(b, node, ins, attrs):
    """round(x / scale) + zero point (ties to even), saturated to the zero point's type
    (uint8 where there is none), as i32. Rounding has no gradient: torch's fake quantization
    passes one straight through, an ONNX graph does not."""
    x = b.device(ins[0])
    scale, zero = _quantization(b, x, ins, attrs)
    if len(ins) > 2 and ins[2] is not None:
        kind = b.onnx.helper.np_dtype_to_tensor_dtype(b.host(ins[2], "zero point").dtype)
    else:
        kind = int(attrs.get("output_dtype", 0)) or b.onnx.TensorProto.UINT8
    name = b.onnx.TensorProto.DataType.Name(kind)
    if name not in QUANTIZED_RANGES:
        raise Refuse(f"quantizing to {name} is not supported (integer types up to 16 bits are)")
    low, high = QUANTIZED_RANGES[name]
    q = b.g.add(b.g.round(b.g.div(x, scale)), zero)
    return b.g.cast(b.g.clamp(q, float(low), float(high)), "i32")


@onnx_op("DequantizeLinear")
def _dequantize_linear(b, node, ins, attrs):
    x = b.g.cast(b.device(ins[0]), "f32")
    scale, zero = _quantization(b, x, ins, attrs)
    return b.g.mul(b.g.sub(x, zero), scale)


@onnx_op("DynamicQuantizeLinear")
def _dynamic_quantize_linear(b, node, ins, attrs):
    """uint8 quantization of x by its own range (onnxruntime's quantize_dynamic writes it before
    each MatMulInteger / ConvInteger): the scale spans [min(0, x), max(0, x)] in 255 steps,
    rounding ties to even as ONNX's; the values as i32. An input of zeros has onnxruntime's
    scale of 1 (its range's 0 / 255 would divide by zero)."""
    g, x = b.g, b.device(ins[0])
    low, high = g.minimum(g.amin(x), 0.0), g.maximum(g.amax(x), 0.0)
    span = g.sub(high, low)
    scale = g.where(g.greater(span, 0.0), g.div(span, 255.0), 1.0)
    zero = g.clamp(g.round(g.div(g.neg(low), scale)), 0.0, 255.0)
    y = g.clamp(g.add(g.round(g.div(x, scale)), zero), 0.0, 255.0)
    return [g.cast(y, "i32"), scale, g.cast(zero, "i32")]


def _centred(b, x: Value, zero: Value, axis: int | None = None) -> Tensor:
    """x - its zero point in f32, a per-row or per-column zero point broadcast along `axis`;
    integers the products sum exactly below 2**24."""
    if zero is None:
        return b.g.cast(b.device(x), "f32")
    if not isinstance(x, Tensor) and not isinstance(zero, Tensor):  # a weight: at import
        x, zero = np.asarray(b.host(x, "weight")), np.asarray(b.host(zero, "zero point"))
        if zero.size > 1:
            zero = zero.reshape([-1 if a == axis % x.ndim else 1 for a in range(x.ndim)])
        return b.device(x.astype(np.float32) - zero.astype(np.float32))
    if not isinstance(zero, Tensor) and np.asarray(b.host(zero, "zero point")).size > 1:
        raise Refuse("a per-row zero point of a computed input is not supported")
    x = b.g.cast(b.device(x), "f32")
    return b.g.sub(x, b.g.cast(b.device(zero), "f32") if isinstance(zero, Tensor)
                   else float(np.asarray(zero).reshape(())))


@onnx_op("MatMulInteger")
def _matmul_integer(b, node, ins, attrs):
    """(A - a_zero_point) @ (B - b_zero_point) as i32; B's zero point per column or one."""
    ins = [*ins, None, None]
    product = matmul(b.g, _centred(b, ins[0], ins[2], -1), _centred(b, ins[1], ins[3], -1))
    return b.g.cast(product, "i32")


@onnx_op("ConvInteger")
def _conv_integer(b, node, ins, attrs):
    """Conv of (x - x_zero_point) and (w - w_zero_point) as i32; w's zero point per output
    channel or one."""
    ins = [*ins, None, None]
    x, w = _centred(b, ins[0], ins[2]), _centred(b, ins[1], ins[3], 0)
    return b.g.cast(_conv(b, node, [x, w], attrs), "i32")


@onnx_op("Reshape")
def _reshape(b, node, ins, attrs):
    x = b.device(ins[0])
    shape = [int(d) for d in b.host(ins[1], "shape").reshape(-1)]
    if not attrs.get("allowzero", 0):
        shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return b.g.reshape(x, shape)


@onnx_op("Flatten")
def _flatten(b, node, ins, attrs):
    x = b.device(ins[0])
    axis = int(attrs.get("axis", 1)) % (len(x.shape) + 1) if x.shape else 0
    return b.g.reshape(x, (math.prod(x.shape[:axis]), math.prod(x.shape[axis:])))


@onnx_op("Transpose")
def _transpose(b, node, ins, attrs):
    x = b.device(ins[0])
    perm = attrs.get("perm", list(range(len(x.shape)))[::-1])
    return b.g.transpose(x, perm) if list(perm) != list(range(len(x.shape))) else x


@onnx_op("Squeeze")
def _squeeze(b, node, ins, attrs):
    x = b.device(ins[0])
    axes = _axes(b, node, ins, attrs, len(x.shape))
    if axes is None:
        axes = [a for a, d in enumerate(x.shape) if d == 1]
    return b.g.reshape(x, [d for a, d in enumerate(x.shape) if a not in axes])


@onnx_op("Unsqueeze")
def _unsqueeze(b, node, ins, attrs):
    x = b.device(ins[0])
    rank = len(x.shape) + len(b.host(ins[1], "axes").reshape(-1)) if len(ins) > 1 else \
        len(x.shape) + len(attrs["axes"])
    axes = set(_axes(b, node, ins, attrs, rank) or [])
    dims = iter(x.shape)
    return b.g.reshape(x, [1 if a in axes else next(dims) for a in range(rank)])


@onnx_op("Concat")
def _concat(b, node, ins, attrs):
    # an empty piece known at import (a shape computation's) adds nothing
    xs = [b.device(v) for v in ins if v is not None
          and not (isinstance(v, np.ndarray) and v.size == 0)]
    axis = int(attrs["axis"]) % len(xs[0].shape)
    x = patterns.rotate_half_of(xs, axis)
    return b.g.rotate_half(x) if x is not None else b.g.concat(xs, axis)


@onnx_op("Split")
def _split(b, node, ins, attrs):
    x = b.device(ins[0])
    axis = int(attrs.get("axis", 0)) % len(x.shape)
    if len(ins) > 1 and ins[1] is not None:
        sizes = [int(s) for s in b.host(ins[1], "split sizes").reshape(-1)]
    elif "split" in attrs:
        sizes = list(attrs["split"])
    else:
        parts = int(attrs.get("num_outputs", len(node.output)))
        size = -(-x.shape[axis] // parts)
        sizes = [min(size, x.shape[axis] - size * i) for i in range(parts)]
    return b.g.split(x, sizes, axis)


def _position(b, ins, index: int, places: int, default: int, what: str) -> int:
    """A sequence op's position input, one of `places` (negative from the end; `default`
    where absent)."""
    if len(ins) <= index or ins[index] is None:
        return default
    at = int(b.host(ins[index], f"the position ({what}'s, when computed at run time)"))
    if not -places <= at < places:
        raise Refuse(f"position {at} is outside the sequence's {places} places")
    return at % places


def _sequence(value: Value) -> TensorSequence:
    if not isinstance(value, TensorSequence):
        raise Refuse("expects a sequence computed by the graph")
    return value


@onnx_op("SplitToSequence")
def _split_to_sequence(b, node, ins, attrs):
    """Split's parts as a sequence; without split, pieces of 1 (squeezed unless keepdims)."""
    x = b.device(ins[0])
    axis = int(attrs.get("axis", 0)) % len(x.shape)
    n = x.shape[axis]
    split = b.host(ins[1], "split sizes") if len(ins) > 1 and ins[1] is not None else None
    if split is None:
        parts = b.g.split(x, [1] * n, axis) if n > 1 else [x]
        if not attrs.get("keepdims", 1):
            parts = [b.g.reshape(p, x.shape[:axis] + x.shape[axis + 1:]) for p in parts]
        return [TensorSequence(tuple(parts))]
    if split.ndim == 0:  # pieces of that size, the last one shorter
        size = int(split)
        sizes = [min(size, n - start) for start in range(0, n, size)]
    else:
        sizes = [int(v) for v in split]
    parts = b.g.split(x, sizes, axis) if len(sizes) > 1 else [x]
    return [TensorSequence(tuple(parts))]


@onnx_op("SequenceConstruct")
def _sequence_construct(b, node, ins, attrs):
    return [TensorSequence(tuple(ins))]


@onnx_op("SequenceEmpty")
def _sequence_empty(b, node, ins, attrs):
    return [TensorSequence(())]


@onnx_op("SequenceAt")
def _sequence_at(b, node, ins, attrs):
    items = _sequence(ins[0]).items
    return items[_position(b, ins, 1, len(items), 0, "SequenceAt")]


@onnx_op("SequenceLength")
def _sequence_length(b, node, ins, attrs):
    return np.asarray(len(_sequence(ins[0]).items), np.int64)


@onnx_op("SequenceInsert")
def _sequence_insert(b, node, ins, attrs):
    items = _sequence(ins[0]).items
    at = _position(b, ins, 2, len(items) + 1, len(items), "SequenceInsert")
    return [TensorSequence(items[:at] + (ins[1],) + items[at:])]


@onnx_op("SequenceErase")
def _sequence_erase(b, node, ins, attrs):
    items = _sequence(ins[0]).items
    at = _position(b, ins, 1, len(items), len(items) - 1, "SequenceErase")
    return [TensorSequence(items[:at] + items[at + 1:])]


@onnx_op("ConcatFromSequence")
def _concat_from_sequence(b, node, ins, attrs):
    """The items concatenated along `axis`, or stacked on a new one (new_axis=1)."""
    items = [b.device(v) for v in _sequence(ins[0]).items]
    if not items:
        raise Refuse("concatenates an empty sequence")
    rank = len(items[0].shape) + (1 if attrs.get("new_axis", 0) else 0)
    axis = int(attrs["axis"]) % rank
    if attrs.get("new_axis", 0):
        items = [b.g.reshape(v, v.shape[:axis] + (1,) + v.shape[axis:]) for v in items]
    return b.g.concat(items, axis) if len(items) > 1 else items[0]


@onnx_op("Slice")
def _slice(b, node, ins, attrs):
    x = b.device(ins[0])
    starts = b.host(ins[1], "starts").reshape(-1).tolist()
    ends = b.host(ins[2], "ends").reshape(-1).tolist()
    axes = (b.host(ins[3], "axes").reshape(-1).tolist() if len(ins) > 3 and ins[3] is not None
            else list(range(len(starts))))
    steps = (b.host(ins[4], "steps").reshape(-1).tolist() if len(ins) > 4 and ins[4] is not None
             else [1] * len(starts))
    for start, end, axis, step in zip(starts, ends, axes, steps):
        x = slice_along(b.g, x, axis % len(x.shape), start, end, step)
    return x


@onnx_op("Gather")
def _gather(b, node, ins, attrs):
    data, indices = ins
    axis = int(attrs.get("axis", 0))
    x = b.device(data)
    if isinstance(indices, Tensor):
        if axis % len(x.shape) == 0 and len(x.shape) == 2:
            return b.g.embedding(b.g.cast(indices, "i32"), x)  # as nn.Embedding builds it
        return b.g.gather(x, b.g.cast(indices, "i32"), axis)
    return take(b.g, x, b.host(indices, "indices"), axis)


@onnx_op("GatherElements")
def _gather_elements(b, node, ins, attrs):
    x = b.device(ins[0])
    return b.g.gather_elements(x, b.g.cast(b.device(ins[1]), "i32"),
                               int(attrs.get("axis", 0)) % len(x.shape))


@onnx_op("TopK")
def _topk(b, node, ins, attrs):
    # sorted=0 leaves the order to the engine: the sorted one serves
    k = int(b.host(ins[1], "k").reshape(()))
    return list(b.g.topk(b.device(ins[0]), k, int(attrs.get("axis", -1)),
                         bool(attrs.get("largest", 1))))


@onnx_op("Trilu")
def _trilu(b, node, ins, attrs):
    x = b.device(ins[0])
    k = int(b.host(ins[1], "k").reshape(())) if len(ins) > 1 and ins[1] is not None else 0
    keep = (np.triu if attrs.get("upper", 1) else np.tril)(np.ones(x.shape[-2:], bool), k)
    return b.g.where(b.g.constant(keep.astype(np.float32)), x, 0.0)


def _along(axis: int, rank: int, n: int) -> np.ndarray:
    """0 .. n-1 as i32 along `axis` of a `rank`-D array, every other axis of length 1."""
    return np.arange(n, dtype=np.int32).reshape([n if a == axis else 1 for a in range(rank)])


@onnx_op("OneHot")
def _one_hot(b, node, ins, attrs):
    g = b.g
    indices = g.cast(b.device(ins[0]), "i32")
    depth = int(b.host(ins[1], "depth").reshape(()))
    off, on = (float(v) for v in b.host(ins[2], "values").reshape(-1))
    rank = len(indices.shape) + 1
    axis = int(attrs.get("axis", -1)) % rank
    # a negative index counts from the end; one out of range matches no class
    zero, size = (g.constant(np.array(v, np.int32), "i32") for v in (0, depth))
    indices = g.where(g.less(indices, zero), g.add(indices, size), indices)
    wide = g.reshape(indices, [1 if a == axis else d for a, d in
                               enumerate([*indices.shape[:axis], 1, *indices.shape[axis:]])])
    mask = g.equal(wide, g.constant(_along(axis, rank, depth), "i32"))
    return mask if (off, on) == (0.0, 1.0) else g.add(g.mul(mask, on - off), off)


@onnx_op("Hardmax")
def _hardmax(b, node, ins, attrs):
    """1 at the first maximum along `axis`, 0 elsewhere."""
    x = b.device(ins[0])
    axis = int(attrs.get("axis", -1)) % len(x.shape)
    first = b.g.argmax(x, axis, True)
    return b.g.equal(first, b.g.constant(_along(axis, len(x.shape), x.shape[axis]), "i32"))


@onnx_op("EyeLike")
def _eye_like(b, node, ins, attrs):
    """A constant: only the input's shape is read."""
    shape = ins[0].shape if not isinstance(ins[0], Initializer) else ins[0].array.shape
    return np.eye(*shape, k=int(attrs.get("k", 0)), dtype=np.float32)


@onnx_op("DepthToSpace", "SpaceToDepth")
def _depth_space(b, node, ins, attrs):
    """torch's pixel_shuffle (DepthToSpace CRD) and its inverse, and DepthToSpace's DCR:
    reshapes around one transpose."""
    x = b.device(ins[0])
    if len(x.shape) != 4:
        raise Refuse(f"{node.op_type} of a {len(x.shape)}-D input (4-D is defined)")
    n, c, h, w = x.shape
    k = int(attrs["blocksize"])
    if node.op_type == "SpaceToDepth":
        split, order, out = (n, c, h // k, k, w // k, k), (0, 3, 5, 1, 2, 4), (n, c * k * k,
                                                                              h // k, w // k)
    elif attrs.get("mode", "DCR") == "DCR":
        split, order, out = (n, k, k, c // (k * k), h, w), (0, 3, 4, 1, 5, 2), (n, c // (k * k),
                                                                               h * k, w * k)
    else:
        split, order, out = (n, c // (k * k), k, k, h, w), (0, 1, 4, 2, 5, 3), (n, c // (k * k),
                                                                               h * k, w * k)
    return b.g.reshape(b.g.transpose(b.g.reshape(x, split), order), out)


@onnx_op("ScatterND")
def _scatter_nd(b, node, ins, attrs):
    """Indices known at import (an exporter's `x[..., idx] = y`): the indexed leading axes
    merged into rows."""
    data, updates = b.device(ins[0]), b.device(ins[2])
    indices = b.host(ins[1], "indices (ScatterND's, when computed at run time)")
    k = indices.shape[-1]
    lead, rest = data.shape[:k], data.shape[k:]
    points = indices.reshape(-1, k) % np.array(lead)
    targets = np.ravel_multi_index(tuple(points.T), lead) if len(points) else points[:, 0]
    rows = math.prod(lead)
    out = scatter_along(b.g, b.g.reshape(data, (rows, *rest)),
                        b.g.reshape(updates, (len(points), *rest)), targets, 0,
                        attrs.get("reduction", "none"))
    return b.g.reshape(out, data.shape)


@onnx_op("ScatterElements")
def _scatter_elements(b, node, ins, attrs):
    """Indices known at import: every element a row of one."""
    data, updates = b.device(ins[0]), b.device(ins[2])
    indices = b.host(ins[1], "indices (ScatterElements', when computed at run time)")
    axis = int(attrs.get("axis", 0)) % len(data.shape)
    where = list(np.indices(indices.shape))
    where[axis] = indices % data.shape[axis]
    targets = np.ravel_multi_index(tuple(w.reshape(-1) for w in where), data.shape)
    size = math.prod(data.shape)
    out = scatter_along(b.g, b.g.reshape(data, (size,)), b.g.reshape(updates, (indices.size,)),
                        targets, 0, attrs.get("reduction", "none"))
    return b.g.reshape(out, data.shape)


@onnx_op("Col2Im")
def _col2im(b, node, ins, attrs):
    """torch's F.fold: blocks of columns added back into an image (MobileViT-v2's)."""
    x = b.device(ins[0])
    image = [int(v) for v in b.host(ins[1], "image_shape")]
    block = [int(v) for v in b.host(ins[2], "block_shape")]
    if len(image) != 2 or len(x.shape) != 3:
        raise Refuse(f"Col2Im of {len(image)} spatial axes (2 are supported)")
    return fold(b.g, x, image, block, _spatial(attrs, "dilations", 2, 1),
                _spatial(attrs, "pads", 4, 0), _spatial(attrs, "strides", 2, 1))


@onnx_op("GatherND")
def _gather_nd(b, node, ins, attrs):
    if attrs.get("batch_dims", 0):
        raise Refuse("GatherND with batch_dims is not supported")
    indices = b.host(ins[1], "indices (GatherND's, when computed at run time)")
    return gather_points(b.g, b.device(ins[0]),
                         [indices[..., j] for j in range(indices.shape[-1])], 0)


@onnx_op("Einsum")
def _einsum(b, node, ins, attrs):
    return b.g.einsum(attrs["equation"], *[b.device(v) for v in ins])


@onnx_op("ConvTranspose")
@_lift_1d
def _conv_transpose(b, node, ins, attrs):
    x, w = b.device(ins[0]), b.device(ins[1])
    bias = b.device(ins[2]) if len(ins) > 2 and ins[2] is not None else None
    if len(w.shape) != 4:
        raise Refuse(f"{len(w.shape) - 2}-D transposed convolutions are not supported (1-D "
                     "and 2-D are)")
    strides = _spatial(attrs, "strides", 2, 1)
    extra = _spatial(attrs, "output_padding", 2, 0)
    dilations = _spatial(attrs, "dilations", 2, 1)
    pads = list(attrs.get("pads", [0] * 4))
    auto = attrs.get("auto_pad", "NOTSET")
    if "output_shape" in attrs or auto in ("SAME_UPPER", "SAME_LOWER"):
        # ONNX's rule: the padding that gives output_shape (the input's times the stride)
        shape = list(attrs.get("output_shape", [n * s for n, s in zip(x.shape[2:], strides)]))
        total = [s * (n - 1) + e + (k - 1) * d + 1 - o for s, n, e, k, d, o in
                 zip(strides, x.shape[2:], extra, w.shape[2:], dilations, shape[-2:])]
        if min(total) < 0:
            raise Refuse(f"output_shape {shape} is larger than the full transposed "
                         "convolution")
        small = [t // 2 for t in total]
        upper = auto == "SAME_UPPER"
        pads = [*(s if upper else t - s for s, t in zip(small, total)),
                *(t - s if upper else s for s, t in zip(small, total))]
    elif auto == "VALID":
        pads = [0] * 4
    # each axis padded by its smaller side in the product, the rest cropped from its output
    common = [min(pads[i], pads[i + 2]) for i in range(2)]
    y = b.g.conv_transpose2d(x, w, bias, tuple(strides), tuple(common), tuple(extra),
                             tuple(dilations), int(attrs.get("group", 1)))
    for i in range(2):
        lo, hi = pads[i] - common[i], pads[i + 2] - common[i]
        if lo or hi:
            y = b.g.slice(y, 2 + i, lo, y.shape[2 + i] - hi)
    return y


# gates a step computes: RNN's one, GRU's update, reset and candidate, LSTM's input, output,
# forget and candidate (ONNX's order)
RECURRENT_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
RECURRENT_ACTIVATIONS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"],
                         "LSTM": ["Sigmoid", "Tanh", "Tanh"]}


@onnx_op(*RECURRENT_GATES)
def _recurrent(b, node, ins, attrs):
    """RNN, GRU and LSTM (torch's nn.RNN, nn.GRU, nn.LSTM as torch.onnx writes them, a node
    per layer) unrolled over the sequence's fixed length: the input's products for every step
    in one matmul, then a product of the hidden state a step."""
    g, op = b.g, node.op_type
    ins = ins + [None] * (8 - len(ins))
    direction = attrs.get("direction", "forward")
    directions = 2 if direction == "bidirectional" else 1
    activations = [a.lower() for a in attrs.get("activations", [])]
    if activations not in ([], [a.lower() for a in RECURRENT_ACTIVATIONS[op]] * directions) \
            or "clip" in attrs or attrs.get("input_forget", 0) or ins[7] is not None:
        raise Refuse("only the default activations, without clip, input_forget or peepholes, "
                     "are supported")
    x = b.device(ins[0])
    batch_first = bool(attrs.get("layout", 0))
    if batch_first:
        x = g.transpose(x, (1, 0, 2))
    steps, batch, width = x.shape
    if ins[4] is not None:
        lengths = b.host(ins[4], "sequence_lens")
        if np.any(lengths != steps):
            raise Refuse("sequences of different lengths (sequence_lens) are not supported")
    hidden, gates = int(attrs["hidden_size"]), RECURRENT_GATES[op]
    reset_after = op == "GRU" and bool(attrs.get("linear_before_reset", 0))
    w, r = b.device(ins[1]), b.device(ins[2])
    ys, finals, cells = [], [], []
    for d in range(directions):
        wd, rd = _direction(g, w, d), _direction(g, r, d)
        xw = g.matmul(g.reshape(x, (steps * batch, width)), wd, transpose_b=True)
        candidate_bias = None
        if ins[3] is not None:
            bias = g.reshape(_direction(g, b.device(ins[3]), d), (2, gates * hidden))
            wb, rb = (g.reshape(g.slice(bias, 0, k, k + 1), (gates * hidden,)) for k in (0, 1))
            if reset_after:  # the candidate's recurrent bias is inside the reset gate's product
                candidate_bias = g.slice(rb, 0, 2 * hidden, 3 * hidden)
                rb = g.concat([g.slice(rb, 0, 0, 2 * hidden),
                               g.constant(np.zeros(hidden, np.float32))], 0)
            xw = g.bias_add(xw, g.add(wb, rb))
        xw = g.reshape(xw, (steps, batch, gates * hidden))
        h, c = (None if v is None else _direction(g, b.device(v), d) for v in (ins[5], ins[6]))
        if op == "LSTM" and c is None:
            c = g.constant(np.zeros((batch, hidden), np.float32))
        order = range(steps - 1, -1, -1) if direction == "reverse" or d == 1 else range(steps)
        outs: list[Tensor] = [None] * steps  # type: ignore[list-item]
        for t in order:
            xt = g.reshape(g.slice(xw, 0, t, t + 1), (batch, gates * hidden))
            if op == "GRU":
                h = _gru_step(g, xt, h, rd, hidden, reset_after, candidate_bias)
            else:
                z = xt if h is None else g.add(xt, g.matmul(h, rd, transpose_b=True))
                if op == "RNN":
                    h = g.tanh(z)
                else:
                    i, o, f, cand = g.split(z, [hidden] * 4, 1)
                    c = g.add(g.mul(g.sigmoid(f), c), g.mul(g.sigmoid(i), g.tanh(cand)))
                    h = g.mul(g.sigmoid(o), g.tanh(c))
            outs[t] = g.reshape(h, (1, 1, batch, hidden))
        ys.append(g.concat(outs, 0))
        finals.append(g.reshape(h, (1, batch, hidden)))
        cells.append(g.reshape(c, (1, batch, hidden)) if c is not None else None)
    y, y_h = g.concat(ys, 1), g.concat(finals, 0)
    y_c = g.concat(cells, 0) if op == "LSTM" else None
    if batch_first:
        y, y_h = g.transpose(y, (2, 0, 1, 3)), g.transpose(y_h, (1, 0, 2))
        y_c = g.transpose(y_c, (1, 0, 2)) if y_c is not None else None
    return [y, y_h] + ([y_c] if y_c is not None else [])


def _direction(g: Graph, v: Tensor, d: int) -> Tensor:
    """A recurrent node's weights or state for direction `d` (its leading axis)."""
    return g.reshape(g.slice(v, 0, d, d + 1), v.shape[1:])


def _gru_step(g: Graph, xt: Tensor, h: Tensor | None, r: Tensor, hidden: int,
              reset_after: bool, candidate_bias: Tensor | None) -> Tensor:
    """One GRU step: xt holds the input's products (with the biases outside the reset)."""
    xz, xr, xn = g.split(xt, [hidden] * 3, 1)
    if h is None:  # a zero initial state
        h = g.constant(np.zeros((xt.shape[0], hidden), np.float32))
    hz, hr = g.split(g.matmul(h, g.slice(r, 0, 0, 2 * hidden), transpose_b=True), [hidden] * 2,
                     1)
    update, reset = g.sigmoid(g.add(xz, hz)), g.sigmoid(g.add(xr, hr))
    rn = g.slice(r, 0, 2 * hidden, 3 * hidden)
    if reset_after:
        hn = g.matmul(h, rn, transpose_b=True)
        if candidate_bias is not None:
            hn = g.bias_add(hn, candidate_bias)
        n = g.tanh(g.add(xn, g.mul(reset, hn)))
    else:
        n = g.tanh(g.add(xn, g.matmul(g.mul(reset, h), rn, transpose_b=True)))
    return g.add(n, g.mul(update, g.sub(h, n)))


@onnx_op("Expand")
def _expand(b, node, ins, attrs):
    x = b.device(ins[0])
    shape = [int(d) for d in b.host(ins[1], "shape").reshape(-1)]
    if len(shape) < len(x.shape):  # ONNX broadcasts both ways; expand wants x's rank at most
        shape = [1] * (len(x.shape) - len(shape)) + shape
    return b.g.expand(x, shape)


@onnx_op("Tile")
def _tile(b, node, ins, attrs):
    return b.g.tile(b.device(ins[0]), b.host(ins[1], "repeats").reshape(-1).tolist())


@onnx_op("Pad")
def _pad(b, node, ins, attrs):
    x = b.device(ins[0])
    mode = PAD_MODES.get(attrs.get("mode", "constant"))
    if mode is None:
        raise Refuse(f"padding mode '{attrs['mode']}' is not supported")
    pads = b.host(ins[1], "pads").reshape(-1).tolist()
    value = ins[2] if len(ins) > 2 else None
    value = 0.0 if value is None else float(b.host(value, "padding value").reshape(-1)[0])
    rank = len(x.shape)
    axes = (_axes(b, node, [None, ins[3]], {}, rank) if len(ins) > 3 and ins[3] is not None
            else list(range(rank)))
    for i, axis in enumerate(axes):
        before, after = int(pads[i]), int(pads[i + len(axes)])
        if before or after:
            x = b.g.pad(x, axis, before, after, mode=mode, value=value)
    return x


PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "replicate",
             "wrap": "circular"}


@onnx_op("Resize")
def _resize(b, node, ins, attrs):
    x = b.device(ins[0])
    ins = ins + [None] * (4 - len(ins))
    mode = attrs.get("mode", "nearest")
    sizes = b.host(ins[3], "sizes").reshape(-1).tolist() if ins[3] is not None else []
    scales = b.host(ins[2], "scales").reshape(-1).tolist() if ins[2] is not None else []
    if attrs.get("axes") is not None or \
            attrs.get("keep_aspect_ratio_policy", "stretch") != "stretch":
        raise Refuse("Resize with axes or a keep_aspect_ratio_policy is not supported")
    if mode not in ("nearest", "linear", "cubic"):
        raise Refuse(f"resize mode '{mode}' is not supported (nearest, linear and cubic are)")
    if (sizes and list(sizes[:2]) != list(x.shape[:2])) or \
            (not sizes and list(scales[:2]) != [1.0, 1.0]):
        raise Refuse("only the axes after batch and channels can be resized")
    coordinates = attrs.get("coordinate_transformation_mode", "half_pixel")
    if attrs.get("antialias", 0) or attrs.get("exclude_outside", 0) or \
            coordinates not in COORDINATE_MODES:
        return _resize_by_reference(b, x, ins, attrs, sizes, scales)
    common = {"mode": mode, "coordinate_mode": coordinates,
              "nearest_mode": attrs.get("nearest_mode", "round_prefer_floor"),
              "cubic_coeff_a": float(attrs.get("cubic_coeff_a", -0.75))}
    if sizes:
        return b.g.resize(x, size=[int(n) for n in sizes[2:]], **common)
    return b.g.resize(x, scale=scales[2:], **common)


def _resize_by_reference(b, x: Tensor, ins: list, attrs: dict, sizes: list,
                         scales: list) -> Tensor:
    """Resize's other forms (antialias, exclude_outside, half_pixel_symmetric,
    tf_crop_and_resize): each spatial axis's interpolation matrix is onnx's reference Resize of
    the identity along that axis, applied by `resample`; tf_crop_and_resize's
    extrapolation_value fills, as a constant, where any axis's position falls outside."""
    from onnx import helper
    rank = len(x.shape)
    roi = (b.host(ins[1], "roi").reshape(-1) if ins[1] is not None
           and attrs.get("coordinate_transformation_mode") == "tf_crop_and_resize" else None)
    extrapolated = float(attrs.get("extrapolation_value", 0.0))
    inside = None  # where every axis's position falls inside the roi
    for axis in range(2, rank):
        n = x.shape[axis]
        axis_roi = None if roi is None else np.array([0, roi[axis], 1, roi[axis + rank]],
                                                     np.float32)
        target = ([None, None, np.array([1.0, scales[axis]], np.float32)] if not sizes else
                  [None, None, None, np.array([n, sizes[axis]], np.int64)])

        def resize_rows(rows: np.ndarray, fill: float, axis_roi=axis_roi,
                        target=target) -> np.ndarray:
            one = helper.make_node("Resize", ["X", "roi", "scales", "sizes"], ["Y"],
                                   **{**attrs, "extrapolation_value": fill})
            return b.fold(one, [rows, axis_roi, *target[2:]])[0]
        matrix = resize_rows(np.eye(n, dtype=np.float32), 0.0).T
        if roi is not None and extrapolated:
            keep = 1.0 - resize_rows(np.zeros((1, n), np.float32), 1.0)[0]
            shape = [1] * rank
            shape[axis] = len(keep)
            inside = keep.reshape(shape) if inside is None else inside * keep.reshape(shape)
        if not np.array_equal(matrix, np.eye(n, dtype=np.float32)):
            x = b.g.resample(x, axis, np.ascontiguousarray(matrix, np.float32))
    if inside is not None and not np.all(inside == 1):
        x = b.g.add(x, b.g.constant(((1.0 - inside) * extrapolated).astype(np.float32)))
    return x


@onnx_op("AffineGrid")
def _affine_grid(b, node, ins, attrs):
    """torch's F.affine_grid: each output position's normalized (x, y[, z], 1) times theta
    transposed, one batched product with a constant grid."""
    theta = b.device(ins[0])
    size = [int(d) for d in b.host(ins[1], "size").reshape(-1)]
    spatial = size[2:]
    corners = bool(attrs.get("align_corners", 0))
    axes = [np.linspace(-1, 1, n) if corners else (np.arange(n) * 2 + 1) / n - 1
            for n in spatial]
    mesh = np.meshgrid(*axes, indexing="ij")  # (D,) H, W
    base = np.stack([*mesh[::-1], np.ones(spatial)], -1).reshape(1, -1, len(spatial) + 1)
    grid = b.g.matmul(b.g.constant(base.astype(np.float32)), theta, transpose_b=True)
    return b.g.reshape(grid, (size[0], *spatial, len(spatial)))


@onnx_op("CenterCropPad")
def _center_crop_pad(b, node, ins, attrs):
    x = b.device(ins[0])
    target = [int(d) for d in b.host(ins[1], "shape").reshape(-1)]
    axes = [int(a) % len(x.shape) for a in attrs.get("axes", range(len(x.shape)))]
    for axis, want in zip(axes, target):
        n = x.shape[axis]
        if want < n:
            x = b.g.slice(x, axis, (n - want) // 2, (n - want) // 2 + want)
        elif want > n:
            x = b.g.pad(x, axis, (want - n) // 2, want - n - (want - n) // 2)
    return x


@onnx_op("DFT")
def _dft(b, node, ins, attrs):
    x = b.device(ins[0])
    ins = ins + [None] * (3 - len(ins))
    if ins[2] is not None:
        axis = int(b.host(ins[2], "axis").reshape(()))
    else:
        axis = int(attrs.get("axis", 1 if b.opset < 20 else -2))
    axis %= len(x.shape)
    length = int(b.host(ins[1], "dft_length").reshape(())) if ins[1] is not None else \
        x.shape[axis]
    inverse, onesided = bool(attrs.get("inverse", 0)), bool(attrs.get("onesided", 0))
    if inverse and onesided:
        raise Refuse("an inverse one-sided DFT is not defined")
    return fourier(b.g, x, axis, length, inverse, onesided)


@onnx_op("STFT")
def _stft(b, node, ins, attrs):
    """Frames of the signal (one gather at constant indices), windowed, each a DFT."""
    g = b.g
    ins = ins + [None] * (4 - len(ins))
    x = b.device(ins[0])
    step = int(b.host(ins[1], "frame_step").reshape(()))
    window = b.device(ins[2], trainable=False) if ins[2] is not None else None
    length = (int(b.host(ins[3], "frame_length").reshape(())) if ins[3] is not None
              else window.shape[0])
    count = (x.shape[1] - length) // step + 1
    starts = np.arange(count)[:, None] * step + np.arange(length)[None, :]
    frames = g.gather(x, g.constant(starts.astype(np.int32), "i32"), 1)  # (B, F, L, C)
    if window is not None:
        frames = g.mul(frames, g.reshape(window, (length, 1)))
    return fourier(g, frames, 2, length, False, bool(attrs.get("onesided", 1)))


@onnx_op("GridSample")
def _grid_sample(b, node, ins, attrs):
    """torch's F.grid_sample on 4-D inputs, bilinear or nearest, zeros or border padding: each
    corner a gather along the flattened pixels at indices computed from the grid, weighted;
    the gradient to the input through the gathers, to the grid through the weights. Border
    padding reads the edge at the taps past it (onnxruntime's and onnx's reference's rule,
    where torch clamps the coordinate first: the same numbers, but an infinity at a tap of
    weight 0 gives NaN at other places)."""
    g = b.g
    x, grid = b.device(ins[0]), b.device(ins[1])
    mode = {"bilinear": "linear"}.get(attrs.get("mode", "linear"), attrs.get("mode", "linear"))
    padding = attrs.get("padding_mode", "zeros")
    if len(x.shape) != 4 or mode not in ("linear", "nearest") or padding not in ("zeros",
                                                                                 "border"):
        raise Refuse("GridSample of 4-D inputs, linear or nearest, zeros or border padding "
                     f"is supported (not {len(x.shape)}-D, {mode}, {padding})")
    n, c, h, w = x.shape
    out = grid.shape[1:3]
    corners = bool(attrs.get("align_corners", 0))
    coords = []
    for k, size in enumerate((w, h)):  # the grid holds (x, y)
        t = g.reshape(g.slice(grid, 3, k, k + 1), (n, 1, out[0] * out[1]))
        # [-1, 1] to pixels: the corners' centres, or the image's edges
        t = (g.mul(g.add(t, 1.0), (size - 1) / 2) if corners
             else g.sub(g.mul(g.add(t, 1.0), size / 2), 0.5))
        coords.append(t)
    flat = g.reshape(x, (n, c, h * w))
    if mode == "nearest":
        taps = [([g.round(t) for t in coords], None)]
    else:
        lows = [g.floor(t) for t in coords]
        highs = [g.add(t, 1.0) for t in lows]
        above = [g.sub(t, lo) for t, lo in zip(coords, lows)]
        taps = [([cx, cy], g.mul(wx, wy))
                for cx, wx in ((lows[0], g.sub(1.0, above[0])), (highs[0], above[0]))
                for cy, wy in ((lows[1], g.sub(1.0, above[1])), (highs[1], above[1]))]
    total = None
    for (cx, cy), weight in taps:
        index = g.add(g.mul(g.clamp(cy, 0.0, h - 1.0), float(w)), g.clamp(cx, 0.0, w - 1.0))
        index = g.expand(g.cast(index, "i32"), (n, c, out[0] * out[1]))
        value = g.gather_elements(flat, index, 2)
        term = value if weight is None else g.mul(value, weight)  # weight 0 times inf: NaN
        if padding == "zeros":  # a tap outside reads 0, not its clamped pixel (inf * 0)
            inside = g.mul(g.mul(g.greater_equal(cx, 0.0), g.less_equal(cx, w - 1.0)),
                           g.mul(g.greater_equal(cy, 0.0), g.less_equal(cy, h - 1.0)))
            term = g.where(inside, term, 0.0)
        total = term if total is None else g.add(total, term)
    return g.reshape(total, (n, c, *out))


@onnx_op("Dropout")
def _dropout(b, node, ins, attrs):
    x = ins[0]
    ratio = float(b.host(ins[1], "ratio")) if len(ins) > 1 and ins[1] is not None else \
        float(attrs.get("ratio", 0.5))
    live = (len(ins) > 2 and ins[2] is not None and bool(b.host(ins[2], "training_mode")))
    if not (b.training and live and ratio > 0):
        return [x]
    return [b.g.dropout(b.device(x), ratio)]


@onnx_op("Cast", "CastLike")
def _cast(b, node, ins, attrs):
    x = b.device(ins[0])
    if node.op_type == "CastLike":
        to = "i32" if _is_int(ins[1]) else "f32"
    elif b.onnx.TensorProto.DataType.Name(int(attrs["to"])) == "BOOL":
        return b.g.not_equal(x, 0 if x.dtype == "i32" else 0.0)  # a mask, as comparisons give
    else:
        to = _dtype(b.onnx, int(attrs["to"]))
    return b.g.cast(x, to)


@onnx_op("Shape")
def _shape(b, node, ins, attrs):
    shape = np.array(ins[0].shape if not isinstance(ins[0], Initializer)
                     else ins[0].array.shape, np.int64)
    start, end = attrs.get("start", 0), attrs.get("end", len(shape))
    return shape[start:end]


@onnx_op("Size")
def _size(b, node, ins, attrs):
    v = ins[0]
    return np.array(math.prod(v.shape if not isinstance(v, Initializer) else v.array.shape),
                    np.int64)


@onnx_op("If")
def _if(b, node, ins, attrs):
    """A branch chosen by a condition known at import is inlined; the other is dropped."""
    cond = bool(np.asarray(b.host(ins[0], "condition")).reshape(-1)[0])
    branch = attrs["then_branch" if cond else "else_branch"]
    b.initializers(branch)
    b.walk(branch.node)
    return [b.env[o.name] for o in branch.output]


# ---- onnxruntime's contrib ops, as its offline optimizer writes them ----------------------------
# (SessionOptions.optimized_model_filepath: ORT_ENABLE_EXTENDED fuses into these; semantics from
# onnxruntime's docs/ContribOperators.md). Each becomes the vkml ops of its unfused form.
# ORT_ENABLE_BASIC also writes ORT_STANDARD_DOMAIN's ops in the standard domain, which
# LayerNormalization's and RMSNormalization's handlers above take.
MS = "com.microsoft::"
FUSED_ACTIVATIONS = {"Relu": [], "Tanh": [], "Sigmoid": [], "LeakyRelu": ["alpha"],
                     "HardSigmoid": ["alpha", "beta"], "Clip": []}


@dataclass
class _StandIn:
    """A node of the op a fused op applies (FusedConv's activation, a QLinear op's float
    op), for that op's own handler, which reads its op_type alone."""

    op_type: str


@onnx_op(MS + "FusedConv")
def _fused_conv(b, node, ins, attrs):
    """activation(Conv(X, W, B) + Z), activation_params as the activation's attributes (Clip's
    its bounds)."""
    activation = attrs.pop("activation", None)
    params = list(attrs.pop("activation_params", []))
    y = _conv(b, node, ins[:3], attrs)
    if len(ins) > 3 and ins[3] is not None:
        y = b.g.add(y, b.device(ins[3]))
    if activation is None:
        return y
    if activation not in FUSED_ACTIVATIONS:
        raise Refuse(f"FusedConv's activation {activation} is not supported "
                     f"({', '.join(FUSED_ACTIVATIONS)} are)")
    if activation == "Clip":
        bounds = [np.float32(p) for p in params]
        return _clip(b, _StandIn("Clip"), [y, *bounds], {})
    named = dict(zip(FUSED_ACTIVATIONS[activation], params))
    return HANDLERS[activation](b, _StandIn(activation), [y], named)


@onnx_op(MS + "FusedMatMul", MS + "TransposeMatMul")
def _fused_matmul(b, node, ins, attrs):
    """alpha * op(A) @ op(B): transA / transB swap the last two axes; transBatchA / transBatchB
    move the first axis to just before the last (onnxruntime folds a Transpose of
    (L, batch, D) -> (batch, L, D) into it)."""
    g = b.g
    operands = []
    for x, batch, last in ((ins[0], "transBatchA", "transA"), (ins[1], "transBatchB", "transB")):
        x = b.device(x)
        rank = len(x.shape)
        if attrs.get(batch, 0) and rank > 2:
            x = g.transpose(x, [*range(1, rank - 1), 0, rank - 1])
        if attrs.get(last, 0):
            x = g.transpose(x, [*range(rank - 2), rank - 1, rank - 2])
        operands.append(x)
    y = matmul(g, *operands)
    alpha = float(attrs.get("alpha", 1.0))
    return y if alpha == 1.0 else g.mul(y, alpha)


@onnx_op(MS + "Gelu", MS + "BiasGelu", MS + "FastGelu")
def _ms_gelu(b, node, ins, attrs):
    """GELU of x (plus a bias where given): exact, or FastGelu's tanh form, which is torch's
    approximate="tanh" (0.797885 = sqrt(2 / pi), 0.035677 = 0.044715 sqrt(2 / pi))."""
    x = b.device(ins[0])
    if len(ins) > 1 and ins[1] is not None:
        x = _plus_bias(b, x, ins[1])
    return b.g.gelu(x, "tanh" if node.op_type == "FastGelu" else "none")


def _plus_bias(b, x: Tensor, bias: Value) -> Tensor:
    bias = b.device(bias)
    return b.g.bias_add(x, bias) if bias.shape == x.shape[-1:] else b.g.add(x, bias)


@onnx_op(MS + "QuickGelu")
def _quick_gelu(b, node, ins, attrs):
    return _swish_of(b.g, b.device(ins[0]), float(attrs.get("alpha", 1.702)))


@onnx_op(MS + "BiasAdd")
def _ms_bias_add(b, node, ins, attrs):
    return b.g.add(_plus_bias(b, b.device(ins[0]), ins[1]), b.device(ins[2]))


@onnx_op(MS + "SkipLayerNormalization", MS + "SkipSimplifiedLayerNormalization")
def _skip_layer_norm(b, node, ins, attrs):
    """The normalization (layer or RMS, over the last axis) of input + skip (+ bias), and
    that sum as the fourth output; the saved statistics (mean, inv_std_var) are not given."""
    g = b.g
    simplified = node.op_type == "SkipSimplifiedLayerNormalization"
    ins = [*ins, None, None]
    total = g.add(b.device(ins[0]), b.device(ins[1]))
    bias = ins[3 if simplified else 4]
    if bias is not None:
        total = _plus_bias(b, total, bias)
    eps = float(attrs.get("epsilon", 1e-12))
    gamma = b.device(ins[2])
    if simplified:
        y = g.rms_norm(total, gamma, eps)
    else:
        beta = b.device(ins[3]) if ins[3] is not None else None
        y = g.layer_norm(total, total.shape[-1:], gamma, beta, eps)
    return [y, None, None, total]


def _padding_mask(b, mask: Value, batch: int, keys: int, fill: float) -> Tensor | None:
    """onnxruntime's key mask as an additive mask of 0 and `fill` (its mask_filter_value)
    broadcasting over heads: raw, (batch, keys) or (batch, queries, keys), 1 to attend and 0
    not; or the keys each row attends to, [0, end) from (batch) ends (right padding) or
    [start, end) from (2 x batch) ends then starts (left padding)."""
    if mask is None:
        return None
    g = b.g
    if isinstance(mask, Tensor):
        shape = mask.shape
    else:
        shape = np.shape(b.host(mask, "mask"))
    if shape in ((batch,), (2 * batch,)):
        bounds = g.cast(g.reshape(b.device(mask), (-1, batch, 1)), "f32")
        key = b.device(np.arange(keys, dtype=np.float32))
        outside = g.greater_equal(key, g.slice(bounds, 0, 0, 1))
        if shape[0] == 2 * batch:
            outside = g.logical_or(outside, g.less(key, g.slice(bounds, 0, 1, 2)))
        return g.reshape(g.mul(outside, fill), (batch, 1, 1, keys))
    if len(shape) not in (2, 3) or shape[0] != batch or shape[-1] != keys:
        raise Refuse(f"a mask of shape {tuple(shape)} is not supported (raw masks of (batch, "
                     "keys) or (batch, queries, keys) and sequence bounds of (batch) or (2 x "
                     "batch) are)")
    if isinstance(mask, Tensor):
        additive = g.where(g.greater(g.cast(mask, "f32"), 0.0), 0.0, fill)
    else:
        additive = b.device(np.where(b.host(mask, "mask") > 0, 0.0, fill).astype(np.float32))
    return g.reshape(additive, (batch, 1, 1 if len(shape) == 2 else shape[1], keys))


def _ms_attention_of(b, node, q: Tensor, k: Tensor, v: Tensor, mask: Value,
                     bias: Value, attrs: dict) -> Tensor:
    """Heads split from (batch, length, heads x size), attention with the padding mask and the
    additive attention_bias, heads merged back."""
    g = b.g
    if attrs.get("do_rotary", 0) or attrs.get("past_present_share_buffer", 0):
        raise Refuse("do_rotary and past_present_share_buffer are not supported")
    heads = int(attrs["num_heads"])
    batch, keys = q.shape[0], k.shape[1]
    additive = _padding_mask(b, mask, batch, keys, float(attrs.get("mask_filter_value", -10000.0)))
    if bias is not None:
        bias = b.device(bias)
        additive = bias if additive is None else g.add(additive, bias)
    # onnxruntime reads a scale of 0 (what some writers store for "unset") as the default
    scale = float(attrs.get("scale", 0.0)) or None
    y = g.scaled_dot_product_attention(_heads(g, q, heads), _heads(g, k, heads),
                                       _heads(g, v, heads), additive,
                                       bool(attrs.get("unidirectional", 0)), scale)
    return merge_heads(g, y)


@onnx_op(MS + "Attention")
def _ms_attention(b, node, ins, attrs):
    """Self-attention with the query, key and value projections merged into one weight
    (hidden, q + k + v) and bias; no past state (a key/value cache)."""
    ins = [*ins, *[None] * 7]
    if ins[4] is not None or ins[6] is not None:
        raise Refuse("a past key/value state is not supported")
    g, x = b.g, b.device(ins[0])
    projected = matmul(g, x, b.device(ins[1]))
    if ins[2] is not None:
        projected = g.bias_add(projected, b.device(ins[2]))
    width = projected.shape[-1]
    sizes = list(attrs.get("qkv_hidden_sizes") or [width // 3] * 3)
    q, k, v = g.split(projected, sizes, -1)
    return [_ms_attention_of(b, node, q, k, v, ins[3], ins[5], attrs), None]


@onnx_op(MS + "MultiHeadAttention")
def _ms_multi_head_attention(b, node, ins, attrs):
    """Attention of separate query, key and value (batch, length, hidden) inputs, their
    projections' biases merged into one (q + k + v); no packed forms, no past state."""
    ins = [*ins, *[None] * 10]
    if any(ins[i] is not None for i in (6, 7, 8, 9)):
        raise Refuse("a past key/value state is not supported")
    if ins[1] is None or ins[2] is None:
        raise Refuse("packed query/key/value inputs are not supported (separate ones are)")
    g = b.g
    q, k, v = (b.device(x) for x in ins[:3])
    if not len(q.shape) == len(k.shape) == len(v.shape) == 3:
        raise Refuse("keys and values already split into heads (4-D) are not supported "
                     "(batch, length, hidden) inputs are")
    if ins[3] is not None:
        bq, bk, bv = g.split(b.device(ins[3]), [q.shape[-1], k.shape[-1], v.shape[-1]], 0)
        q, k, v = g.bias_add(q, bq), g.bias_add(k, bk), g.bias_add(v, bv)
    return [_ms_attention_of(b, node, q, k, v, ins[4], ins[5], attrs), None, None, None]


@onnx_op(MS + "EmbedLayerNormalization")
def _embed_layer_norm(b, node, ins, attrs):
    """BERT's embeddings: the word, position (0, 1, ... or position_ids) and segment rows
    summed, layer-normalized; the mask index, where a mask is given, is the position of each
    row's first 0 (its length under right padding); the sum before the norm the third output."""
    g = b.g
    ids, segments, words, positions, segment_table, gamma, beta, mask, position_ids = \
        [*ins, *[None] * 9][:9]
    ids = b.device(ids)
    batch, length = ids.shape
    total = g.gather(b.device(words), ids, 0)
    if position_ids is None:
        position_ids = np.arange(length, dtype=np.int32)
    total = g.add(total, g.gather(b.device(positions), b.device(position_ids), 0))
    if segments is not None:
        total = g.add(total, g.gather(b.device(segment_table), b.device(segments), 0))
    y = g.layer_norm(total, total.shape[-1:], b.device(gamma), b.device(beta),
                     float(attrs.get("epsilon", 1e-12)))
    index = None
    if mask is not None and int(attrs.get("mask_index_type", 1)):
        key = b.device(np.arange(length, dtype=np.float32))
        zeros_at = g.where(g.equal(g.cast(b.device(mask), "f32"), 0.0), key, float(length))
        index = g.cast(g.amin(zeros_at, -1), "i32")
    return [y, index, total]


# ---- the QOperator format (onnxruntime's quantize_static(quant_format=QOperator), the ONNX
# model zoo's int8 models): each op on quantized values as DequantizeLinear of its inputs, the
# float op, QuantizeLinear of its result, which the integer kernels compute up to the rounding
# of their requantization (a value halfway between two steps may land on either).
def _dequantized(b, ins: list, axis: int = 1) -> Tensor | np.ndarray:
    """DequantizeLinear of (x, scale, zero point): at import where all three are known."""
    if not any(isinstance(v, (Tensor, Initializer)) for v in ins):
        return _dequantize(ins, {"axis": axis})[0]
    return _dequantize_linear(b, None, ins, {"axis": axis})


def _requantized(b, y: Tensor, scale: Value, zero: Value) -> Tensor:
    return _quantize_linear(b, None, [y, scale, zero], {})


def _int_bias(b, bias: Value, scale: Value) -> Value:
    """An int32 bias of scale x_scale * w_scale (per output channel or one) as floats."""
    if bias is None:
        return None
    bias = np.asarray(b.host(bias, "bias"), np.float32)
    return bias * np.asarray(b.host(scale, "scale"), np.float32)


@onnx_op("QLinearConv")
def _qlinear_conv(b, node, ins, attrs):
    ins = [*ins, None][:9]
    x, w = _dequantized(b, ins[0:3]), _dequantized(b, ins[3:6], axis=0)
    scale = np.asarray(b.host(ins[1], "x_scale"), np.float32) * np.asarray(
        b.host(ins[4], "w_scale"), np.float32)
    y = _conv(b, node, [x, w, _int_bias(b, ins[8], scale)], attrs)
    return _requantized(b, y, ins[6], ins[7])


@onnx_op("QLinearMatMul")
def _qlinear_matmul(b, node, ins, attrs):
    a, w = _dequantized(b, ins[0:3]), _dequantized(b, ins[3:6], axis=-1)
    return _requantized(b, matmul(b.g, b.device(a), b.device(w)), ins[6], ins[7])


@onnx_op(MS + "QGemm")
def _qgemm(b, node, ins, attrs):
    """Gemm of dequantized A and B plus C (int32, of scale a_scale * b_scale), requantized by
    y_scale and y_zero_point, or float where there is no y_scale."""
    ins = [*ins, None, None, None][:9]
    trans_b = int(attrs.get("transB", 0))
    a, w = _dequantized(b, ins[0:3]), _dequantized(b, ins[3:6], axis=0 if trans_b else 1)
    scale = np.asarray(b.host(ins[1], "a_scale"), np.float32) * np.asarray(
        b.host(ins[4], "b_scale"), np.float32)
    y = _gemm(b, node, [a, w, _int_bias(b, ins[6], scale)],
              {k: v for k, v in attrs.items() if k != "beta"})
    return y if ins[7] is None else _requantized(b, y, ins[7], ins[8])


# onnxruntime's elementwise QLinear ops: the float op of their dequantized inputs
QLINEAR_BINARY = {"QLinearAdd": "add", "QLinearMul": "mul"}


@onnx_op(*(MS + op for op in QLINEAR_BINARY))
def _qlinear_binary(b, node, ins, attrs):
    x, y = (b.device(_dequantized(b, ins[k:k + 3])) for k in (0, 3))
    return _requantized(b, getattr(b.g, QLINEAR_BINARY[node.op_type])(x, y), ins[6], ins[7])


@onnx_op(MS + "QLinearGlobalAveragePool", MS + "QLinearAveragePool", MS + "QLinearSigmoid",
         MS + "QLinearLeakyRelu")
def _qlinear_unary(b, node, ins, attrs):
    """The float op (its handler's, by the name without QLinear) of the dequantized input."""
    if attrs.pop("channels_last", 0):
        raise Refuse("channels_last=1 is not supported")
    op = node.op_type.removeprefix("QLinear")
    x = b.device(_dequantized(b, ins[0:3]))
    return _requantized(b, HANDLERS[op](b, _StandIn(op), [x], attrs), ins[3], ins[4])


@onnx_op(MS + "QLinearConcat")
def _qlinear_concat(b, node, ins, attrs):
    """Y_scale, Y_zero_point, then (x, scale, zero point) for each input."""
    parts = [b.device(_dequantized(b, ins[k:k + 3])) for k in range(2, len(ins), 3)]
    return _requantized(b, b.g.concat(parts, int(attrs["axis"])), ins[0], ins[1])


def _unpacked(packed: np.ndarray, bits: int) -> np.ndarray:
    """Each row of uint8 bytes as the `bits`-bit unsigned values packed in it, the first in the
    lowest bits of the first byte (onnxruntime's MatMulNBits layout)."""
    stream = np.unpackbits(packed, axis=-1, bitorder="little")
    count = stream.shape[-1] // bits
    fields = stream[..., :count * bits].reshape(*packed.shape[:-1], count, bits)
    return fields.astype(np.int64) @ (1 << np.arange(bits, dtype=np.int64))


@onnx_op(MS + "MatMulNBits")
def _matmul_nbits(b, node, ins, attrs):
    """A @ W + bias for W (K, N) quantized block-wise along K to `bits` bits (int4 weights of
    onnxruntime's MatMulNBitsQuantizer, onnxruntime-genai's models): W dequantized at import,
    a constant (weights of that form do not train)."""
    ins = [*ins, None, None, None][:6]
    if ins[4] is not None or attrs.get("weight_prepacked", 0):
        raise Refuse("g_idx (act-order) and prepacked weights are not supported")
    depth, width = int(attrs["K"]), int(attrs["N"])
    bits, block = int(attrs.get("bits", 4)), int(attrs["block_size"])
    blocks = -(-depth // block)
    packed = np.asarray(b.host(ins[1], "packed weights"), np.uint8).reshape(width, -1)
    if packed.size == 0:
        raise Refuse("an omitted projection (empty packed weights) is not supported")
    q = _unpacked(packed, bits)[:, :blocks * block].reshape(width, blocks, block)
    scales = np.asarray(b.host(ins[2], "scales"), np.float32).reshape(width, blocks)
    zero = ins[3]
    if zero is None:
        zero = np.full((width, blocks), 1 << (bits - 1), np.float32)
    elif np.asarray(b.host(zero, "zero points")).dtype == np.uint8:
        packed_zero = np.asarray(b.host(zero, "zero points")).reshape(width, -1)
        zero = _unpacked(packed_zero, bits)[:, :blocks].astype(np.float32)
    else:
        zero = np.asarray(b.host(zero, "zero points"), np.float32).reshape(width, blocks)
    weight = ((q - zero[..., None]) * scales[..., None]).reshape(width, -1)[:, :depth]
    y = matmul(b.g, b.device(ins[0]), b.device(weight.astype(np.float32)), transpose_b=True)
    return y if ins[5] is None else _plus_bias(b, y, ins[5])


@onnx_op(MS + "RotaryEmbedding")
def _ms_rotary_embedding(b, node, ins, attrs):
    """onnxruntime's RoPE as ONNX's (opset 23) computes it: its inputs in another order, and
    position_ids of one element the offset of positions 0, 1, ...; heads of a 3-D input from
    the caches' width where num_heads is not given."""
    if attrs.get("is_packed_batching", 0) or float(attrs.get("scale", 1.0)) != 1.0:
        raise Refuse("is_packed_batching and a scale other than 1 are not supported")
    g, x = b.g, b.device(ins[0])
    ids, cos, sin = ins[1:4]
    length = x.shape[-2] if len(x.shape) == 4 else x.shape[1]
    if np.prod(ids.shape if isinstance(ids, Tensor) else np.shape(ids)) == 1:
        steps = np.arange(length, dtype=np.int32).reshape(1, length)
        ids = (steps + int(np.asarray(b.host(ids, "position offset")).reshape(()))
               if not isinstance(ids, Tensor) else
               g.add(g.constant(steps, "i32"), g.reshape(g.cast(ids, "i32"), (1, 1))))
    attrs = dict(attrs)
    if len(x.shape) == 3 and not attrs.get("num_heads"):
        width = int(attrs.get("rotary_embedding_dim", 0)) or 2 * np.shape(b.host(cos, "cache"))[1]
        attrs["num_heads"] = x.shape[2] // width
    return _rotary_embedding(b, node, [x, cos, sin, ids], attrs)
