"""Every op, forward and backward, against PyTorch (float64 reference on the same inputs) and
against finite differences of vkml's own forward pass."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import rel_l2

import vkml

FORWARD_TOL = 1e-5  # the bar for f32 ops (the protocol's gate is 1e-2)
GRAD_TOL = 1e-5
FD_TOL = 1e-2  # finite differences in f32 are themselves this noisy


@dataclass
class Case:
    name: str
    shapes: list[tuple[int, ...]]  # the differentiable operands, made parameters
    build: Callable  # (graph, *params, **extras) -> Tensor
    reference: Callable  # (*torch params, **torch extras) -> torch.Tensor
    positive: bool = False  # draw operands away from zero (log, div)
    extras: dict[str, Callable] = field(default_factory=dict)  # name -> rng -> array


def unary(name: str, ref: Callable, positive: bool = False) -> Case:
    return Case(name, [(6, 9)], lambda g, a: getattr(g, name)(a), ref, positive)


def labels_onehot(rng):
    return np.eye(5, dtype=np.float32)[rng.integers(0, 5, 6)]


CASES = [
    Case("add_same", [(5, 7), (5, 7)], lambda g, a, b: a + b, lambda a, b: a + b),
    Case("add_row_broadcast", [(5, 7), (7,)], lambda g, a, b: a + b, lambda a, b: a + b),
    Case("add_column_broadcast", [(5, 7), (5, 1)], lambda g, a, b: g.add(a, b), torch.add),
    Case("sub_row_broadcast", [(7,), (5, 7)], lambda g, a, b: a - b, lambda a, b: a - b),
    Case("mul_row_broadcast", [(5, 7), (7,)], lambda g, a, b: a * b, lambda a, b: a * b),
    Case("div", [(5, 7), (5, 7)], lambda g, a, b: a / b, lambda a, b: a / b, positive=True),
    Case("div_row_broadcast", [(5, 7), (7,)], lambda g, a, b: a / b, lambda a, b: a / b,
         positive=True),
    Case("scalar_arithmetic", [(5, 7)], lambda g, a: 3.0 - a * 2.5 / 4.0 + 1.0,
         lambda a: 3.0 - a * 2.5 / 4.0 + 1.0),
    Case("bias_add", [(6, 4), (4,)], lambda g, x, b: g.bias_add(x, b), lambda x, b: x + b),
    unary("relu", torch.relu),
    unary("sigmoid", torch.sigmoid),
    unary("tanh", torch.tanh),
    unary("gelu", F.gelu),
    unary("silu", F.silu),
    unary("exp", torch.exp),
    unary("log", torch.log, positive=True),
    unary("neg", torch.neg),
    Case("sum_all", [(5, 7)], lambda g, a: a.sum(), torch.sum),
    Case("sum_last", [(5, 7)], lambda g, a: a.sum(-1), lambda a: a.sum(-1)),
    Case("sum_first", [(5, 7)], lambda g, a: a.sum(0), lambda a: a.sum(0)),
    Case("sum_middle_keepdims", [(3, 4, 5)], lambda g, a: a.sum(1, keepdims=True),
         lambda a: a.sum(1, keepdim=True)),
    Case("sum_outer_axes", [(3, 4, 5)], lambda g, a: a.sum((0, 2)), lambda a: a.sum((0, 2))),
    Case("sum_long_row", [(3, 300)], lambda g, a: a.sum(-1), lambda a: a.sum(-1)),
    Case("mean_all", [(5, 7)], lambda g, a: a.mean(), torch.mean),
    Case("mean_last", [(5, 7)], lambda g, a: a.mean(-1), lambda a: a.mean(-1)),
    Case("softmax", [(6, 9)], lambda g, a: a.softmax(), lambda a: a.softmax(-1)),
    Case("softmax_long_row", [(2, 150)], lambda g, a: a.softmax(), lambda a: a.softmax(-1)),
    Case("log_softmax", [(6, 9)], lambda g, a: a.log_softmax(), lambda a: a.log_softmax(-1)),
    Case("log_softmax_3d", [(2, 3, 9)], lambda g, a: a.log_softmax(),
         lambda a: a.log_softmax(-1)),
    Case("matmul", [(70, 21), (21, 33)], lambda g, a, b: a @ b, torch.matmul),
    Case("matmul_transpose_a", [(21, 70), (21, 33)],
         lambda g, a, b: g.matmul(a, b, transpose_a=True), lambda a, b: a.T @ b),
    Case("matmul_transpose_b", [(70, 21), (33, 21)],
         lambda g, a, b: g.matmul(a, b, transpose_b=True), lambda a, b: a @ b.T),
    Case("matmul_transpose_both", [(21, 70), (33, 21)],
         lambda g, a, b: g.matmul(a, b, transpose_a=True, transpose_b=True),
         lambda a, b: a.T @ b.T),
    Case("matmul_aligned_tiles", [(64, 32), (32, 64)], lambda g, a, b: a @ b, torch.matmul),
    Case("matmul_small", [(3, 5), (5, 2)], lambda g, a, b: a @ b, torch.matmul),
    Case("reshape", [(4, 6)], lambda g, a: a.reshape(3, 8), lambda a: a.reshape(3, 8)),
    Case("reshape_then_op", [(4, 6)], lambda g, a: a.reshape(2, -1).exp(),
         lambda a: a.reshape(2, -1).exp()),
    Case("transpose", [(4, 6)], lambda g, a: a.T, lambda a: a.T),
    Case("transpose_3d", [(2, 3, 4)], lambda g, a: a.transpose(2, 0, 1),
         lambda a: a.permute(2, 0, 1)),
    Case("cross_entropy_indices", [(6, 5)],
         lambda g, a, labels: g.cross_entropy(a, labels),
         lambda a, labels: F.cross_entropy(a, labels.long()),
         extras={"labels": lambda rng: rng.integers(0, 5, 6).astype(np.int32)}),
    Case("cross_entropy_one_hot", [(6, 5)],
         lambda g, a, labels: g.cross_entropy(a, labels),
         lambda a, labels: F.cross_entropy(a, labels), extras={"labels": labels_onehot}),
    Case("mse", [(5, 7), (5, 7)], lambda g, a, b: g.mse(a, b), F.mse_loss),
    # ---- issue 4: op coverage ----
    unary("sqrt", torch.sqrt, positive=True),
    unary("rsqrt", torch.rsqrt, positive=True),
    unary("square", torch.square),
    Case("bmm", [(3, 5, 4), (3, 4, 6)], lambda g, a, b: a @ b, torch.matmul),
    Case("bmm_broadcast_lhs", [(5, 4), (2, 3, 4, 6)], lambda g, a, b: a @ b, torch.matmul),
    Case("bmm_broadcast_ones", [(2, 1, 5, 4), (1, 3, 4, 6)], lambda g, a, b: a @ b,
         torch.matmul),
    Case("bmm_transpose_b", [(2, 3, 5, 4), (2, 3, 6, 4)],
         lambda g, a, b: g.matmul(a, b, transpose_b=True),
         lambda a, b: a @ b.transpose(-1, -2)),
    Case("bmm_transpose_a_tiles", [(2, 40, 35), (2, 40, 33)],
         lambda g, a, b: g.matmul(a, b, transpose_a=True),
         lambda a, b: a.transpose(-1, -2) @ b),
    Case("bmm_epilogue", [(2, 5, 4), (2, 4, 6), (6,)], lambda g, a, b, c: (a @ b + c).relu(),
         lambda a, b, c: (a @ b + c).relu()),
]


def make_operands(case: Case, rng) -> list[np.ndarray]:
    out = []
    for shape in case.shapes:
        x = rng.standard_normal(shape).astype(np.float32)
        if case.positive:
            x = (np.abs(x) + 0.5).astype(np.float32)
        else:  # keep away from relu's kink so finite differences stay on one side of it
            x = np.where(np.abs(x) < 0.05, x + np.sign(x + 1e-9) * 0.1, x).astype(np.float32)
        out.append(x)
    return out


def build_session(case: Case, device, rng):
    operands = make_operands(case, rng)
    extras = {name: make(rng) for name, make in case.extras.items()}
    g = vkml.Graph()
    params = [g.param(f"p{i}", x.shape, init=x) for i, x in enumerate(operands)]
    extra_inputs = {name: g.input(name, v.shape, "i32" if v.dtype == np.int32 else "f32")
                    for name, v in extras.items()}
    out = case.build(g, *params, **extra_inputs)
    weights = rng.standard_normal(out.shape).astype(np.float32)
    loss = g.sum(g.mul(out, g.constant(weights)))  # a generic scalar to differentiate
    session = vkml.compile(g, loss=loss, outputs={"out": out}, device=device)
    for name, v in extras.items():
        session.set_input(name, v)
    return session, operands, extras, weights


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_and_gradient_match_torch(case: Case, device, rng):
    session, operands, extras, weights = build_session(case, device, rng)
    session.step()

    ref_params = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in operands]
    ref_extras = {k: torch.tensor(v if v.dtype == np.int32 else v.astype(np.float64))
                  for k, v in extras.items()}
    ref_out = case.reference(*ref_params, **ref_extras)
    (ref_out * torch.tensor(weights, dtype=torch.float64)).sum().backward()

    assert rel_l2(session.read("out"), ref_out.detach().numpy()) < FORWARD_TOL
    grads = [session.grad(f"p{i}") for i in range(len(operands))]
    ref_grads = [p.grad.numpy() for p in ref_params]
    for got, want in zip(grads, ref_grads):
        assert rel_l2(got, want) < GRAD_TOL
    total = np.sqrt(sum(np.sum(np.square(x, dtype=np.float64)) for x in grads))
    ref_total = np.sqrt(sum(np.sum(np.square(x)) for x in ref_grads))
    assert abs(total - ref_total) / ref_total < GRAD_TOL


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gradient_matches_finite_differences(case: Case, device, rng):
    session, operands, _, _ = build_session(case, device, rng)
    session.step()
    grads = [session.grad(f"p{i}").astype(np.float64) for i in range(len(operands))]
    direction = [rng.standard_normal(x.shape) for x in operands]
    norm = np.sqrt(sum(np.sum(d * d) for d in direction))
    direction = [d / norm for d in direction]
    eps = 2e-3

    def loss_at(sign: float) -> float:
        for i, (x, d) in enumerate(zip(operands, direction)):
            session.set_param(f"p{i}", (x + sign * eps * d).astype(np.float32))
        session.forward()
        return float(session.read("loss"))

    numeric = (loss_at(+1) - loss_at(-1)) / (2 * eps)
    analytic = sum(float(np.sum(g * d)) for g, d in zip(grads, direction))
    scale = max(abs(analytic), np.sqrt(sum(np.sum(g * g) for g in grads)) * 1e-2, 1e-3)
    assert abs(numeric - analytic) / scale < FD_TOL, (numeric, analytic)
