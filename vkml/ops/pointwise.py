"""Elementwise ops: one output element from the inputs' elements at the same (broadcast) index.

Each is one expression (vkml/expr.py); the pointwise generator wraps it with the indexing, and the
rewrite stage fuses chains of them. Unary ops come from one table, so an op's forward template,
its helper functions and its derivative sit on one line or two.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

from vkml.errors import GraphError
from vkml.expr import Arg, Axis, Expr, Lit, call, contiguous_strides
from vkml.graph import (
    DType,
    Graph,
    OpDef,
    Operand,
    Shape,
    Tensor,
    as_shape,
    builder,
    register,
)
from vkml.kernels.common import is_infinite, is_nan, unless_nan


def same_f32(inputs, attrs):
    """Shape rule of an op whose one f32 input and result have the same shape."""
    (x,) = inputs
    if x.dtype != "f32":
        raise GraphError(f"expects f32, got {x.dtype}")
    return x.shape, "f32"


def broadcast_shapes(a: Shape, b: Shape) -> Shape:
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        da = a[-i] if i <= len(a) else 1
        db = b[-i] if i <= len(b) else 1
        if da != db and 1 not in (da, db):
            raise GraphError(f"shapes {a} and {b} do not broadcast: axis -{i} is {da} vs {db}")
        out.append(max(da, db))
    return tuple(reversed(out))


def binary_f32(inputs, attrs):
    """Shape rule of a binary f32 op, its operands numpy-broadcast."""
    a, b = inputs
    if a.dtype != "f32" or b.dtype != "f32":
        raise GraphError(f"expects f32 operands, got {a.dtype} and {b.dtype}")
    return broadcast_shapes(a.shape, b.shape), "f32"


def sum_to(g: Graph, x: Tensor, shape: Shape) -> Tensor:
    """Undo broadcasting: sum `x` over the axes along which `shape` was broadcast."""
    if x.shape == shape:
        return x
    pad = len(x.shape) - len(shape)
    axes = [i for i in range(len(x.shape)) if i < pad or (shape[i - pad] == 1 and x.shape[i] != 1)]
    return g.reshape(g.sum(x, axes), shape) if axes else g.reshape(x, shape)


# ---- unary ops ----------------------------------------------------------------------------------
ERF_HELPER = """
fn vkml_erf(x: f32) -> f32 {
  // Abramowitz & Stegun 7.1.26 is too coarse for 1e-5 agreement; this is the erfc-based
  // Numerical Recipes (erfcc) approximation, |error| < 1.2e-7 everywhere.
  let z = abs(x);
  let t = 1.0 / (1.0 + 0.5 * z);
  let r = t * exp(-z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 +
    t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 +
    t * (-0.82215223 + t * 0.17087277)))))))));
  return select(r - 1.0, 1.0 - r, x >= 0.0);
}
"""
TANH_HELPER = """
fn vkml_tanh(x: f32) -> f32 {
  // exp(-2|x|) never overflows, unlike the (e^2x - 1) / (e^2x + 1) some drivers use for tanh.
  let t = exp(-2.0 * abs(x));
  return sign(x) * (1.0 - t) / (1.0 + t);
}
"""
EXPM1_HELPER = """
fn vkml_expm1(x: f32) -> f32 {
  // exp(x) - 1 near 0 would keep none of x's digits (and WGSL's exp and log are only
  // accurate to some ulps, not enough for Kahan's quotient): Taylor's series there.
  if (abs(x) >= 0.5) { return exp(x) - 1.0; }
  return x * (1.0 + x / 2.0 * (1.0 + x / 3.0 * (1.0 + x / 4.0 * (1.0 + x / 5.0 * (1.0 + x / 6.0
    * (1.0 + x / 7.0 * (1.0 + x / 8.0 * (1.0 + x / 9.0))))))));
}
"""
LOG1P_HELPER = """
fn vkml_log1p(x: f32) -> f32 {
  // log(1 + x) near 0 would keep none of x's digits: there 2 atanh(s), s = x / (2 + x),
  // |s| <= 1/3, as a series in s.
  if (abs(x) >= 0.5) { return log(1.0 + x); }
  let s = x / (2.0 + x);
  let s2 = s * s;
  return 2.0 * s * (1.0 + s2 * (1.0 / 3.0 + s2 * (1.0 / 5.0 + s2 * (1.0 / 7.0 + s2 * (1.0 / 9.0
    + s2 * (1.0 / 11.0 + s2 * (1.0 / 13.0 + s2 * (1.0 / 15.0))))))));
}
"""
SIN_COS_HELPER = f"""
fn vkml_sin_cos(x: f32) -> vec2<f32> {{
  // (sin x, cos x). Vulkan only bounds the builtins' absolute error (2^-11 in [-pi, pi]): here
  // x = q pi/2 + r with pi/2 split into three parts (Cody-Waite; q r exact while |x| < 2^16
  // pi/2, 1e-7 from float64 measured to |x| = 1e4), and Cephes' sinf and cosf polynomials on
  // r, q mod 4 choosing the pair. Farther out the split leaves r inexact and then large: it is
  // held within [-1, 1], where the polynomials stay in [-1, 1], so a huge x gives a value
  // there (torch's, in float64, needs x mod 2 pi exactly) instead of overflowing into NaN; an
  // infinite or NaN x gives a NaN r, and NaN, as torch.
  let q = round(x * 0.63661977236758134);
  let exact = ((x - q * 1.5703125) - q * 4.837512969970703125e-4) - q * 7.54978995489188216e-8;
  let r = {unless_nan("clamp(exact, -1.0, 1.0)", "exact")};
  let r2 = r * r;
  let s = r + r * r2 * (-1.6666654611e-1 + r2 * (8.3321608736e-3 + r2 * -1.9515295891e-4));
  let c = 1.0 - 0.5 * r2 + r2 * r2 * (4.166664568298827e-2 + r2 * (-1.388731625493765e-3
    + r2 * 2.443315711809948e-5));
  switch (i32(q - 4.0 * floor(q * 0.25))) {{  // q mod 4, exact (i32(q) may not fit)
    case 0: {{ return vec2<f32>(s, c); }}
    case 1: {{ return vec2<f32>(c, -s); }}
    case 2: {{ return vec2<f32>(-s, -c); }}
    default: {{ return vec2<f32>(-c, s); }}
  }}
}}
"""
UnaryGrad = Callable[[Graph, Tensor, Tensor, Tensor], Tensor | None]  # (g, x, y, d y) -> d x


def zero_gradient(g: Graph, x: Tensor, y: Tensor, d: Tensor) -> None:
    """Piecewise-constant ops (floor, sign, ...): a zero gradient, as torch's."""
    return None


# name -> (WGSL template of the input {0}, helper functions, gradient, public: a Graph method
# (and "tensor": a Tensor method too), or internal: no generated method (made by other ops'
# gradients, or by a builder written out below))
UNARY: dict[str, tuple[str, str, UnaryGrad | None, str]] = {
    # Where torch's gradient is 0 (relu below 0, the hard* ops and clamp outside their range),
    # it is selected, not multiplied by 0: a NaN or infinite upstream gradient stays out there.
    # NaN through (kernels/common.py unless_nan: a NaN that vanished would corrupt parameters
    # unnoticed), -0.0 kept, as torch's; torch's gradient passes at NaN too (its elu's and
    # hardswish's are NaN there: its vectorized kernels', which run on all but the tiniest
    # tensors, as those here)
    "relu": (unless_nan("select({0}, 0.0, {0} < 0.0)", "{0}"), "",
             lambda g, x, y, d: g.where(g.apply("step", [x]), d, 0.0), "tensor"),
    "step": (unless_nan("select(0.0, 1.0, {0} > 0.0)", "{0}", "1.0"), "", None, "internal"),
    "sigmoid": ("1.0 / (1.0 + exp(-{0}))", "",
                lambda g, x, y, d: g.mul(d, g.mul(y, g.sub(1.0, y))), "tensor"),
    "tanh": ("vkml_tanh({0})", TANH_HELPER,
             lambda g, x, y, d: g.mul(d, g.sub(1.0, g.mul(y, y))), "tensor"),
    "gelu": ("0.5 * {0} * (1.0 + vkml_erf({0} * 0.70710678118654752))", ERF_HELPER,
             lambda g, x, y, d: g.mul(d, g.apply("gelu_deriv", [x])), "internal"),
    "gelu_deriv": ("0.5 * (1.0 + vkml_erf({0} * 0.70710678118654752))"
                   " + {0} * exp(-0.5 * {0} * {0}) * 0.39894228040143268", ERF_HELPER, None,
                   "internal"),
    "silu": ("{0} / (1.0 + exp(-{0}))", "",
             lambda g, x, y, d: g.mul(d, g.apply("silu_deriv", [x])), "tensor"),
    "silu_deriv": ("(1.0 / (1.0 + exp(-{0}))) * (1.0 + {0} * (1.0 - 1.0 / (1.0 + exp(-{0}))))",
                   "", None, "internal"),
    "exp": ("exp({0})", "", lambda g, x, y, d: g.mul(d, y), "tensor"),
    "log": ("log({0})", "", lambda g, x, y, d: g.div(d, x), "tensor"),
    "neg": ("-{0}", "", lambda g, x, y, d: g.neg(d), "graph"),
    "sqrt": ("sqrt({0})", "", lambda g, x, y, d: g.div(g.mul(d, 0.5), y), "graph"),
    # the square root of a sum of squares (reduce_l2): a zero norm passes no gradient, as
    # torch's vector_norm's (sqrt's own, inf, times the squares' 2x = 0 would be NaN)
    "norm_sqrt": ("sqrt({0})", "",
                  lambda g, x, y, d: g.mul(g.mul(d, 0.5), g.apply("reciprocal_or_zero", [y])),
                  "internal"),
    "reciprocal_or_zero": ("select(1.0 / {0}, 0.0, {0} == 0.0)", "", None, "internal"),
    # WGSL's inverseSqrt may be a fast approximation on some drivers; 1/sqrt is exact to an ulp.
    "rsqrt": ("1.0 / sqrt({0})", "",
              lambda g, x, y, d: g.mul(d, g.mul(g.mul(y, g.mul(y, y)), -0.5)), "graph"),
    "square": ("{0} * {0}", "", lambda g, x, y, d: g.mul(d, g.mul(x, 2.0)), "graph"),
    "abs": ("abs({0})", "", lambda g, x, y, d: g.mul(d, g.apply("sign", [x])), "tensor"),
    # torch's sign of NaN is 0, WGSL's is the driver's
    "sign": (unless_nan("select(select(0.0, -1.0, {0} < 0.0), 1.0, {0} > 0.0)", "{0}", "0.0"),
             "", zero_gradient, "tensor"),
    # vkml_erf's error is absolute (1.2e-7): below 0.5 in magnitude, Taylor's series keeps
    # erf's relative precision near 0 (the erf's of GELU are unchanged)
    "erf": ("select(vkml_erf({0}), {0} * 1.1283791670955126 * (1.0 + {0} * {0} * (-1.0 / 3.0 + "
            "{0} * {0} * (1.0 / 10.0 + {0} * {0} * (-1.0 / 42.0 + {0} * {0} * (1.0 / 216.0 + "
            "{0} * {0} * (-1.0 / 1320.0 + {0} * {0} * (1.0 / 9360.0 + {0} * {0} * (-1.0 / "
            "75600.0)))))))), abs({0}) < 0.5)", ERF_HELPER,
            lambda g, x, y, d: g.mul(d, g.apply("erf_deriv", [x])), "tensor"),
    "erf_deriv": ("1.1283791670955126 * exp(-{0} * {0})", "", None, "internal"),
    "gelu_tanh": ("0.5 * {0} * (1.0 + vkml_tanh(0.79788456080286536 * ({0} + 0.044715 * {0} * "
                  "{0} * {0})))", TANH_HELPER,
                  lambda g, x, y, d: g.mul(d, g.apply("gelu_tanh_deriv", [x])), "internal"),
    # past |x| = 10 the tanh is +-1 in f32 and the derivative 1 or 0, where 0 * x^2 would be
    # NaN once x^2 overflows (torch's, in float64, is finite there; NaN at +-inf)
    "gelu_tanh_deriv": ("select(0.5 * (1.0 + vkml_tanh(0.79788456080286536 * ({0} + 0.044715 * "
                        "{0} * {0} * {0}))) + 0.5 * {0} * (1.0 - vkml_tanh(0.79788456080286536 "
                        "* ({0} + 0.044715 * {0} * {0} * {0})) * vkml_tanh(0.79788456080286536 "
                        "* ({0} + 0.044715 * {0} * {0} * {0}))) * 0.79788456080286536 * (1.0 + "
                        "0.134145 * {0} * {0}), select(0.0, 1.0, {0} > 0.0), abs({0}) > 10.0 && "
                        "abs({0}) <= 3.4028235e38)", TANH_HELPER, None, "internal"),
    # torch's: x (x + 3) / 6 between -3 and 3; x * NaN keeps NaN (-inf gives NaN, as torch)
    "hardswish": ("{0} * select(select(({0} + 3.0) / 6.0, 0.0, {0} + 3.0 < 0.0), 1.0, "
                  "{0} + 3.0 > 6.0)", "",
                  lambda g, x, y, d: g.where(g.less_equal(x, -3.0), 0.0,
                                             g.mul(d, g.apply("hardswish_deriv", [x]))),
                  "tensor"),
    "hardswish_deriv": ("select(select({0} / 3.0 + 0.5, 1.0, {0} >= 3.0), 0.0, {0} <= -3.0)", "",
                        None, "internal"),
    "hardsigmoid": (unless_nan("select(select(({0} + 3.0) / 6.0, 0.0, {0} + 3.0 < 0.0), 1.0, "
                               "{0} + 3.0 > 6.0)", "{0}"), "",
                    lambda g, x, y, d: g.where(g.apply("hardsigmoid_deriv", [x]),
                                               g.mul(d, 1.0 / 6.0), 0.0), "tensor"),
    "hardsigmoid_deriv": ("select(0.0, 1.0 / 6.0, {0} > -3.0 && {0} < 3.0)", "", None,
                          "internal"),
    "floor": ("floor({0})", "", zero_gradient, "tensor"),
    "ceil": ("ceil({0})", "", zero_gradient, "tensor"),
    "round": ("round({0})", "", zero_gradient, "tensor"),  # half to even, as torch
    "reciprocal": ("1.0 / {0}", "", lambda g, x, y, d: g.mul(d, g.neg(g.mul(y, y))), "tensor"),
    "sin": ("vkml_sin_cos({0}).x", SIN_COS_HELPER, lambda g, x, y, d: g.mul(d, g.cos(x)),
            "tensor"),
    "cos": ("vkml_sin_cos({0}).y", SIN_COS_HELPER,
            lambda g, x, y, d: g.neg(g.mul(d, g.sin(x))), "tensor"),
    "log1p": ("vkml_log1p({0})", LOG1P_HELPER, lambda g, x, y, d: g.div(d, g.add(x, 1.0)),
              "tensor"),
    "expm1": ("vkml_expm1({0})", EXPM1_HELPER, lambda g, x, y, d: g.mul(d, g.add(y, 1.0)),
              "tensor"),
}


def _unary(name: str, template: str, helper: str, grad: UnaryGrad | None, public: str) -> None:
    register(OpDef(name, same_f32, "pointwise",
                   grad=(lambda g, node, d: [grad(g, node.inputs[0], node, d)]) if grad else None,
                   expr=lambda node: call(template, Arg(0), helper=helper)))
    if public != "internal":
        def method(g: Graph, x: Tensor) -> Tensor:
            return g.apply(name, [x])
        method.__name__, method.__doc__ = name, f"Elementwise {name}: WGSL {template}"
        builder(method, tensor=public == "tensor")


for _name, _rule in UNARY.items():
    _unary(_name, *_rule)


@builder(tensor=True)
def gelu(g: Graph, x: Tensor, approximate: str = "none") -> Tensor:
    """torch's F.gelu: x Phi(x) with erf (`approximate="none"`) or its tanh form ("tanh")."""
    if approximate not in ("none", "tanh"):
        raise GraphError(f"gelu: approximate is 'none' or 'tanh', as torch's, got "
                         f"{approximate!r}")
    return g.apply("gelu" if approximate == "none" else "gelu_tanh", [x])


# ---- unary ops with scalar parameters (attributes, as clamp's bounds) ---------------------------
# name -> (WGSL template of the input {0} and the parameters {1}, {2}, ..., the parameters and
# their defaults (torch's), the derivative's template, helper functions)
PARAMETRIC: dict[str, tuple[str, dict[str, float], str, str]] = {
    "leaky_relu": ("select({0} * {1}, {0}, {0} > 0.0)", {"negative_slope": 0.01},
                   "select({1}, 1.0, {0} > 0.0)", ""),
    "elu": ("select({1} * vkml_expm1({0}), {0}, {0} > 0.0)", {"alpha": 1.0},
            "select({1} * exp({0}), 1.0, {0} > 0.0)", EXPM1_HELPER),
    # torch's: linear where beta x > threshold, and its gradient 1 there
    "softplus": ("select(vkml_log1p(exp({1} * {0})) / {1}, {0}, {0} * {1} > {2})",
                 {"beta": 1.0, "threshold": 20.0},
                 "select(1.0 / (1.0 + exp(-{1} * {0})), 1.0, {0} * {1} > {2})", LOG1P_HELPER),
}


def _parametric(name: str, template: str, defaults: dict[str, float], derivative: str,
                helper: str) -> None:
    def expr_of(text: str) -> Callable[[Tensor], Expr]:
        return lambda node: call(text, Arg(0), *(Lit(node.attrs[k]) for k in defaults),
                                 helper=helper if "vkml_" in text else "")
    register(OpDef(f"{name}_deriv", same_f32, "pointwise", expr=expr_of(derivative)))
    register(OpDef(name, same_f32, "pointwise", expr=expr_of(template),
                   grad=lambda g, node, d: [g.mul(d, g.apply(f"{name}_deriv", [node.inputs[0]],
                                                             **node.attrs))]))

    def method(g: Graph, x: Tensor, *args: float, **kwargs: float) -> Tensor:
        names = list(defaults)
        if len(args) > len(names) or set(kwargs) - set(names):
            raise GraphError(f"{name} takes x and {', '.join(names)}")
        values = {**defaults, **dict(zip(names, args)), **kwargs}
        return g.apply(name, [x], **{k: float(v) for k, v in values.items()})
    method.__name__ = name
    method.__doc__ = (f"torch's F.{name}(x, {', '.join(f'{k}={v}' for k, v in defaults.items())})"
                      f" elementwise: WGSL {template}")
    builder(method, tensor=True)


for _name, _rule in PARAMETRIC.items():
    _parametric(_name, *_rule)


# ---- mish: one op, so that its gradient is torch's one derivative --------------------------------
# x tanh(softplus(x)); composed, its gradient summed two terms, which an infinite upstream
# gradient made inf - inf = NaN where torch's derivative tanh(sp) + x sigmoid(x) (1 - tanh(sp)^2)
# is finite (x = -3, 1e30)
def _mish_parts() -> tuple[Expr, Expr]:
    """tanh(softplus(x)) and sigmoid(x), softplus linear past 20 as torch's."""
    softplus = call("select(vkml_log1p(exp({0})), {0}, {0} > 20.0)", Arg(0), helper=LOG1P_HELPER)
    return (call("vkml_tanh({0})", softplus, helper=TANH_HELPER),
            call("1.0 / (1.0 + exp(-{0}))", Arg(0)))


register(OpDef("mish_deriv", same_f32, "pointwise", expr=lambda n: call(
    "{1} + {0} * {2} * (1.0 - {1} * {1})", Arg(0), *_mish_parts())))
register(OpDef("mish", same_f32, "pointwise",
               grad=lambda g, node, d: [g.mul(d, g.apply("mish_deriv", [node.inputs[0]]))],
               expr=lambda n: call("{0} * {1}", Arg(0), _mish_parts()[0])))


@builder(tensor=True)
def mish(g: Graph, x: Tensor) -> Tensor:
    """torch's F.mish: x tanh(softplus(x))."""
    return g.apply("mish", [x])


# ---- clamp: scalar bounds as attributes, so no constant tensors are made -----------------------
def _clamped(node: Tensor) -> Expr:
    # a NaN element stays NaN and -0.0 stays, as torch's std::min(std::max(x, min), max)
    e: Expr = Arg(0)
    if node.attrs["min"] is not None:
        e = call("select({0}, {1}, {0} < {1})", e, Lit(node.attrs["min"]))
    if node.attrs["max"] is not None:
        e = call("select({0}, {1}, {0} > {1})", e, Lit(node.attrs["max"]))
    return call(unless_nan("{1}", "{0}"), Arg(0), e)


def _within(node: Tensor) -> Expr:
    """1 where the gradient passes, else 0: where min <= x <= max (clamp's), or with `open`
    (hardtanh's) where min < x < max."""
    if node.attrs.get("open"):
        return call(f"select(0.0, 1.0, {{0}} > {{1}} && {{0}} < {{2}} && !{is_nan('{0}')})",
                    Arg(0), Lit(node.attrs["min"]), Lit(node.attrs["max"]))
    tests, args = [], [Arg(0)]
    for bound, op in (("min", ">="), ("max", "<=")):
        if node.attrs[bound] is not None:
            args.append(Lit(node.attrs[bound]))
            tests.append(f"{{0}} {op} {{{len(args) - 1}}}")
    return call(f"select(0.0, 1.0, {' && '.join(tests)})", *args)


register(OpDef("clamp_mask", same_f32, "pointwise", expr=_within))
register(OpDef("clamp", same_f32, "pointwise",
               grad=lambda g, node, d: [g.where(g.apply("clamp_mask", [node.inputs[0]],
                                                        **node.attrs), d, 0.0)],
               expr=_clamped))


# Tensor bounds: x, min and max broadcast, a NaN in any of them gives NaN; torch's gradients:
# x's where min <= x <= max, min's where x < min < max, max's where x > max or max < min.
def _clamp_tensor_shape(inputs, attrs):
    if any(t.dtype != "f32" for t in inputs):
        raise GraphError("expects f32 x, min and max")
    return _mask_of(inputs, attrs)[0], "f32"


def _clamp_tensor_grad(g, node, d):
    x, lo, hi = node.inputs
    passes = [g.logical_and(g.greater_equal(x, lo), g.less_equal(x, hi)),
              g.logical_and(g.less(x, lo), g.less(lo, hi)),
              g.logical_or(g.greater(x, hi), g.less(hi, lo))]
    return [sum_to(g, g.where(p, d, 0.0), t.shape) for p, t in zip(passes, node.inputs)]


register(OpDef("clamp_tensor", _clamp_tensor_shape, "pointwise", grad=_clamp_tensor_grad,
               expr=lambda n: _with_isnan("select(select(select({0}, {1}, {0} < {1}), {2}, "
                                          "select({0}, {1}, {0} < {1}) > {2}), "
                                          "bitcast<f32>(0x7fc00000u), vkml_isnan({0}) || "
                                          "vkml_isnan({1}) || vkml_isnan({2}))",
                                          Arg(0), Arg(1), Arg(2))))


@builder(tensor=True)
def clamp(g: Graph, x: Tensor, min: Operand | None = None,  # noqa: A002  (torch's names)
          max: Operand | None = None) -> Tensor:  # noqa: A002
    """torch.clamp: each element limited to [min, max] (either bound may be None, a number or
    a tensor broadcasting with x); the gradient passes where min <= x <= max, as torch's
    (and to tensor bounds where they bind)."""
    if min is None and max is None:
        raise GraphError("clamp needs min, max or both")
    if isinstance(min, Tensor) or isinstance(max, Tensor):
        return g.apply("clamp_tensor", [x, g.lift(-math.inf if min is None else min),
                                        g.lift(math.inf if max is None else max)])
    return g.apply("clamp", [x], min=None if min is None else float(min),
                   max=None if max is None else float(max))


@builder(tensor=True)
def hardtanh(g: Graph, x: Tensor, min_val: float = -1.0, max_val: float = 1.0) -> Tensor:
    """F.hardtanh: clamp's values, and torch's gradient, which passes where
    min_val < x < max_val (clamp's passes at the bounds too)."""
    if not min_val < max_val:
        raise GraphError(f"hardtanh: min_val ({min_val}) must be below max_val ({max_val})")
    return g.apply("clamp", [x], min=float(min_val), max=float(max_val), open=True)


@builder(tensor=True)
def relu6(g: Graph, x: Tensor) -> Tensor:
    """F.relu6: hardtanh(x, 0, 6), with its gradient."""
    return g.hardtanh(x, 0.0, 6.0)


# ---- binary ops with numpy broadcasting -------------------------------------------------------
def _add_grad(g, node, d):
    a, b = node.inputs
    return [sum_to(g, d, a.shape), sum_to(g, d, b.shape)]


def _sub_grad(g, node, d):
    a, b = node.inputs
    return [sum_to(g, d, a.shape), sum_to(g, g.neg(d), b.shape)]


def _mul_grad(g, node, d):
    a, b = node.inputs
    return [sum_to(g, g.mul(d, b), a.shape), sum_to(g, g.mul(d, a), b.shape)]


def _div_grad(g, node, d):
    a, b = node.inputs
    da = g.div(d, b)
    return [sum_to(g, da, a.shape), sum_to(g, g.neg(g.mul(da, node)), b.shape)]


def _integer_arithmetic(inputs, attrs):
    """add, sub, mul: f32, or i32 (index arithmetic; wrapping on overflow, as torch's int32)."""
    return broadcast_shapes(inputs[0].shape, inputs[1].shape), _one_dtype(inputs)


def _binary_builder(name: str, doc: str) -> None:
    """The Graph method `name(a, b)` of a binary op, numbers lifted to the other operand's
    dtype (_lifted)."""
    def method(g: Graph, a: Operand, b: Operand) -> Tensor:
        return g.apply(name, _lifted(g, a, b))
    method.__name__, method.__doc__ = name, doc
    builder(method)


def _binary_op(name: str, symbol: str, grad: Callable, integers: bool) -> None:
    register(OpDef(name, _integer_arithmetic if integers else binary_f32, "pointwise", grad=grad,
                   expr=lambda n: call(f"{{0}} {symbol} {{1}}", Arg(0), Arg(1))))
    _binary_builder(name, f"a {symbol} b elementwise ({'f32 or i32' if integers else 'f32'}), "
                    "numpy broadcasting; numbers become constants of the other operand's dtype")


for _name, _symbol, _grad, _integers in (("add", "+", _add_grad, True),
                                         ("sub", "-", _sub_grad, True),
                                         ("mul", "*", _mul_grad, True),
                                         ("div", "/", _div_grad, False)):
    _binary_op(_name, _symbol, _grad, _integers)


@builder
def bias_add(g: Graph, x: Tensor, bias: Tensor) -> Tensor:
    """x + bias over the last axis; bias must have shape (x.shape[-1],)."""
    if not x.shape or bias.shape != x.shape[-1:]:
        raise GraphError(f"bias_add: bias {bias.label} must have shape "
                         f"{x.shape[-1:] or '(features,)'} to match the last axis of {x.label}")
    return g.add(x, bias)


# ---- comparisons, logic and selection --------------------------------------------------------
# A truth value is an f32 mask (1 true, 0 false), so it fuses into the arithmetic that reads it
# like any other value; the logical ops and `where` take any nonzero element as true, as torch
# does (NaN included). Masks have no gradient (torch's bools have none), so `x * (x > 0)`
# differentiates through x alone. Every f32 comparison tells NaN by its bits (vkml_isnan): a
# NaN compares false, but unequal, as in torch, whatever the driver assumes.


def _one_dtype(inputs) -> str:
    dtypes = {x.dtype for x in inputs}
    if len(dtypes) != 1:
        raise GraphError(f"expects operands of one dtype, got {', '.join(x.dtype for x in inputs)}"
                         "; cast one of them (cast(x, dtype))")
    return dtypes.pop()


def _mask_of(inputs, attrs):
    _one_dtype(inputs)
    shape: Shape = ()
    for x in inputs:
        shape = broadcast_shapes(shape, x.shape)
    return shape, "f32"


def _lifted(g: Graph, *operands: Operand) -> list[Tensor]:
    """The operands as tensors, numbers as constants of the tensors' dtype (f32 without one)."""
    dtype = next((x.dtype for x in operands if isinstance(x, Tensor)), "f32")
    return [g.lift(x, dtype) for x in operands]


ISNAN_HELPER = f"""
fn vkml_isnan(x: f32) -> bool {{
  return {is_nan("x")};
}}
"""


def _nonzero(node: Tensor, k: int) -> str:
    if node.inputs[k].dtype == "i32":
        return f"{{{k}}} != 0i"
    return f"(!({{{k}}} == 0.0) || vkml_isnan({{{k}}}))"  # NaN is true, as in torch


def _ordered(comparison: str) -> Callable[[Tensor], str]:
    """`comparison` of {0} and {1}: false where either is a NaN, as torch's."""
    return lambda n: (comparison if n.inputs[0].dtype == "i32" else
                      f"({comparison}) && !vkml_isnan({{0}}) && !vkml_isnan({{1}})")


def _no_gradient(g, node, d):
    return [None] * len(node.inputs)


# name -> WGSL truth of the inputs {0}, {1}, ... (a function of the node: literals by dtype)
PREDICATES: dict[str, Callable[[Tensor], str]] = {
    "equal": _ordered("{0} == {1}"),
    "not_equal": lambda n: ("{0} != {1}" if n.inputs[0].dtype == "i32" else
                            "!({0} == {1}) || vkml_isnan({0}) || vkml_isnan({1})"),
    "less": _ordered("{0} < {1}"),
    "less_equal": _ordered("{0} <= {1}"),
    "greater": _ordered("{0} > {1}"),
    "greater_equal": _ordered("{0} >= {1}"),
    "logical_and": lambda n: f"{_nonzero(n, 0)} && {_nonzero(n, 1)}",
    "logical_or": lambda n: f"{_nonzero(n, 0)} || {_nonzero(n, 1)}",
    "logical_xor": lambda n: f"({_nonzero(n, 0)}) != ({_nonzero(n, 1)})",
    "logical_not": lambda n: f"!({_nonzero(n, 0)})",
    "isinf": lambda n: is_infinite("{0}"),  # no WGSL builtin for either
    "isnan": lambda n: "vkml_isnan({0})",
}
UNARY_PREDICATES = ("logical_not", "isinf", "isnan")


def _with_isnan(template: str, *args: Expr) -> Expr:
    return call(template, *args, helper=ISNAN_HELPER if "vkml_isnan" in template else "")


def _predicate(name: str, truth: Callable[[Tensor], str]) -> None:
    arity = 1 if name in UNARY_PREDICATES else 2
    register(OpDef(name, _mask_of, "pointwise", grad=_no_gradient,
                   expr=lambda n: _with_isnan(f"select(0.0, 1.0, {truth(n)})",
                                              *(Arg(k) for k in range(arity)))))

    def method(g: Graph, *operands: Operand) -> Tensor:
        if len(operands) != arity:
            raise GraphError(f"{name} takes {arity} operand(s), got {len(operands)}")
        return g.apply(name, _lifted(g, *operands))
    method.__name__ = name
    method.__doc__ = (f"torch.{name} elementwise as an f32 mask (1 true, 0 false), numpy "
                      "broadcasting; numbers become constants of the other operand's dtype")
    builder(method, tensor=name in UNARY_PREDICATES)


for _name, _truth in PREDICATES.items():
    _predicate(_name, _truth)


def _where_shape(inputs, attrs):
    cond, a, b = inputs
    shape, _ = _mask_of([cond], attrs)
    return broadcast_shapes(broadcast_shapes(shape, a.shape), b.shape), _one_dtype([a, b])


def _where_grad(g, node, d):
    cond, a, b = node.inputs
    zero = g.lift(0.0)
    return [None, sum_to(g, g.where(cond, d, zero), a.shape),
            sum_to(g, g.where(cond, zero, d), b.shape)]


register(OpDef("where", _where_shape, "pointwise", grad=_where_grad,
               expr=lambda n: _with_isnan(f"select({{2}}, {{1}}, {_nonzero(n, 0)})",
                                          Arg(0), Arg(1), Arg(2))))


@builder
def where(g: Graph, cond: Tensor, a: Operand, b: Operand) -> Tensor:
    """torch.where(cond, a, b): a where `cond` is nonzero (an f32 mask or i32), else b, all
    three numpy-broadcast; numbers become constants. The gradient goes to a where cond holds
    and to b elsewhere."""
    return g.apply("where", [cond, *_lifted(g, a, b)])


# ---- integer division ---------------------------------------------------------------------
# i32 index arithmetic (f32 division rounds before it could be floored, which torch avoids):
# name -> (WGSL of {0}, {1}: i32, whose / and % truncate toward zero as C's, what it is).
# A zero divisor gives WGSL's a / 0 = a and a % 0 = 0, where torch raises.
INTEGER_DIVISION = {
    "floor_divide": ("{0} / {1} - select(0i, 1i, {0} % {1} != 0i && ({0} < 0i) != ({1} < 0i))",
                     "torch's a // b (div with rounding_mode='floor'): the quotient rounded down"),
    "trunc_divide": ("{0} / {1}", "torch.div(a, b, rounding_mode='trunc'), ONNX Div of integers: "
                     "the quotient rounded toward zero"),
    "remainder": ("select({0} % {1}, {0} % {1} + {1}, {0} % {1} != 0i && ({0} % {1} < 0i) != "
                  "({1} < 0i))", "torch's a % b, ONNX Mod: the remainder with b's sign"),
    "fmod": ("{0} % {1}", "torch.fmod, ONNX Mod(fmod=1): the remainder with a's sign"),
}


def _integers(inputs, attrs):
    if any(x.dtype != "i32" for x in inputs):
        raise GraphError(f"divides i32 operands, got {inputs[0].dtype} and {inputs[1].dtype}")
    return broadcast_shapes(inputs[0].shape, inputs[1].shape), "i32"


def _integer_division(name: str, template: str, what: str) -> None:
    register(OpDef(name, _integers, "pointwise", expr=lambda n: call(template, Arg(0), Arg(1))))
    _binary_builder(name, f"{what}; i32 operands, numpy broadcasting")


for _name, _rule in INTEGER_DIVISION.items():
    _integer_division(_name, *_rule)


# ---- casts ---------------------------------------------------------------------------------------
def _cast_shape(inputs, attrs):
    if attrs["dtype"] not in ("f32", "i32"):
        raise GraphError(f"cast to 'f32' or 'i32', got {attrs['dtype']!r}")
    return inputs[0].shape, attrs["dtype"]


# ---- stopping a gradient -------------------------------------------------------------------------
def _same(inputs, attrs):
    return inputs[0].shape, inputs[0].dtype


register(OpDef("stop_gradient", _same, "pointwise", grad=_no_gradient,
               expr=lambda n: call("{0}", Arg(0))))


@builder(tensor=True)
def stop_gradient(g: Graph, x: Tensor) -> Tensor:
    """x's values, through which no gradient flows back (torch's x.detach(): a straight-through
    estimator's x + (q - x).detach(), a target computed from the model itself)."""
    return g.apply("stop_gradient", [x])


# f32 -> i32 truncates toward zero, as torch's .to(torch.int32) (WGSL's conversion clamps values
# out of range, where C's is undefined); integers are not differentiable, so no gradient.
register(OpDef("cast", _cast_shape, "pointwise", grad=_no_gradient,
               expr=lambda n: call(f"{n.dtype}({{0}})", Arg(0))))


@builder(tensor=True)
def cast(g: Graph, x: Tensor, dtype: DType) -> Tensor:
    """x converted to `dtype` ("f32" or "i32"; to i32 truncating toward zero); x itself if it
    has that dtype already."""
    return x if x.dtype == dtype else g.apply("cast", [x], dtype=dtype)


# ---- powers, minimum and maximum ------------------------------------------------------------
POW_HELPER = """
fn vkml_pow(x: f32, y: f32, log_near_one: f32) -> f32 {
  // C's (torch's) pow: x^0 = 1 and 1^y = 1 even for NaN, (-1)^(+-inf) = 1, 0^y is 0 or inf,
  // a negative base keeps its sign under an odd integer power and gives NaN under another
  // finite one; WGSL's pow is defined for x > 0 only. Near |x| = 1 Vulkan's log2 (so pow) is
  // only accurate to 2^-21 absolute: there exp(y log1p(|x| - 1)) (|x| - 1 is exact).
  let ax = abs(x);
  if (y == 0.0 || x == 1.0 || (ax == 1.0 && abs(y) > 3.4028235e38)) { return 1.0; }
  // lavapipe's pow(NaN, y) is 0
  if (X_IS_NAN || Y_IS_NAN) { return bitcast<f32>(0x7fc00000u); }
  let whole = floor(y) == y;
  var m = select(pow(ax, y), exp(y * log_near_one), abs(ax - 1.0) < 0.5);
  if (whole && abs(y) < 2147483648.0) {
    // An integer power by squaring: exact where the powers are, a few ulps elsewhere, where
    // exp2(y log2 x) loses |y log2 x| ulps of log2 (1e-5 of 0.5^100 on an H200).
    var n = u32(abs(y));
    var base = ax;
    var acc = 1.0;
    loop {
      if ((n & 1u) == 1u) { acc = acc * base; }
      n = n >> 1u;
      if (n == 0u) { break; }
      base = base * base;
    }
    m = select(acc, 1.0 / acc, y < 0.0);
  }
  if (ax == 0.0) { m = select(bitcast<f32>(0x7f800000u), 0.0, y > 0.0); }
  if (x < 0.0 && !whole && ax <= 3.4028235e38) { return bitcast<f32>(0x7fc00000u); }
  let odd = whole && floor(y * 0.5) != y * 0.5;
  return select(m, -m, odd && bitcast<u32>(x) >= 0x80000000u);
}
""".replace("X_IS_NAN", is_nan("x")).replace("Y_IS_NAN", is_nan("y"))


def _pow_expr(node: Tensor) -> Expr:
    log_near_one = call("vkml_log1p({0})", call("abs({0}) - 1.0", Arg(0)), helper=LOG1P_HELPER)
    return call("vkml_pow({0}, {1}, {2})", Arg(0), Arg(1), log_near_one, helper=POW_HELPER)


def _pow_grad(g, node, d):
    x, y = node.inputs  # torch's: no gradient to x where y == 0, none to y where x == 0 <= y
    dx = g.where(g.equal(y, 0.0), 0.0, g.mul(g.mul(d, y), g.pow(x, g.sub(y, 1.0))))
    # y's: d times the selected factor, so a NaN or infinite d gives NaN at x == 0 as torch's
    dy = g.mul(d, g.where(g.logical_and(g.equal(x, 0.0), g.greater_equal(y, 0.0)), 0.0,
                          g.mul(node, g.log(x))))
    return [sum_to(g, dx, x.shape), sum_to(g, dy, y.shape)]


register(OpDef("pow", binary_f32, "pointwise", grad=_pow_grad, expr=_pow_expr))


@builder
def pow(g: Graph, x: Operand, y: Operand) -> Tensor:  # noqa: A001  (torch's name)
    """torch.pow(x, y) elementwise (`x ** y`), numpy broadcasting, numbers become constants;
    C's special cases (0 ** 0 = 1, (-2) ** 3 = -8, (-2) ** 0.5 = NaN) and torch's gradients."""
    return g.apply("pow", _lifted(g, x, y))


def _extremum(name: str, wins: str, loses: str) -> None:
    """maximum / minimum: `wins`, the WGSL comparison by which b replaces a; `loses`, the op
    by which an operand gets no gradient."""
    def grad(g, node, d):  # torch's: half of it to each operand on a tie, all to both at NaN
        a, b = node.inputs
        half = g.where(g.equal(a, b), g.mul(d, 0.5), d)
        return [sum_to(g, g.where(g.apply(loses, [a, b]), 0.0, half), a.shape),
                sum_to(g, g.where(g.apply(loses, [b, a]), 0.0, half), b.shape)]

    # a NaN in either operand is the result, as torch's (WGSL leaves max of NaN to the driver)
    chosen = f"select({{0}}, {{1}}, {{1}} {wins} {{0}})"
    nan_wins = f"select(select({chosen}, {{1}}, vkml_isnan({{1}})), {{0}}, vkml_isnan({{0}}))"
    register(OpDef(name, lambda inputs, attrs: (_mask_of(inputs, attrs)[0], _one_dtype(inputs)),
                   "pointwise", grad=grad,
                   expr=lambda n: _with_isnan(chosen if n.dtype == "i32" else nan_wins,
                                              Arg(0), Arg(1))))
    _binary_builder(name, f"torch.{name} elementwise (f32 or i32), numpy broadcasting: NaN "
                    "wins, and on a tie each operand gets half of the gradient, as torch's")


_extremum("maximum", ">", "less")
_extremum("minimum", "<", "greater")


# ---- explicit broadcasting and one-hot encoding -------------------------------------------------
def _broadcast_to(inputs, attrs):
    (x,) = inputs
    shape = attrs["shape"]
    if broadcast_shapes(x.shape, shape) != shape:
        raise GraphError(f"cannot broadcast {x.shape} to {shape}")
    return shape, x.dtype


register(OpDef("broadcast_to", _broadcast_to, "pointwise",
               grad=lambda g, node, d: [sum_to(g, d, node.inputs[0].shape)],
               expr=lambda node: Arg(0)))


@builder
def broadcast_to(g: Graph, x: Tensor, shape: int | Shape) -> Tensor:
    """x repeated (numpy broadcasting) to `shape`."""
    return g.apply("broadcast_to", [x], shape=as_shape(shape, f"broadcast_to of {x.label}"))


def _one_hot(inputs, attrs):
    (labels,) = inputs
    if labels.dtype != "i32":
        raise GraphError(f"one_hot expects i32 class indices, got {labels.dtype}")
    return (*labels.shape, attrs["num_classes"]), "f32"


register(OpDef(
    "one_hot", _one_hot, "pointwise",
    expr=lambda node: call("select(0.0, 1.0, {0} == i32({1}))", Arg(0),
                           Axis(len(node.shape) - 1)),
    strides=lambda node: [(*contiguous_strides(node.inputs[0].shape), 0)],
    indexes=lambda node: (0, 0, node.attrs["num_classes"],
                          "class index (one_hot / cross_entropy)"),
))


@builder
def one_hot(g: Graph, labels: Tensor, num_classes: int) -> Tensor:
    """i32 class indices (...) -> f32 rows (..., num_classes) of 0 and 1."""
    if not isinstance(num_classes, numbers.Integral) or num_classes < 1:
        raise GraphError(f"one_hot: num_classes must be an int >= 1, got {num_classes!r}")
    return g.apply("one_hot", [labels], num_classes=int(num_classes))


# ---- dropout -------------------------------------------------------------------------------------
# Counter-based: whether an element is kept is a hash of (the node's salt, the training step,
# the element's index), so nothing is stored, the gradient draws the same mask again (it is the
# same op applied to the output's gradient), and a step is the same whole or in chunks. The step
# is graph.training_step(): 1, 2, ... in training, 0 in forward() and inference (identity).
DROPOUT_HELPER = """
fn vkml_hash(v: u32) -> u32 {
  // PCG's output permutation of one LCG step (Jarzynski & Olano, Hash Functions for GPU
  // Rendering, 2020)
  let state = v * 747796405u + 2891336453u;
  let word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
  return (word >> 22u) ^ word;
}
fn vkml_dropout(x: f32, step: i32, salt: i32, index: u32, threshold: u32, scale: f32) -> f32 {
  if (step == 0) { return x; }
  let h = vkml_hash(vkml_hash(vkml_hash(u32(salt)) ^ u32(step)) ^ index);
  return x * select(0.0, scale, h >= threshold);  // x * 0 keeps a NaN, as torch's x * mask
}
"""


def _dropout_shape(inputs, attrs):
    x, step, salt = inputs
    if x.dtype != "f32" or step.dtype != "i32" or salt.dtype != "i32":
        raise GraphError("expects f32 values, the i32 training step and an i32 salt")
    return x.shape, "f32"


def _dropout_expr(node: Tensor) -> Expr:
    shape = node.shape
    strides = contiguous_strides(shape)
    index = call(" + ".join(f"{{{a}}} * {s}u" for a, s in enumerate(strides)) or "0u",
                 *(Axis(a) for a in range(len(shape))))
    p = node.attrs["p"]
    # kept where the hash is at least p 2^32 (exact in integers); p = 1 keeps nothing
    threshold, scale = (0xFFFFFFFF, 0.0) if p == 1 else (min(round(p * 2**32), 0xFFFFFFFF),
                                                           1.0 / (1.0 - p))
    return call(f"vkml_dropout({{0}}, {{1}}, {{2}}, {{3}}, {threshold}u, {scale!r})",
                Arg(0), Arg(1), Arg(2), index, helper=DROPOUT_HELPER)


register(OpDef("dropout", _dropout_shape, "pointwise",
               grad=lambda g, node, d: [g.apply("dropout", [d, *node.inputs[1:]], **node.attrs),
                                        None, None],
               expr=_dropout_expr, training_only=True))


@builder(tensor=True)
def dropout(g: Graph, x: Tensor, p: float = 0.5, training: bool = True,
            seed: int | None = None) -> Tensor:
    """F.dropout: in a training step each element is zeroed with probability p and the others
    scaled by 1 / (1 - p), a fresh mask each step; in forward() and in sessions without a loss
    the identity. `seed` (by default the node's position in the graph) picks the masks: the
    same graph gives the same masks, step by step, in every session. `training=False`: x."""
    if not 0.0 <= p <= 1.0:
        raise GraphError(f"dropout probability has to be between 0 and 1, got {p}")
    if not training or p == 0.0:
        return x
    salt = len(g.nodes) if seed is None else int(seed)
    return g.apply("dropout", [x, g.training_step(), g.constant(salt % 2**31, "i32")],
                   p=float(p))
