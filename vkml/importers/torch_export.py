"""The PyTorch front end: a torch.nn.Module, through torch.export, -> a vkml Graph.

`torch.export.export(module, args, kwargs)` gives an ATen program at fixed shapes; its
decompositions then run for every op but those mapped here directly (aten.linear, layer_norm,
scaled_dot_product_attention, gelu, batch_norm, conv2d, ...: vkml has them whole). Parameters
become graph parameters under their state_dict names, float buffers frozen parameters (batch-norm
running statistics), integer buffers and lifted constants host values. Every node whose inputs
are all known at import (shape and mask arithmetic on constants) is computed there by PyTorch
itself and becomes a constant.

`training=True` keeps the mode the module was exported in: a module in train() mode gets live
dropout and batch norm over the batch's statistics (running statistics are not updated: the
graph has no state writes); `training=False` computes the inference forms (dropout the identity,
batch norm from the running statistics) whatever the module's mode.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from vkml.errors import ModelImportError
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
)

Value = Any  # a vkml Tensor, a torch tensor known at import, a number, a list, a tuple or None


def _torch():
    try:
        import torch
    except ImportError as e:
        raise ModelImportError("vkml.import_torch needs PyTorch (pip install torch)") from e
    return torch


def import_torch(module: Any, args: tuple = (), kwargs: dict | None = None,
                 training: bool = False, seed: int = 0) -> ImportedModel:
    """Import `module` called on `args` / `kwargs` (example tensors: their shapes and dtypes
    are the graph's inputs'). Raises ModelImportError listing every op it cannot import."""
    torch = _torch()
    with torch.set_grad_enabled(torch.is_grad_enabled()):
        return _import(torch, module, args, kwargs, training, seed)


def _import(torch: Any, module: Any, args: tuple, kwargs: dict | None, training: bool,
            seed: int) -> ImportedModel:
    """import_torch's work; the caller restores PyTorch's grad mode, which exporting
    a model must not change for the user's code that runs after."""
    name = type(module).__name__
    try:
        program = torch.export.export(module, tuple(args), kwargs or {})
    except Exception as e:
        hint = ("; a Hugging Face model returns its key/value cache unless built with "
                "use_cache=False (config.use_cache = False)" if "Cache" in str(e) else "")
        raise ModelImportError(f"torch.export could not export {name}: {type(e).__name__}: "
                               f"{e}{hint}") from e
    if _needs_decompositions(program, torch._ops):
        table = torch.export.default_decompositions()
        for op in list(table):
            if _key(op) in KEPT:
                del table[op]
        program = program.run_decompositions(table)
    refusals = Refusals(f"{name} (torch.export)")
    builder = _Builder(torch, program, training, refusals, seed)
    builder.run()
    refusals.check()
    state = module.state_dict()
    snapshot = {k: v.detach().clone() for k, v in state.items()}
    # per-module versions that load_state_dict hands to modules which read them (MNASNet
    # refuses a state dict without its version)
    return builder.result(name, snapshot, getattr(state, "_metadata", None))


def _needs_decompositions(program: Any, torch_ops: Any) -> bool:
    """Whether the exported program computes ops the table lacks, or writes in place into a
    value something else could read (the decompositions make such programs functional).
    They cost more than the rest of an import (4.8 of 8.3 s for regnet_y_400mf), so a program
    of known ops skips them (ops on values known at import, such as a mask's arithmetic, are
    computed by PyTorch, whatever they are); an in-place op that alone reads a value no view
    shares (a ReLU(inplace=True) after a convolution) computes what its functional form does.
    A higher-order op (a `torch.no_grad()` or `torch.autocast(enabled=False)` block, as in
    Hugging Face's rotary embeddings) holds a subgraph that only the decompositions inline,
    wherever it reads from."""
    if any(node.op == "call_function" and isinstance(node.target, torch_ops.HigherOrderOperator)
           for node in program.graph.nodes):
        return True
    for node in _computed_on_device(program):
        if _key(node.target) not in ATEN and _key(node.target) not in FOLD_ONLY:
            return True
        if _in_place(node.target):
            written = node.args[0]
            if (getattr(written, "op", None) != "call_function" or len(written.users) != 1
                    or _key(written.target) in VIEWS):
                return True
    return False


def _computed_on_device(program: Any) -> list[Any]:
    """The call nodes that read, through any chain, an input, a parameter or a persistent
    float buffer: those the graph computes (the others are computed at import)."""
    sig = program.graph_signature
    device = {spec.arg.name for spec in sig.input_specs
              if spec.kind.name in ("USER_INPUT", "PARAMETER")
              or (spec.kind.name == "BUFFER" and spec.target in program.state_dict
                  and program.state_dict[spec.target].is_floating_point())}
    found = []
    for node in program.graph.nodes:
        if node.op == "call_function" and (
                _key(node.target) in NOT_FOLDED
                or any(a.name in device for a in node.all_input_nodes)):
            device.add(node.name)
            found.append(node)
    return found


def _in_place(target: Any) -> bool:
    """Whether the op writes into its first argument (add_, copy_, fill_)."""
    packet = getattr(target, "overloadpacket", None)
    return packet is not None and packet.__name__.endswith("_") and not \
        packet.__name__.endswith("__")


def _written_base(node: Any) -> Any:
    """The value an in-place op's first argument views (through slices, selects, ...)."""
    while getattr(node, "op", None) == "call_function" and _key(node.target) in VIEWS:
        node = node.args[0]
    return node


def _key(target: Any) -> str:
    """'linear' for torch.ops.aten.linear.default; 'getitem' for operator.getitem."""
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__.removesuffix("_")  # in-place spellings as their functional form
    return getattr(target, "__name__", str(target))


class _Builder:
    def __init__(self, torch, program, training: bool, refusals: Refusals, seed: int) -> None:
        self.torch, self.program, self.training, self.refusals = torch, program, training, refusals
        self.g = Graph(seed=seed)
        self.env: dict[str, Value] = {}
        self.poisoned: set[str] = set()
        self.inputs: dict[str, Tensor] = {}
        self.outputs: dict[str, Tensor] = {}
        self.params: dict[str, str] = {}
        self.frozen: list[str] = []
        # tied parameters (an LM head sharing the embedding's tensor) are one graph parameter,
        # under the name met first; the other names alias it
        self.tied: dict[str, str] = {}
        self._storage: dict[tuple, str] = {}
        self.node: Any = None  # the node being converted

    # -- values ----
    def device(self, value: Value) -> Tensor:
        if isinstance(value, Tensor):
            return value
        if isinstance(value, (int, float, bool)):
            return self.g.constant(float(value))
        if isinstance(value, self.torch.Tensor):
            array = value.detach().cpu().numpy()
            if array.dtype == np.bool_:  # vkml's booleans are f32 masks
                return self.g.constant(array.astype(np.float32))
            if array.dtype.kind in "iu":
                return self.g.constant(array, "i32")
            return self.g.constant(array.astype(np.float32))
        raise Refuse(f"expected a tensor, got {type(value).__name__}")

    def operand(self, value: Value) -> Tensor | float:
        if isinstance(value, (int, float, bool)):
            return float(value)
        if isinstance(value, self.torch.Tensor) and value.dim() == 0:
            return float(value)
        return self.device(value)

    def known(self, value: Value) -> bool:
        if isinstance(value, (Tensor, Complex)):
            return False
        if isinstance(value, (list, tuple)):
            return all(self.known(v) for v in value)
        return True

    # -- walking the program ----
    def run(self) -> None:
        sig = self.program.graph_signature
        state = {**self.program.state_dict, **self.program.constants}
        params = dict(sig.inputs_to_parameters)
        buffers = dict(sig.inputs_to_buffers)
        constants = dict(sig.inputs_to_lifted_tensor_constants)
        needed = self._needed()
        composites = patterns.match_fx(self.program.graph.nodes)
        for node in self.program.graph.nodes:
            if node.op == "placeholder":
                self._placeholder(node, params, buffers, constants, state)
            elif node.name in composites and not any(
                    a.name in self.poisoned for a in node.all_input_nodes):
                value = convert_guarded(self.refusals, node.name, "pattern",
                                        lambda f=composites[node.name]: f(self))
                if value is None:
                    self.poisoned.add(node.name)
                self.env[node.name] = value
            elif node.op == "call_function" and node.name in needed:
                self._call(node)
            elif node.op == "output":
                self._outputs(node)

    def _needed(self) -> set[str]:
        """The nodes the user's outputs depend on: not the running-statistics updates that a
        train-mode program also returns (vkml does not update them)."""
        sig = self.program.graph_signature
        user = {spec.arg.name for spec in sig.output_specs if spec.kind.name == "USER_OUTPUT"}
        by_name = {n.name: n for n in self.program.graph.nodes}
        needed: set[str] = set()

        def need(stack: list) -> None:
            while stack:
                node = stack.pop()
                if node.name not in needed:
                    needed.add(node.name)
                    stack.extend(node.all_input_nodes)
        need([by_name[n] for n in user if n in by_name])
        # A write into a needed value, whose own result nothing reads (BEiT fills its relative
        # position index into a zeros tensor in place, slice by slice), is needed too: the
        # value read after it is the written one.
        writes = [n for n in self.program.graph.nodes
                  if n.op == "call_function" and _in_place(n.target)]
        grown = True
        while grown:
            grown = False
            for node in writes:
                if node.name not in needed and _written_base(node.args[0]).name in needed:
                    need([node])
                    grown = True
        return needed

    def _placeholder(self, node, params, buffers, constants, state) -> None:
        name = node.name
        if name in params or (name in buffers and buffers[name] in self.program.state_dict):
            target = params.get(name) or buffers[name]
            tensor = state[target]
            value = tensor.detach().cpu()
            storage = (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.stride())
            if value.is_floating_point() and storage in self._storage:
                first = self._storage[storage]
                self.tied[target] = first
                self.env[name] = self.g.params[first]
            elif value.is_floating_point():
                # torch.optim updates what requires a gradient (Whisper's positional table
                # does not): the others are frozen
                trainable = name in params and tensor.requires_grad
                self.env[name] = self.g.param(target, tuple(value.shape),
                                              value.float().numpy(), trainable=trainable)
                self.params[target] = target
                self._storage[storage] = target
                if not trainable:
                    self.frozen.append(target)
            else:
                self.env[name] = value
        elif name in constants or name in buffers:  # lifted constants, non-persistent buffers
            self.env[name] = state[constants.get(name) or buffers[name]].detach().cpu()
        else:
            meta = node.meta.get("val")
            if meta is None or not isinstance(meta, self.torch.Tensor):
                self.refusals.refuse(name, "input", "inputs other than tensors are not "
                                     "supported (pass numbers as constants in the module)")
                self.poisoned.add(name)
                return
            dtype = "f32" if meta.is_floating_point() else "i32"
            self.env[name] = self.inputs[name] = self.g.input(name, tuple(meta.shape), dtype)

    def _call(self, node) -> None:
        key = _key(node.target)
        name = node.name
        flat = [a for a in node.all_input_nodes]
        if any(a.name in self.poisoned for a in flat):
            if key not in ATEN and key not in FOLD_ONLY:
                self.refusals.unsupported(f"aten.{key}", name, DATA_DEPENDENT.get(key, ""))
            self.poisoned.add(name)
            return
        args = self._map(node.args)
        kwargs = self._map(node.kwargs)
        self.node = node
        if self.known((args, list(kwargs.values()))) and key not in NOT_FOLDED:
            out = convert_guarded(self.refusals, name, f"aten.{key}",
                                  lambda: node.target(*args, **kwargs))
        elif key in ATEN:
            out = convert_guarded(self.refusals, name, f"aten.{key}",
                                  lambda: ATEN[key](self, *args, **kwargs))
        else:
            self.refusals.unsupported(f"aten.{key}", name, DATA_DEPENDENT.get(key, ""))
            out = None
        if out is None and key not in IGNORED:
            self.poisoned.add(name)
        else:
            self.env[name] = out

    def _map(self, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(self._map(v) for v in value)
        if isinstance(value, dict):
            return {k: self._map(v) for k, v in value.items()}
        if hasattr(value, "op") and hasattr(value, "name") and hasattr(value, "meta"):
            return self.env.get(value.name)
        return value

    def _outputs(self, node) -> None:
        sig = self.program.graph_signature
        user = [spec.arg.name for spec in sig.output_specs
                if spec.kind.name == "USER_OUTPUT"]
        names = _output_names(self.program.call_spec.out_spec, len(user))
        for out_name, node_name in zip(names, user):
            if node_name in self.poisoned:
                continue
            value = self.env.get(node_name)
            tensor = convert_guarded(self.refusals, node_name, "output",
                                     lambda v=value: self.device(v))
            if tensor is not None:
                self.outputs[out_name] = self.g.output(out_name, tensor)

    def result(self, name: str, snapshot: dict, metadata: Any = None) -> ImportedModel:
        torch = self.torch

        def state_dict(values: dict[str, np.ndarray]) -> dict[str, Any]:
            out: dict[str, Any] = OrderedDict()
            if metadata is not None:
                out._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
            for key, original in snapshot.items():
                key_in_graph = self.tied.get(key, key)
                if key_in_graph in values:
                    out[key] = torch.from_numpy(np.array(values[key_in_graph])).to(
                        original.dtype)
                else:
                    out[key] = original.clone()
            return out

        return ImportedModel(self.g, dict(self.inputs), dict(self.outputs),
                             f"{name} (torch.export)", params=dict(self.params),
                             frozen=tuple(self.frozen), _state_dict=state_dict)


def _output_names(spec, count: int) -> list[str]:
    """The outputs' names: a dict's (or a Hugging Face ModelOutput's) keys, "output" for one
    tensor, "output_0", "output_1", ... otherwise."""
    context = getattr(spec, "context", None)
    if isinstance(context, (list, tuple)) and len(context) == count and all(
            isinstance(k, str) for k in context):
        return list(context)
    if count == 1:
        return ["output"]
    return [f"output_{i}" for i in range(count)]


# ---- the op table ------------------------------------------------------------------------------
Handler = Callable[..., Any]
ATEN: dict[str, Handler] = {}
# Run by PyTorch at import when their inputs are known, refused otherwise by name.
FOLD_ONLY = {"arange", "full", "zeros", "ones", "empty", "scalar_tensor", "lift_fresh_copy"}
NOT_FOLDED = {"native_dropout", "dropout", "rand", "randn", "bernoulli", "rand_like",
              "randn_like"}
IGNORED = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size"}
# Ops whose output's shape depends on the values of their input: a static graph holds them only
# where those values are known at import (then PyTorch computes them there).
DATA_DEPENDENT = {
    "nonzero": "its output's length is the number of non-zero elements, known only at run time",
    "masked_select": "its output's length is the number of selected elements",
    "unique": "its output's length depends on the data",
    "_unique2": "its output's length depends on the data",
    "unique_consecutive": "its output's length depends on the data",
    "unique_dim": "its output's length depends on the data",
    "repeat_interleave": "with repeats computed at run time its output's length depends on them",
    "_grouped_mm": "a mixture of experts' grouped matmul: each group's rows are the tokens "
                   "routed to it, counted at run time",
    "grouped_mm_fallback": "a mixture of experts' grouped matmul: each group's rows are the "
                           "tokens routed to it, counted at run time",
}
# Ops whose result shares its input's storage: writing into it in place writes the input too.
VIEWS = {"view", "reshape", "_unsafe_view", "select", "slice", "transpose", "permute", "t",
         "expand", "unsqueeze", "squeeze", "alias", "as_strided", "diagonal", "narrow",
         "unflatten", "flatten", "split", "split_with_sizes", "chunk", "unbind", "detach"}
# Ops mapped whole, kept out of the decompositions (vkml has them as one op or composition).
KEPT = {"linear", "layer_norm", "scaled_dot_product_attention", "gelu", "silu", "batch_norm",
        "conv3d", "conv2d", "conv1d", "conv_transpose2d", "group_norm", "rms_norm", "softmax",
        "log_softmax", "hardswish", "hardsigmoid", "matmul", "embedding", "dropout",
        "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "instance_norm",
        "einsum", "leaky_relu", "elu", "mish", "softplus", "col2im"}


def aten(*names: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        for n in names:
            ATEN[n] = fn
        return fn
    return register


def _tensor(b: _Builder, v: Value | None) -> Tensor | None:
    return None if v is None else b.device(v)


@aten(*IGNORED)
def _ignored(b, *args, **kwargs):
    return None


@aten("getitem")
def _getitem(b, seq, index):
    out = seq[index]
    if out is None:
        raise Refuse("reads an output vkml does not compute (e.g. batch-norm statistics)")
    return out


@aten("detach")
def _detach(b, x):
    x = b.device(x)
    return b.g.stop_gradient(x) if x.dtype == "f32" else x


@aten("clone", "contiguous", "alias", "lift_fresh_copy", "_to_copy", "to",
      "_unsafe_view_copy")
def _identity(b, x, *args, **kwargs):
    dtype = kwargs.get("dtype")
    if dtype is None and args and isinstance(args[0], b.torch.dtype):
        dtype = args[0]
    if dtype is not None and dtype.is_complex:
        return x if isinstance(x, Complex) else Complex(b.device(x), None)
    return x if dtype is None else cast(b, x, dtype)


@aten("copy")
def _copy(b, x, src, non_blocking=False):
    """x.copy_(src) made functional (an assignment into a slice, `x[1::3] = y`): src
    broadcast to x's shape, in x's dtype."""
    x, src = b.device(x), b.device(src)
    if src.dtype != x.dtype:
        src = b.g.cast(src, x.dtype)
    return src if src.shape == x.shape else b.g.expand(src, x.shape)


@dataclass(frozen=True)
class Complex:
    """A complex tensor (torch.fft's) as its real and imaginary parts, the imaginary None
    while it is zero (a real tensor cast to complex). Only the FFTs and view_as_real read
    one: any other op on it is refused, as it expects a tensor."""

    real: Tensor
    imag: Tensor | None

    def pairs(self, g: Graph) -> Tensor:
        """(..., 2): real and imaginary parts last, as view_as_real and ONNX's DFT lay them."""
        parts = [self.real] if self.imag is None else [self.real, self.imag]
        return g.concat([g.reshape(v, (*v.shape, 1)) for v in parts], len(self.real.shape))


def _fft(b, z: Complex, dims, normalization: int, forward: bool, onesided: bool = False):
    """torch's FFTs over `dims` (normalization 0: none, 1: 1/sqrt(n), 2: 1/n), each axis the
    products with cosine and sine matrices of ONNX's DFT (importers/common.fourier); a
    one-sided transform keeps the last axis's non-negative frequencies."""
    g, x = b.g, z.pairs(b.g)
    dims = [d % len(z.real.shape) for d in dims]
    scale = 1.0
    for k, axis in enumerate(dims):
        n = x.shape[axis]
        x = fourier(g, x, axis, n, not forward, onesided and k == len(dims) - 1)
        implied = 1.0 if forward else 1.0 / n  # fourier's inverse divides by n
        scale *= [1.0, 1.0 / math.sqrt(n), 1.0 / n][int(normalization)] / implied
    if scale != 1.0:
        x = g.mul(x, scale)
    last = len(x.shape) - 1
    return Complex(*(g.reshape(g.slice(x, last, k, k + 1), x.shape[:-1]) for k in (0, 1)))


@aten("_fft_c2c")
def _fft_c2c(b, z, dims, normalization, forward):
    return _fft(b, _complex(b, z), dims, normalization, forward)


@aten("_fft_r2c")
def _fft_r2c(b, x, dims, normalization, onesided):
    return _fft(b, Complex(b.device(x), None), dims, normalization, True, bool(onesided))


@aten("view_as_real")
def _view_as_real(b, z):
    z = _complex(b, z)
    return Complex(z.real, z.imag if z.imag is not None else b.g.mul(z.real, 0.0)).pairs(b.g)


@aten("real")
def _real(b, z):
    return _complex(b, z).real


@aten("imag")
def _imag(b, z):
    z = _complex(b, z)
    return z.imag if z.imag is not None else b.g.mul(z.real, 0.0)


@aten("_conj", "conj", "conj_physical")
def _conj(b, z):
    """The complex conjugate (a real value's is itself)."""
    if not isinstance(z, Complex) or z.imag is None:
        return z
    return Complex(z.real, b.g.neg(z.imag))


@aten("_neg_view")
def _neg_view(b, z):
    if not isinstance(z, Complex):
        return b.g.neg(b.device(z))
    return Complex(b.g.neg(z.real), None if z.imag is None else b.g.neg(z.imag))


@aten("resolve_conj", "resolve_neg")
def _resolved(b, z):
    return z


def _complex(b, z) -> Complex:
    return z if isinstance(z, Complex) else Complex(b.device(z), None)


@aten("as_strided")
def _as_strided(b, x, size, stride, offset=None):
    """torch.as_strided of a contiguous value: the elements it reads from x's storage, one
    gather at their constant flat positions (a reshape where those are x's own order);
    overlapping windows read an element more than once, and its gradient sums them."""
    x = b.device(x)
    meta = b.node.args[0].meta.get("val") if b.node is not None else None
    if meta is None or not meta.is_contiguous() or meta.storage_offset():
        raise Refuse("as_strided of a view that is not contiguous: which elements it reads "
                     "depends on that view's storage")
    at = np.full([int(n) for n in size], int(offset or 0), np.int64)
    for axis, (n, step) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[axis] = int(n)
        at = at + np.arange(int(n)).reshape(shape) * int(step)
    if at.size and (at.min() < 0 or at.max() >= x.size):
        raise Refuse(f"as_strided reads past its input's {x.size} elements")
    flat = b.g.reshape(x, (x.size,))
    if np.array_equal(at.reshape(-1), np.arange(x.size)):
        return b.g.reshape(flat, tuple(at.shape))
    return b.g.gather(flat, b.g.constant(at.astype(np.int32), "i32"), 0)


def cast(b: _Builder, x: Tensor, dtype: Any) -> Tensor:
    """`x` as `dtype`: floats f32, integers i32, booleans an f32 mask (as comparisons give)."""
    if dtype == b.torch.bool:
        return b.g.not_equal(x, 0 if x.dtype == "i32" else 0.0)
    return b.g.cast(x, "f32" if dtype.is_floating_point else "i32")


@aten("type_as")
def _type_as(b, x, other):
    if isinstance(other, Tensor):
        return b.g.cast(b.device(x), other.dtype)
    return cast(b, b.device(x), other.dtype)


@aten("linear")
def _linear(b, x, w, bias=None):
    return linear(b.g, b.device(x), b.device(w), _tensor(b, bias))


def linear(g: Graph, x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear as vkml.nn.Linear computes it (leading axes flattened into one product)."""
    lead = x.shape[:-1]
    flat = g.reshape(x, (-1, x.shape[-1])) if len(lead) != 1 else x
    y = g.matmul(flat, w, transpose_b=True)
    if bias is not None:
        y = g.bias_add(y, bias)
    return g.reshape(y, (*lead, w.shape[0])) if len(lead) != 1 else y


@aten("addmm")
def _addmm(b, bias, x, w, beta=1, alpha=1):
    g = b.g
    y = g.matmul(b.device(x), b.device(w))
    if alpha != 1:
        y = g.mul(y, float(alpha))
    c = b.device(bias)
    if beta != 1:
        c = g.mul(c, float(beta))
    return g.bias_add(y, c) if c.shape == y.shape[-1:] else g.add(y, c)


@aten("mm", "bmm", "matmul")
def _matmul(b, x, w):
    x, w = b.device(x), b.device(w)
    return patterns.attention_of(b.g, x, w) or matmul(b.g, x, w)


@aten("t")
def _t(b, x):
    x = b.device(x)
    return b.g.transpose(x) if len(x.shape) == 2 else x


@aten("numpy_T")
def _numpy_t(b, x):
    """x.T: every axis reversed."""
    x = b.device(x)
    return b.g.transpose(x, list(reversed(range(len(x.shape))))) if len(x.shape) > 1 else x


@aten("permute")
def _permute(b, x, dims):
    x = b.device(x)
    dims = [d % len(x.shape) for d in dims]
    return x if dims == sorted(dims) else b.g.transpose(x, dims)


@aten("transpose", "swapaxes", "swapdims")
def _transpose(b, x, d0, d1):
    x = b.device(x)
    perm = list(range(len(x.shape)))
    d0, d1 = d0 % len(perm), d1 % len(perm)
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return x if d0 == d1 else b.g.transpose(x, perm)


@aten("view", "reshape", "_unsafe_view")
def _view(b, x, shape):
    return b.g.reshape(b.device(x), [int(d) for d in shape])


@aten("expand")
def _expand(b, x, shape, implicit=False):
    return b.g.expand(b.device(x), [int(d) for d in shape])


@aten("expand_as")
def _expand_as(b, x, other):
    return b.g.expand(b.device(x), list(b.device(other).shape))


@aten("repeat")
def _repeat(b, x, repeats):
    return b.g.tile(b.device(x), [int(r) for r in repeats])


@aten("unsqueeze")
def _unsqueeze(b, x, dim):
    x = b.device(x)
    dim %= len(x.shape) + 1
    return b.g.reshape(x, (*x.shape[:dim], 1, *x.shape[dim:]))


@aten("squeeze")
def _squeeze(b, x, dims=None):
    x = b.device(x)
    if dims is None:
        dims = [a for a, d in enumerate(x.shape) if d == 1]
    dims = {d % len(x.shape) for d in ([dims] if isinstance(dims, int) else dims)}
    return b.g.reshape(x, [d for a, d in enumerate(x.shape) if not (a in dims and d == 1)])


@aten("flatten")
def _flatten(b, x, start=0, end=-1):
    x = b.device(x)
    start, end = start % len(x.shape), end % len(x.shape)
    return b.g.reshape(x, (*x.shape[:start], math.prod(x.shape[start:end + 1]),
                           *x.shape[end + 1:]))


@aten("cat", "concat")
def _cat(b, xs, dim=0):
    xs = [b.device(x) for x in xs if not (hasattr(x, "numel") and x.numel() == 0)]
    axis = dim % len(xs[0].shape)
    x = patterns.rotate_half_of(xs, axis)
    return b.g.rotate_half(x) if x is not None else b.g.concat(xs, axis)


@aten("split", "split_with_sizes")
def _split(b, x, sizes, dim=0):
    x = b.device(x)
    return b.g.split(x, sizes, dim % len(x.shape))


@aten("chunk")
def _chunk(b, x, chunks, dim=0):
    """torch.chunk: pieces of ceil(n / chunks), the last one shorter (fewer pieces where
    they run out)."""
    x = b.device(x)
    axis = dim % len(x.shape)
    n = x.shape[axis]
    size = -(-n // int(chunks))
    sizes = [min(size, n - start) for start in range(0, n, size)]
    return b.g.split(x, sizes, axis) if len(sizes) > 1 else [x]


@aten("stack")
def _stack(b, xs, dim=0):
    xs = [b.device(x) for x in xs]
    axis = dim % (len(xs[0].shape) + 1)
    return b.g.concat([b.g.reshape(x, (*x.shape[:axis], 1, *x.shape[axis:])) for x in xs],
                      axis)


@aten("slice")
def _slice(b, x, dim=0, start=None, end=None, step=1):
    x = b.device(x)
    return slice_along(b.g, x, dim % len(x.shape), start, end, step)


@aten("select")
def _select(b, x, dim, index):
    x = b.device(x)
    dim %= len(x.shape)
    index %= x.shape[dim]
    y = b.g.slice(x, dim, index, index + 1) if x.shape[dim] > 1 else x
    return b.g.reshape(y, x.shape[:dim] + x.shape[dim + 1:])


@aten("index_select")
def _index_select(b, x, dim, index):
    x = b.device(x)
    return b.g.index_select(x, dim % len(x.shape), b.device(index))


@aten("gather")
def _gather(b, x, dim, index, sparse_grad=False):
    x = b.device(x)
    return b.g.gather_elements(x, b.device(index), dim % len(x.shape))


@aten("embedding")
def _embedding(b, weight, ids, padding_idx=-1, scale_grad=False, sparse=False):
    return b.g.embedding(b.device(ids), b.device(weight))


BINARY = {"add": "add", "sub": "sub", "mul": "mul", "div": "div"}


def _make_binary(name: str) -> Handler:
    def handler(b, x, y, alpha=1, rounding_mode=None):
        if rounding_mode is not None:
            return _rounded_division(b, x, y, rounding_mode)
        if alpha != 1:
            y = b.g.mul(b.device(y), float(alpha)) if not isinstance(y, (int, float)) \
                else y * alpha
        return getattr(b.g, BINARY[name])(b.operand(x), b.operand(y))
    return handler


for _name in BINARY:
    ATEN[_name] = _make_binary(_name)


def _rounded_division(b, x, y, mode: str) -> Tensor:
    """torch.div with rounding_mode 'floor' (a // b) or 'trunc': integers by vkml's integer
    divisions, floats as the quotient rounded down, or toward zero."""
    if mode not in ("floor", "trunc"):
        raise Refuse(f"division with rounding_mode={mode!r} is not supported")
    integers = any(isinstance(v, Tensor) and v.dtype == "i32" for v in (x, y))
    x, y = (b.g.constant(np.asarray(v, np.int32), "i32") if integers and isinstance(v, int)
            else b.device(v) for v in (x, y))
    if x.dtype == "i32" and y.dtype == "i32":
        return (b.g.floor_divide if mode == "floor" else b.g.trunc_divide)(x, y)
    quotient = b.g.div(b.g.cast(x, "f32") if x.dtype != "f32" else x,
                       b.g.cast(y, "f32") if y.dtype != "f32" else y)
    if mode == "floor":
        return b.g.floor(quotient)
    return b.g.where(b.g.less(quotient, 0.0), b.g.ceil(quotient), b.g.floor(quotient))


ATEN["floor_divide"] = lambda b, x, y: _rounded_division(b, x, y, "floor")


@aten("rsub")
def _rsub(b, x, y, alpha=1):
    return ATEN["sub"](b, y, x, alpha)


UNARY = {"isnan": "isnan", "isinf": "isinf", "logical_not": "logical_not",
         "bitwise_not": "logical_not", "relu": "relu", "sigmoid": "sigmoid", "tanh": "tanh",
         "exp": "exp", "log": "log",
         "neg": "neg", "sqrt": "sqrt", "rsqrt": "rsqrt", "abs": "abs", "erf": "erf",
         "silu": "silu", "sin": "sin", "cos": "cos", "reciprocal": "reciprocal",
         "hardswish": "hardswish", "hardsigmoid": "hardsigmoid", "floor": "floor",
         "ceil": "ceil", "round": "round", "sign": "sign", "mish": "mish", "log1p": "log1p",
         "expm1": "expm1", "square": "square"}


def _make_unary(name: str) -> Handler:
    def handler(b, x):
        return getattr(b.g, UNARY[name])(b.device(x))
    return handler


for _name in UNARY:
    ATEN[_name] = _make_unary(_name)


@aten("gelu")
def _gelu(b, x, approximate="none"):
    return b.g.gelu(b.device(x), approximate)


@aten("leaky_relu")
def _leaky_relu(b, x, slope=0.01):
    return b.g.leaky_relu(b.device(x), float(slope))


@aten("elu")
def _elu(b, x, alpha=1.0, scale=1.0, input_scale=1.0):
    if scale != 1.0 or input_scale != 1.0:
        raise Refuse("elu with a scale is not supported")
    return b.g.elu(b.device(x), float(alpha))


@aten("softplus")
def _softplus(b, x, beta=1.0, threshold=20.0):
    return b.g.softplus(b.device(x), float(beta), float(threshold))


@aten("clamp")
def _clamp(b, x, low=None, high=None):
    return b.g.clamp(b.device(x), low, high)


ATEN["clamp_min"] = lambda b, x, low: _clamp(b, x, low, None)
ATEN["clamp_max"] = lambda b, x, high: _clamp(b, x, None, high)


@aten("hardtanh")
def _hardtanh(b, x, low=-1.0, high=1.0):
    return b.g.hardtanh(b.device(x), float(low), float(high))


@aten("pow")
def _pow(b, x, e):
    if isinstance(e, (int, float)) and not isinstance(x, (int, float)):
        return power(b.g, b.device(x), float(e))
    return b.g.pow(b.operand(x), b.operand(e))


def _make_extremum(name: str) -> Handler:
    def handler(b, x, y):
        return getattr(b.g, name)(b.operand(x), b.operand(y))
    return handler


for _name in ("maximum", "minimum"):
    ATEN[_name] = _make_extremum(_name)


# booleans are f32 masks in vkml, so the bitwise ops of torch's booleans are the logical ones
PREDICATES = {"eq": "equal", "ne": "not_equal", "lt": "less", "le": "less_equal",
              "gt": "greater", "ge": "greater_equal", "logical_and": "logical_and",
              "logical_or": "logical_or", "logical_xor": "logical_xor",
              "bitwise_and": "logical_and", "bitwise_or": "logical_or",
              "bitwise_xor": "logical_xor", "__and__": "logical_and", "__or__": "logical_or",
              "__xor__": "logical_xor"}


def _make_predicate(name: str) -> Handler:
    def handler(b, x, y):
        if isinstance(x, Tensor) or not isinstance(y, Tensor):
            return getattr(b.g, PREDICATES[name])(b.device(x), b.operand(y))
        return getattr(b.g, PREDICATES[name])(b.operand(x), b.device(y))
    return handler


for _name in PREDICATES:
    ATEN[_name] = _make_predicate(_name)


@aten("where")
def _where(b, cond, x, y):
    return b.g.where(b.device(cond), b.operand(x), b.operand(y))


@aten("masked_fill")
def _masked_fill(b, x, mask, value):
    return b.g.where(b.device(mask), b.operand(value), b.device(x))


def _dims(x: Tensor, dims) -> list[int] | None:
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return None
    return [d % len(x.shape) for d in ([dims] if isinstance(dims, int) else dims)]


def _make_reduce(name: str) -> Handler:
    def handler(b, x, dims=None, keepdim=False, dtype=None):
        x = b.device(x)
        return getattr(b.g, name)(x, _dims(x, dims), keepdims=bool(keepdim))
    return handler


for _name in ("mean", "sum", "amax", "amin"):
    ATEN[_name] = _make_reduce(_name)


def _make_arg(name: str) -> Handler:
    def handler(b, x, dim=None, keepdim=False):
        x = b.device(x)
        if dim is None:
            x, dim = b.g.reshape(x, (x.size,)), 0
        return getattr(b.g, name)(x, dim, bool(keepdim))
    return handler


for _name in ("argmax", "argmin"):
    ATEN[_name] = _make_arg(_name)


@aten("logsumexp")
def _logsumexp(b, x, dims, keepdim=False):
    x = b.device(x)
    return b.g.logsumexp(x, _dims(x, dims), keepdims=bool(keepdim))


def _make_var(root: bool) -> Handler:
    def handler(b, x, dims=None, *args, correction=None, keepdim=False, unbiased=None):
        x = b.device(x)
        axes = _dims(x, dims) or list(range(len(x.shape)))
        n = math.prod(x.shape[a] for a in axes)
        if args:  # var(x, dims, unbiased, keepdim) or var.correction's positional keepdim
            keepdim = args[-1] if len(args) > 1 else keepdim
        ddof = 1 if correction is None and unbiased is not False else (correction or 0)
        centred = b.g.sub(x, b.g.mean(x, axes, keepdims=True))
        # over n - ddof as torch's, 0 included: times 1 / 0 = inf, NaN where n <= ddof but
        # for a variance above 0; the deviation is the scaled norm of the centred values
        # (torch's is finite past 1.8e19, where the sum of squares overflows, and its gradient
        # is 0 at a deviation of 0)
        count = max(n - ddof, 0)
        if root:
            return b.g.mul(b.g.reduce_l2(centred, axes, keepdims=bool(keepdim)),
                           1.0 / math.sqrt(count) if count else math.inf)
        return b.g.mul(b.g.sum(b.g.square(centred), axes, keepdims=bool(keepdim)),
                       1.0 / count if count else math.inf)
    return handler


ATEN["var"], ATEN["std"] = _make_var(False), _make_var(True)


@aten("linalg_vector_norm", "norm")
def _vector_norm(b, x, order=2, dims=None, keepdim=False, dtype=None):
    """torch.linalg.vector_norm (F.normalize's, weight_norm's): the p-norm over `dims`, all
    axes when None. Its 0-norm counts the nonzero entries."""
    x = b.device(x)
    axes, keep, order = _dims(x, dims), bool(keepdim), float(order)
    if order == 2.0:
        return b.g.reduce_l2(x, axes, keepdims=keep)
    if order == math.inf:
        return b.g.amax(b.g.abs(x), axes, keepdims=keep)
    if order == -math.inf:
        return b.g.amin(b.g.abs(x), axes, keepdims=keep)
    if order == 0.0:
        return b.g.sum(b.g.not_equal(x, 0.0), axes, keepdims=keep)
    if order == 1.0:
        return b.g.sum(b.g.abs(x), axes, keepdims=keep)
    powered = b.g.sum(power(b.g, b.g.abs(x), order), axes, keepdims=keep)
    return power(b.g, powered, 1.0 / order)


@aten("_weight_norm")
def _weight_norm(b, v, gain, dim=0):
    """weight_norm's weight: v scaled to the norm `gain` over every axis but `dim`."""
    v = b.device(v)
    dim %= len(v.shape)
    norm = b.g.reduce_l2(v, [a for a in range(len(v.shape)) if a != dim], keepdims=True)
    return b.g.mul(v, b.g.div(b.device(gain), norm))


@aten("slice_scatter")
def _slice_scatter(b, x, src, dim=0, start=None, end=None, step=1):
    """x with x[start:end:step] along `dim` replaced by src: an in-place write into a slice
    made functional (Swin V2 zeroes its key bias so)."""
    x, src = b.device(x), b.device(src)
    axis = dim % len(x.shape)
    written = np.arange(x.shape[axis])[slice(start, end, step)]
    if len(written) != src.shape[axis]:
        raise Refuse(f"{len(written)} positions of axis {axis} written from a source of "
                     f"{src.shape[axis]}")
    return scatter_along(b.g, x, src, written, axis)


def _ranked(b, rank: Callable[[Tensor], tuple[Tensor, Tensor]], x: Tensor):
    """vkml's topk and sort rank f32 values: integers (a router's expert ids) as f32, exact
    below 2 ** 24, their values cast back."""
    if x.dtype == "f32":
        return rank(x)
    values, indices = rank(b.g.cast(x, "f32"))
    return b.g.cast(values, x.dtype), indices


@aten("histc")
def _histc(b, x, bins=100, low=0, high=0):
    """torch.histc over a range given at import (a router counts its tokens per expert so):
    each element's bin (floor((x - low) bins / (high - low)), the top edge in the last bin),
    one-hot and summed, elements outside the range left out."""
    if float(low) == float(high):
        raise Refuse("histc over the data's own range (min == max): give the range")
    x = b.device(x)
    flat = b.g.reshape(b.g.cast(x, "f32") if x.dtype != "f32" else x, (x.size,))
    lo, hi, bins = float(low), float(high), int(bins)
    position = b.g.floor(b.g.mul(b.g.sub(flat, lo), bins / (hi - lo)))
    position = b.g.where(b.g.equal(flat, hi), float(bins - 1), position)
    inside = b.g.logical_and(b.g.greater_equal(flat, lo), b.g.less_equal(flat, hi))
    index = b.g.cast(b.g.clamp(position, 0.0, float(bins - 1)), "i32")
    rows = b.g.mul(b.g.one_hot(index, bins), b.g.reshape(inside, (x.size, 1)))
    return b.g.sum(rows, 0)


@aten("topk")
def _topk(b, x, k, dim=-1, largest=True, sorted=True):
    x = b.device(x)
    return _ranked(b, lambda v: b.g.topk(v, int(k), dim % len(x.shape), bool(largest)), x)


@aten("sort")
def _sort(b, x, *args, stable=None, dim=-1, descending=False):
    """sort.default (x, dim, descending) and sort.stable (x, *, stable, dim, descending):
    vkml's sort is stable either way."""
    if args:
        dim, descending = (list(args) + [descending])[:2]
    x = b.device(x)
    return _ranked(b, lambda v: b.g.sort(v, dim % len(x.shape), bool(descending)), x)


@aten("cumsum")
def _cumsum(b, x, dim, dtype=None):
    return b.g.cumsum(b.device(x), dim)


@aten("index")
def _index(b, x, indices):
    x = b.device(x)
    used = [(axis, i) for axis, i in enumerate(indices) if i is not None]
    if any(not isinstance(i, Tensor) and i.dtype == b.torch.bool for _, i in used):
        raise Refuse("boolean-mask indexing: its length depends on the mask's values")
    if len(used) == 1:
        axis, index = used[0]
        return b.g.gather(x, b.g.cast(b.device(index), "i32"), axis)
    axes = [axis for axis, _ in used]
    if any(isinstance(i, Tensor) for _, i in used) or axes != list(range(axes[0],
                                                                         axes[-1] + 1)):
        raise Refuse("advanced indexing with several index tensors needs them known at import "
                     "and on adjacent axes")
    return gather_points(b.g, x, [i.numpy() for _, i in used], axes[0])


@aten("index_put")
def _index_put(b, x, indices, values, accumulate=False):
    """x[indices] = values (or += with accumulate: repeated positions summed), for index
    tensors known at import on adjacent axes: those axes merged into one and scattered
    along. Indices computed at run time (a mixture of experts' routing) are refused."""
    x = b.device(x)
    used = [(axis, i) for axis, i in enumerate(indices) if i is not None]
    if any(isinstance(i, Tensor) for _, i in used):
        raise Refuse("index_put at indices computed at run time: which elements it writes "
                     "depends on the data")
    if any(i.dtype == b.torch.bool for _, i in used):
        raise Refuse("index_put through a boolean mask is not supported")
    axes = [axis for axis, _ in used]
    if axes != list(range(axes[0], axes[-1] + 1)):
        raise Refuse("index_put with index tensors on axes that are not adjacent")
    first, dims = axes[0], x.shape[axes[0]:axes[-1] + 1]
    points = [np.asarray(i, np.int64) % d
              for i, d in zip(np.broadcast_arrays(*[i.numpy() for _, i in used]), dims)]
    targets = np.ravel_multi_index(tuple(points), dims).reshape(-1) if points[0].size else \
        points[0].reshape(-1)
    lead, rest = x.shape[:first], x.shape[first + len(dims):]
    written = b.g.expand(b.device(values), (*lead, *points[0].shape, *rest))
    merged = b.g.reshape(x, (*lead, math.prod(dims), *rest))
    out = scatter_along(b.g, merged, b.g.reshape(written, (*lead, targets.size, *rest)),
                        targets, first, "add" if accumulate else "none")
    return b.g.reshape(out, x.shape)


@aten("col2im")
def _col2im(b, x, size, kernel, dilation, padding, stride):
    x = b.device(x)
    if len(x.shape) != 3:
        raise Refuse("F.fold of an unbatched input is not supported")
    pads = [int(p) for p in padding]
    return fold(b.g, x, [int(v) for v in size], [int(k) for k in kernel],
                [int(d) for d in dilation], pads + pads, [int(v) for v in stride])


def _make_like(name: str) -> Handler:
    """A tensor of constants shaped like (or as asked of) a computed one: known at import."""
    kind = name.removeprefix("new_").removesuffix("_like")

    def handler(b, x, *args, **kwargs):
        torch = b.torch
        dtype = kwargs.get("dtype") or (torch.float32 if x.dtype == "f32" else torch.int64)
        args = list(args)
        shape = args.pop(0) if name.startswith("new_") else x.shape
        fill = args[0] if kind == "full" else 1 if kind == "ones" else 0
        return torch.full(tuple(shape), fill, dtype=dtype)
    return handler


for _name in ("zeros_like", "ones_like", "full_like", "empty_like", "new_zeros", "new_ones",
              "new_full", "new_empty"):
    ATEN[_name] = _make_like(_name)


def _make_softmax(log: bool) -> Handler:
    def handler(b, x, dim, *rest):
        x = b.device(x)
        return last_axis(b.g, x, dim, b.g.log_softmax if log else b.g.softmax)
    return handler


for _name in ("softmax", "_softmax"):
    ATEN[_name] = _make_softmax(False)
for _name in ("log_softmax", "_log_softmax"):
    ATEN[_name] = _make_softmax(True)


@aten("layer_norm")
def _layer_norm(b, x, shape, weight=None, bias=None, eps=1e-5, *rest):
    return b.g.layer_norm(b.device(x), tuple(shape), _tensor(b, weight), _tensor(b, bias),
                          float(eps))


ATEN["native_layer_norm"] = lambda b, *a: (_layer_norm(b, *a), None, None)


@aten("rms_norm")
def _rms_norm(b, x, shape, weight=None, eps=None):
    x = b.device(x)
    if len(shape) != 1:
        raise Refuse("RMSNorm over more than the last axis is not supported")
    eps = float(np.finfo(np.float32).eps) if eps is None else float(eps)
    return b.g.rms_norm(x, _tensor(b, weight), eps)


@aten("group_norm")
def _group_norm(b, x, groups, weight=None, bias=None, eps=1e-5, *rest):
    return b.g.group_norm(b.device(x), int(groups), _tensor(b, weight), _tensor(b, bias),
                          float(eps))


@aten("native_group_norm")
def _native_group_norm(b, x, weight, bias, n, c, hw, groups, eps):
    return (_group_norm(b, x, groups, weight, bias, eps), None, None)


@aten("instance_norm")
def _instance_norm(b, x, weight=None, bias=None, rm=None, rv=None, use_input_stats=True,
                   momentum=0.1, eps=1e-5, cudnn=False):
    if not use_input_stats:
        raise Refuse("instance norm from running statistics is not supported")
    return b.g.instance_norm(b.device(x), _tensor(b, weight), _tensor(b, bias), float(eps))


def batch_norm(b: _Builder, x, weight, bias, mean, var, training: bool, eps: float) -> Tensor:
    train = bool(training) and b.training
    return b.g.batch_norm(b.device(x), _tensor(b, mean), _tensor(b, var), _tensor(b, weight),
                          _tensor(b, bias), training=train, eps=float(eps))


@aten("batch_norm")
def _batch_norm(b, x, weight, bias, mean, var, training, momentum, eps, cudnn=False):
    return batch_norm(b, x, weight, bias, mean, var, training, eps)


@aten("_native_batch_norm_legit_functional")
def _bn_functional(b, x, weight, bias, mean, var, training, momentum, eps):
    return (batch_norm(b, x, weight, bias, mean, var, training, eps), None, None, None, None)


@aten("_native_batch_norm_legit_no_training")
def _bn_no_training(b, x, weight, bias, mean, var, momentum, eps):
    return (batch_norm(b, x, weight, bias, mean, var, False, eps), None, None)


def _conv_padding(x: Tensor, w: Tensor, padding, dilation) -> Any:
    if padding == "same":
        return tuple(d * (k - 1) // 2 for d, k in zip(dilation, w.shape[2:]))
    if padding == "valid":
        return 0
    return padding


def _first(v: Any) -> int:
    return v if isinstance(v, int) else v[0]


@aten("conv3d", "conv2d", "conv1d")
def _conv(b, x, w, bias=None, stride=1, padding=0, dilation=1, groups=1):
    x, w = b.device(x), b.device(w)
    rank = len(w.shape) - 2
    dilation = [dilation] * rank if isinstance(dilation, int) else list(dilation)
    padding = _conv_padding(x, w, padding, dilation)
    if rank == 1:
        return b.g.conv1d(x, w, _tensor(b, bias), _first(stride), _first(padding),
                          dilation[0], groups)
    if rank == 3:
        return b.g.conv3d(x, w, _tensor(b, bias), stride, padding, dilation, groups)
    if rank != 2:
        raise Refuse(f"{rank}-D convolutions are not supported (1-D, 2-D and 3-D are)")
    return b.g.conv2d(x, w, _tensor(b, bias), stride, padding, dilation, groups)


@aten("convolution")
def _convolution(b, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    if transposed:
        return _conv_transpose(b, x, w, bias, stride, padding, output_padding, groups, dilation)
    return _conv(b, x, w, bias, stride, padding, dilation, groups)


@aten("conv_transpose2d")
def _conv_transpose(b, x, w, bias=None, stride=1, padding=0, output_padding=0, groups=1,
                    dilation=1):
    return b.g.conv_transpose2d(b.device(x), b.device(w), _tensor(b, bias), stride, padding,
                                output_padding, dilation, groups)


@aten("max_pool2d")
def _max_pool(b, x, kernel, stride=None, padding=0, dilation=1, ceil_mode=False):
    if dilation not in (1, [1, 1], (1, 1)):
        raise Refuse("dilated pooling is not supported")
    return b.g.max_pool2d(b.device(x), kernel, stride or None, padding, bool(ceil_mode))


ATEN["max_pool2d_with_indices"] = lambda b, *a, **k: (_max_pool(b, *a, **k), None)


@aten("max_pool3d")
def _max_pool3d(b, x, kernel, stride=None, padding=0, dilation=1, ceil_mode=False):
    if dilation not in (1, [1, 1, 1], (1, 1, 1)):
        raise Refuse("dilated pooling is not supported")
    return b.g.max_pool3d(b.device(x), kernel, stride or None, padding, bool(ceil_mode))


ATEN["max_pool3d_with_indices"] = lambda b, *a, **k: (_max_pool3d(b, *a, **k), None)


@aten("avg_pool2d")
def _avg_pool(b, x, kernel, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
              divisor_override=None):
    return b.g.avg_pool2d(b.device(x), kernel, stride or None, padding, bool(ceil_mode),
                          bool(count_include_pad), divisor_override)


@aten("avg_pool3d")
def _avg_pool3d(b, x, kernel, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    if divisor_override is not None:
        raise Refuse("3-D average pooling with divisor_override is not supported")
    return b.g.avg_pool3d(b.device(x), kernel, stride or None, padding, bool(ceil_mode),
                          bool(count_include_pad))


@aten("adaptive_avg_pool1d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d",
      "adaptive_avg_pool3d", "_adaptive_avg_pool3d")
def _adaptive_avg_pool(b, x, size):
    x = b.device(x)
    rank = len(x.shape) - 2
    return b.g.adaptive_avg_pool(x, [size] * rank if isinstance(size, int) else list(size))


def _make_upsample(name: str) -> Handler:
    mode = ("nearest-exact" if "exact" in name else "nearest" if "nearest" in name
            else "bilinear" if name.endswith("2d") else "linear")

    def handler(b, x, size=None, *args, **kwargs):
        align = args[0] if mode in ("bilinear", "linear") and args else None
        scales = []  # per axis (.default) or one list of them (.vec: DPT's fusion stages)
        for s in args[1:] if align is not None else args:
            scales += list(s) if isinstance(s, (list, tuple)) else [] if s is None else [s]
        scales = kwargs.get("scale_factors") or scales or None
        return b.g.interpolate(b.device(x), size=list(size) if size else None,
                               scale_factor=None if size else scales, mode=mode,
                               align_corners=align)
    return handler


for _name in ("upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_bilinear2d",
              "upsample_nearest1d", "upsample_linear1d"):
    ATEN[_name] = _make_upsample(_name)


def _make_pad(name: str) -> Handler:
    def handler(b, x, pads, mode="constant", value=None):
        x = b.device(x)
        if name == "constant_pad_nd":  # (x, pad, value)
            mode, value = "constant", mode if not isinstance(mode, str) else value
        elif name != "pad":
            mode = "reflect" if name.startswith("reflection") else "replicate"
        for k in range(len(pads) // 2):  # pairs from the last axis backwards, as F.pad's
            before, after = int(pads[2 * k]), int(pads[2 * k + 1])
            if before or after:
                x = b.g.pad(x, len(x.shape) - 1 - k, before, after, mode=mode,
                            value=float(value or 0.0))
        return x
    return handler


for _name in ("constant_pad_nd", "pad", "reflection_pad2d", "replication_pad2d",
              "reflection_pad1d", "replication_pad1d"):
    ATEN[_name] = _make_pad(_name)


@aten("scaled_dot_product_attention")
def _sdpa(b, q, k, v, mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    q, k, v = b.device(q), b.device(k), b.device(v)
    # a boolean mask is additive -inf where false: a query that sees no key gives 0, as torch's
    if mask is not None and not isinstance(mask, Tensor):
        if mask.dtype == b.torch.bool:
            mask = b.torch.zeros(mask.shape).masked_fill(~mask, -math.inf)
        if patterns.is_causal_mask(mask.numpy(), q.shape[-2], k.shape[-2]):
            mask, is_causal = None, True
    if mask is not None:
        mask = b.device(mask)
        if mask.dtype == "i32":
            mask = b.g.where(mask, 0.0, -math.inf)
    # key/value heads repeated for grouped-query attention: vkml's attention groups them itself
    k, v = patterns.unrepeated_heads(k, q.shape[-3]), patterns.unrepeated_heads(v, q.shape[-3])
    return b.g.scaled_dot_product_attention(q, k, v, mask, bool(is_causal), scale,
                                            dropout_p=float(dropout_p) if b.training else 0.0)


@aten("dropout")
def _dropout(b, x, p, train):
    if not (train and b.training and p > 0):
        return x
    return b.g.dropout(b.device(x), float(p))


ATEN["native_dropout"] = lambda b, x, p, train: (_dropout(b, x, p, train), None)


@aten("einsum")
def _einsum(b, equation, operands):
    return b.g.einsum(equation, *[b.device(x) for x in operands])

