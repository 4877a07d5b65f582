"""The table of special values (NaN, +-inf, -0.0, huge) through every op whose kernel decides
something by comparing values (max, min, clamp, select, NaN tests) or reduces its argument
(sin, cos), with torch's float64 result on the same values. One training graph holds every
entry (each on parameters of its own, so each gradient is its entry's alone), then an
inference of it; tests/test_nonfinite.py runs it on lavapipe, tests/gpu/test_accelerated.py on
the H200 in f32, f16 and bf16, where drivers fold selects into max and min and decide their NaN
rule. Signed zeros are not compared (sign(+-0) is -0.0, sin(-0.0) and tanh(-0.0) +0.0 on
lavapipe, where torch's are +0, -0 and -0).

What torch gives, which the table asserts: relu, clamp, maximum, amax, softmax, max pooling
and argmax propagate or pick a NaN; sign of NaN is 0; relu's gradient passes at NaN, clamp's
and hardsigmoid's do not, elu's and hardswish's are NaN there (torch's vectorized kernels; its
scalar loop, on tensors of a few elements, passes them); softmax of a row holding +inf or only
-inf is NaN, logsumexp +inf and -inf; cross_entropy with class indices is finite where another
class's logit is -inf, with probabilities NaN; scaled_dot_product_attention gives 0 for a query
that sees no key, NaN for a row whose scores hold +inf or NaN (its math kernel; torch's default
CPU kernel gives 0 for a NaN query's row)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import vkml
from vkml.ops.pointwise import PARAMETRIC, UNARY

INF, NAN = np.inf, np.nan
# Each public unary op sees these; sin and cos are compared with float64 up to |x| = SIN_EXACT
# and only held to [-1, 1] beyond (exact there needs x mod 2 pi to 100+ bits)
X = np.array([INF, -INF, NAN, 0.0, -0.0, 1.0, -1.0, 0.5, 3.0, -3.0, 100.0, -100.0, 1e4, -1e4,
              12345.678, 1e30, -1e30, 3.4e38], np.float32)
Y = np.roll(X, 5)  # the second operand: NaN and infinities against every kind of value
SIN_EXACT = 1e4
# exponents: special, and whole and fractional numbers of both signs
SMALL = np.array([INF, -INF, NAN, 0.0, -0.0, 1.0, -1.0, 0.5, 2.0, -2.0, 3.0, -3.0, 0.25, 1e-3,
                  -0.5, 40.0, -40.0, 7.0], np.float32)
# Rows that decide a maximum: all -inf, a NaN first, last or between, +inf, ordinary, all +inf
ROWS = np.array([[-INF, -INF, -INF, -INF], [NAN, 1.0, 2.0, -INF], [1.0, 2.0, 3.0, NAN],
                 [1.0, NAN, 2.0, 0.0], [INF, 0.0, -INF, 1.0], [-INF, 0.0, -INF, -INF],
                 [0.5, -1.0, 2.0, 1.5], [INF, INF, INF, INF]], np.float32)
# Vector norms: squares past f32's range (above 1.8e19) and below it (1e-30), zero, infinities,
# NaN
NORM_ROWS = np.array([[1e20, -2e20, 3e19, 0.0], [1e-30, -2e-30, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0],
                      [INF, 1.0, 2.0, 0.0], [NAN, 1.0, 2.0, 3.0], [3.0, 4.0, 0.0, -0.0],
                      [1e38, -1e38, 0.0, 1.0], [-INF, INF, 1e30, 0.0]], np.float32)
LABELS = np.array([0, 1, 2, 3, 0, 1, 2, 3], np.int32)  # a class for each row
PRODUCT = np.linspace(-2.0, 2.0, 24, dtype=np.float32).reshape(4, 6)
PRODUCT[0, 1], PRODUCT[2, 3], PRODUCT[3, 0] = INF, NAN, -INF
# ROWS with -inf only where no label is (a masked class), NaN and +inf made numbers
MASKED_LOGITS = np.where(np.isnan(ROWS) | np.isposinf(ROWS), 0.5, ROWS)
MASKED_LOGITS[np.arange(len(ROWS)), LABELS] = 1.0

# torch's function for each public unary op, the parametric ones at torch's defaults (a new op
# must add its own here)
TORCH_UNARY = {"relu": torch.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
               "silu": F.silu, "exp": torch.exp, "log": torch.log, "neg": torch.neg,
               "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "square": torch.square,
               "abs": torch.abs, "sign": torch.sign, "erf": torch.erf,
               "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid, "floor": torch.floor,
               "ceil": torch.ceil, "round": torch.round, "reciprocal": torch.reciprocal,
               "sin": torch.sin, "cos": torch.cos, "log1p": torch.log1p, "expm1": torch.expm1,
               "leaky_relu": F.leaky_relu, "elu": F.elu, "softplus": F.softplus}
PUBLIC_UNARY = sorted([*(name for name, rule in UNARY.items() if rule[3] != "internal"),
                       *PARAMETRIC])


@dataclass
class Entry:
    """vkml's op on graph tensors and torch's on float64 tensors of the same `inputs`;
    `grad`: compare the gradients too (torch defines them; i32 results have none)."""

    build: Callable
    reference: Callable
    inputs: tuple[np.ndarray, ...]
    grad: bool = True


def _attention(rng, mask: np.ndarray | None, q_special: float | None = None, fused=False
               ) -> Entry:
    q, k, v = (rng.standard_normal((1, 2, 3, 4)).astype(np.float32) for _ in range(3))
    if q_special is not None:
        q[0, 1, 2, 3] = q_special
    m = None if mask is None else torch.from_numpy(mask).double()

    def reference(q, k, v):
        # torch's math kernel: its default CPU kernel gives 0, not NaN, for a NaN query's row
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    return Entry(lambda g, q, k, v: g.scaled_dot_product_attention(
                     q, k, v, None if mask is None else g.constant(mask), fused=fused),
                 reference, (q, k, v))


def _wide_attention(rng) -> Entry:
    """Attention of a size the H200 runs as one cooperative kernel at precision "f16" in
    inference (kernels/attention.py): a NaN query, a +inf query element, and a key with a
    -inf element, whose scores are +inf for some queries (their rows NaN) and -inf for the
    others (that key masked)."""
    q = rng.standard_normal((1, 2, 64, 32)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 16, 32)).astype(np.float32) for _ in range(2))
    q[0, 0, 5, 0], q[0, 1, 9, 2], k[0, 1, 3, 1] = NAN, INF, -INF

    def reference(q, k, v):
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v)
    return Entry(lambda g, q, k, v: g.scaled_dot_product_attention(q, k, v), reference,
                 (q, k, v))


def table() -> dict[str, Entry]:
    rng = np.random.default_rng(7)
    one = {name: Entry(lambda g, x, name=name: getattr(g, name)(x), TORCH_UNARY[name], (X,),
                       name not in ("sign", "floor", "ceil", "round"))
           for name in PUBLIC_UNARY}
    pool = np.arange(2 * 3 * 4 * 4, dtype=np.float32).reshape(2, 3, 4, 4)
    pool[0, 0, 0, 1] = pool[0, 1, 2, 2] = pool[0, 1, 3, 3] = NAN  # one NaN, two in a window
    pool[1, 2, 3, 3] = INF
    pool[1, 1, :2, :2] = -INF
    masked = np.zeros((3, 3), np.float32)
    masked[1, :] = -INF  # query 1 sees no key
    masked[2, 0] = -INF
    plus_inf = np.zeros((3, 3), np.float32)
    plus_inf[0, 1] = INF
    return {
        **one,
        "gelu": Entry(lambda g, x: g.gelu(x), F.gelu, (X,)),
        "mish": Entry(lambda g, x: g.mish(x), F.mish, (X,)),
        "selu": Entry(lambda g, x: g.selu(x), F.selu, (X,)),
        "gelu_tanh": Entry(lambda g, x: g.gelu(x, approximate="tanh"),
                           lambda x: F.gelu(x, approximate="tanh"), (X,)),
        "leaky_relu_0.2": Entry(lambda g, x: g.leaky_relu(x, 0.2),
                                lambda x: F.leaky_relu(x, 0.2), (X,)),
        "elu_0.5": Entry(lambda g, x: g.elu(x, 0.5), lambda x: F.elu(x, 0.5), (X,)),
        "softplus_2_10": Entry(lambda g, x: g.softplus(x, 2.0, 10.0),
                               lambda x: F.softplus(x, 2.0, 10.0), (X,)),
        "clamp": Entry(lambda g, x: g.clamp(x, -2.0, 3.0), lambda x: x.clamp(-2.0, 3.0), (X,)),
        "clamp_min": Entry(lambda g, x: g.clamp(x, min=0.0), lambda x: x.clamp(min=0.0), (X,)),
        "clamp_0_6": Entry(lambda g, x: g.clamp(x, 0.0, 6.0), lambda x: x.clamp(0.0, 6.0),
                           (X,)),
        # clamp's values, but no gradient at the bounds
        "hardtanh": Entry(lambda g, x: g.hardtanh(x), F.hardtanh, (X,)),
        "relu6": Entry(lambda g, x: g.relu6(x), F.relu6, (np.append(X, 6.0),)),
        "clamp_max_below_min": Entry(lambda g, x: g.clamp(x, 1.0, -1.0),
                                     lambda x: x.clamp(1.0, -1.0), (X,)),
        "clamp_tensor": Entry(lambda g, x, lo: g.clamp(x, lo, g.add(lo, 2.0)),
                              lambda x, lo: x.clamp(lo, lo + 2.0), (X, Y)),
        "pow": Entry(lambda g, a, b: g.pow(a, b), torch.pow, (X, np.roll(SMALL, 3))),
        "maximum": Entry(lambda g, a, b: g.maximum(a, b), torch.maximum, (X, Y)),
        "minimum": Entry(lambda g, a, b: g.minimum(a, b), torch.minimum, (X, Y)),
        "where": Entry(lambda g, a, b: g.where(g.constant(X), a, b),  # NaN is true
                       lambda a, b: torch.where(torch.from_numpy(X) != 0, a, b), (Y, -X)),
        "greater": Entry(lambda g, a, b: g.greater(a, b),
                         lambda a, b: torch.gt(a, b).double(), (X, Y), False),
        "not_equal": Entry(lambda g, a: g.not_equal(a, a), lambda a: torch.ne(a, a).double(),
                           (X,), False),
        "amax": Entry(lambda g, x: g.amax(x, -1), lambda x: x.amax(-1), (ROWS,)),
        "amin": Entry(lambda g, x: g.amin(x, -1), lambda x: x.amin(-1), (-ROWS,)),
        "amax_all": Entry(lambda g, x: g.amax(x), lambda x: x.amax(), (ROWS,), False),
        "argmax": Entry(lambda g, x: g.argmax(x, -1), lambda x: x.argmax(-1), (ROWS,), False),
        "argmin": Entry(lambda g, x: g.argmin(x, -1), lambda x: x.argmin(-1), (-ROWS,), False),
        "reduce_l2": Entry(lambda g, x: g.reduce_l2(x, -1),
                           lambda x: torch.linalg.vector_norm(x, dim=-1), (NORM_ROWS,)),
        "reduce_l2_columns": Entry(lambda g, x: g.reduce_l2(x, 0, keepdims=True),
                                   lambda x: torch.linalg.vector_norm(x, dim=0, keepdim=True),
                                   (NORM_ROWS[[0, 1, 2, 5, 6]],)),
        "logsumexp": Entry(lambda g, x: g.logsumexp(x, -1), lambda x: x.logsumexp(-1), (ROWS,)),
        # -inf logits of other classes than the label's: torch's loss is finite
        "cross_entropy": Entry(lambda g, x: g.cross_entropy(x, g.constant(LABELS, "i32")),
                               lambda x: F.cross_entropy(x, torch.from_numpy(LABELS).long()),
                               (MASKED_LOGITS,)),
        "cross_entropy_probabilities": Entry(
            lambda g, x: g.cross_entropy(x, g.constant(np.eye(4, dtype=np.float32)[LABELS])),
            lambda x: F.cross_entropy(x, torch.eye(4, dtype=torch.float64)[LABELS]),
            (MASKED_LOGITS,)),
        "cross_entropy_nan": Entry(lambda g, x: g.cross_entropy(x, g.constant(LABELS, "i32")),
                                   lambda x: F.cross_entropy(x, torch.from_numpy(LABELS).long()),
                                   (ROWS,)),
        "sort": Entry(lambda g, x: g.sort(x)[0], lambda x: x.sort(dim=-1, stable=True)[0], (ROWS,)),
        "sort_indices": Entry(lambda g, x: g.sort(x, descending=True)[1],
                              lambda x: x.sort(dim=-1, descending=True, stable=True)[1], (ROWS,),
                              False),
        # rows without ties in their top two, where torch's choice of index is its own
        "topk": Entry(lambda g, x: g.topk(x, 2)[0], lambda x: x.topk(2, -1)[0],
                      (ROWS[[1, 2, 3, 4, 6]],)),
        "layer_norm": Entry(lambda g, x: g.layer_norm(x, 4), lambda x: F.layer_norm(x, (4,)),
                            (ROWS,)),
        "rms_norm": Entry(lambda g, x: g.rms_norm(x, eps=1e-6),
                          lambda x: F.rms_norm(x, (4,), eps=1e-6), (ROWS,)),
        "softmax": Entry(lambda g, x: g.softmax(x), lambda x: x.softmax(-1), (ROWS,)),
        "log_softmax": Entry(lambda g, x: g.log_softmax(x), lambda x: x.log_softmax(-1),
                             (ROWS,)),
        "max_pool2d": Entry(lambda g, x: g.max_pool2d(x, 2), lambda x: F.max_pool2d(x, 2),
                            (pool,)),
        # a product whose operands hold NaN and +-inf beside ordinary numbers: at precision
        # "f16" its backward products scale each operand by powers of two chosen from their
        # magnitudes, which the NaN and infinities must not decide
        "matmul": Entry(lambda g, a, b: g.matmul(a, b), torch.matmul, (PRODUCT, PRODUCT.T)),
        # composed (matmuls and a softmax) with an additive mask; fused: flash attention
        "attention_masked_row": _attention(rng, masked),
        "attention_plus_inf_mask": _attention(rng, plus_inf),
        "attention_inf_query": _attention(rng, None, INF),
        "attention_nan_query_fused": _attention(rng, None, NAN, fused=True),
        "attention_inf_query_fused": _attention(rng, None, -INF, fused=True),
        "attention_wide": _wide_attention(rng),
    }


def run(device, precision: str = "f32") -> tuple[list[str], list[str]]:
    """Every entry of table() in one training graph on `device` at `precision`, then in an
    inference of the same graph: the mismatches against torch (empty if none) and the
    kernels that ran."""
    entries = table()
    g = vkml.Graph()
    terms, refs = [], {}
    for name, e in entries.items():
        params = [g.param(f"{name}.{i}", a.shape, init=a, trainable=e.grad)
                  for i, a in enumerate(e.inputs)]
        y = g.output(name, e.build(g, *params))
        leaves = [torch.tensor(a, dtype=torch.float64, requires_grad=e.grad) for a in e.inputs]
        want = e.reference(*leaves)
        refs[name] = (want, leaves)
        if e.grad:
            weight = np.linspace(0.5, 1.0, y.size, dtype=np.float32).reshape(y.shape)
            terms.append(g.sum(g.mul(y, g.constant(weight))))
            want.backward(torch.from_numpy(weight).double())
    loss = terms[0]
    for t in terms[1:]:
        loss = g.add(loss, t)
    problems = []
    with vkml.compile(g, loss=loss, precision=precision, device=device) as session:
        session.step()
        for name, e in entries.items():
            want, leaves = refs[name]
            argument = e.inputs[0] if name in ("sin", "cos") else None
            problems += differences(name, session.read(name), want.detach().numpy(), precision,
                                    argument)
            for i, leaf in enumerate(leaves if e.grad else []):
                problems += differences(f"{name} gradient {i}", session.grad(f"{name}.{i}"),
                                        leaf.grad.numpy(), precision, argument)
        kernels = {d.kernel.name for d in session.plan.dispatches}
    # inference takes kernels of its own (the cooperative attention, other fusions)
    with vkml.compile(g, precision=precision, device=device) as session:
        session.step()
        for name, (want, _) in refs.items():
            problems += differences(f"{name} (inference)", session.read(name),
                                    want.detach().numpy(), precision,
                                    entries[name].inputs[0] if name in ("sin", "cos") else None)
        kernels |= {d.kernel.name for d in session.plan.dispatches}
    return problems, sorted(kernels)


def differences(name: str, actual: np.ndarray, expected: np.ndarray, precision: str,
                argument: np.ndarray | None = None) -> list[str]:
    """Where `actual` is not torch's `expected`: NaN, +inf and -inf exactly at torch's, the
    finite values within f32 rounding (at precision "f16" and "bf16", whose products round
    their operands, within PROTOCOL.md's 1% relative L2 error);
    with `argument` (sin, cos), only bounded in [-1, 1] where |argument| > SIN_EXACT."""
    actual, expected = np.atleast_1d(actual), np.atleast_1d(expected)
    with np.errstate(over="ignore"):  # torch's float64 rounded to f32, as vkml's is
        expected = expected.astype(actual.dtype)
    if actual.shape != expected.shape:
        return [f"{name}: shape {actual.shape}, torch {expected.shape}"]
    if actual.dtype.kind == "i":
        bad = actual != expected
        return [f"{name}: {actual.tolist()}, torch {expected.tolist()}"] if bad.any() else []
    out = []
    for what, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        if (test(actual) != test(expected)).any():
            out.append(f"{name}: {what} at {np.argwhere(test(actual)).ravel().tolist()}, torch's "
                       f"at {np.argwhere(test(expected)).ravel().tolist()}")
    finite = np.isfinite(expected) & np.isfinite(actual)
    if argument is not None:
        far = finite & (np.abs(argument) > SIN_EXACT)
        if (np.abs(actual[far]) > 1).any():
            out.append(f"{name}: {actual[far].tolist()} outside [-1, 1] for huge arguments")
        finite &= ~far
    got, want = actual[finite].astype(np.float64), expected[finite].astype(np.float64)
    if precision == "f32":
        close = np.isclose(got, want, rtol=1e-5, atol=1e-6)
        if not close.all():
            out.append(f"{name}: {got[~close].tolist()}, torch {want[~close].tolist()}")
    elif np.linalg.norm(got - want) > 1e-2 * max(np.linalg.norm(want), 1e-30):
        out.append(f"{name}: relative L2 error {np.linalg.norm(got - want) / np.linalg.norm(want)}"
                   " over its finite values, above PROTOCOL.md's 1%")
    return out
