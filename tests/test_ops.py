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

FORWARD_TOL = 1e-5  # our bar for f32 ops (tools/PROTOCOL.md's gate is 1e-2)
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
    Case("where_greater_broadcast", [(5, 7), (7,)], lambda g, a, b: g.where(a > b, a, b),
         lambda a, b: torch.where(a > b, a, b)),
    Case("where_three_shapes", [(5, 1), (7,), (5, 7)],
         lambda g, c, a, b: g.where(g.less_equal(c, 0.2), a * 2.0, b) + c,
         lambda c, a, b: torch.where(c <= 0.2, a * 2.0, b) + c),
    Case("masks_times_values", [(5, 7), (5, 7)],
         lambda g, a, b: a * (a < 0.1) + b * g.greater_equal(b, a) - a * g.not_equal(a, a),
         lambda a, b: a * (a < 0.1) + b * (b >= a) - a * (a != a)),
    Case("where_logical", [(5, 7), (5, 7)],
         lambda g, a, b: (g.where(g.logical_and(a > 0, b < 0), a, b)
                          + g.where(g.logical_or(a > 1, (b > 1).logical_not()), b, 0.5)
                          + g.where(g.logical_xor(a > 0, b > 0), 1.0, a)),
         lambda a, b: (torch.where((a > 0) & (b < 0), a, b)
                       + torch.where((a > 1) | ~(b > 1), b, 0.5)
                       + torch.where((a > 0) ^ (b > 0), 1.0, a))),
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
    # ---- layout, indexing, norms, convolution, pooling, attention ----
    unary("sqrt", torch.sqrt, positive=True),
    unary("rsqrt", torch.rsqrt, positive=True),
    unary("square", torch.square),
    unary("abs", torch.abs),
    Case("clamp", [(6, 9)], lambda g, a: g.clamp(a, -0.5, 0.7), lambda a: a.clamp(-0.5, 0.7)),
    Case("clamp_min_only", [(6, 9)], lambda g, a: a.clamp(min=0.3), lambda a: a.clamp(min=0.3)),
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
    Case("cumsum_last", [(5, 7)], lambda g, a: g.cumsum(a), lambda a: a.cumsum(-1)),
    Case("cumsum_middle", [(3, 4, 5)], lambda g, a: g.cumsum(a, 1), lambda a: a.cumsum(1)),
    Case("amax_last", [(5, 7)], lambda g, a: g.amax(a, -1), lambda a: a.amax(-1)),
    Case("amax_middle_outer", [(3, 4, 5)], lambda g, a: g.amax(a, (0, 2), keepdims=True),
         lambda a: a.amax((0, 2), keepdim=True)),
    Case("slice", [(4, 7)], lambda g, a: g.slice(a, 1, 2, 5), lambda a: a[:, 2:5]),
    Case("pad", [(3, 4)], lambda g, a: g.pad(a, 0, 1, 2), lambda a: F.pad(a, (0, 0, 1, 2))),
    Case("concat", [(2, 3, 4), (2, 5, 4)], lambda g, a, b: g.concat([a, b], 1),
         lambda a, b: torch.cat([a, b], 1)),
    Case("concat_three_last", [(3, 2), (3, 4), (3, 1)],
         lambda g, a, b, c: g.concat([a, b, c], -1), lambda a, b, c: torch.cat([a, b, c], -1)),
    Case("split", [(3, 5)], lambda g, a: g.concat(g.split(a, [2, 3], 1)[::-1], 1),
         lambda a: torch.cat(torch.split(a, [2, 3], 1)[::-1], 1)),
    Case("permute", [(2, 3, 4)], lambda g, a: g.permute(a, (1, 2, 0)),
         lambda a: a.permute(1, 2, 0)),
    Case("upsample_nearest2x", [(2, 3, 3, 4)], lambda g, a: g.upsample_nearest(a),
         lambda a: F.interpolate(a, scale_factor=2, mode="nearest")),
    Case("embedding", [(7, 5)], lambda g, w, ids: g.embedding(ids, w),
         lambda w, ids: F.embedding(ids.long(), w),
         extras={"ids": lambda rng: rng.integers(0, 7, (2, 6)).astype(np.int32)}),
    Case("swiglu", [(4, 6), (4, 6)], lambda g, a, b: g.swiglu(a, b),
         lambda a, b: F.silu(a) * b),
    Case("rope", [(2, 3, 5, 8)], lambda g, x: g.rope(x, theta=10000.0), lambda x: rope_ref(x)),
    Case("rotate_half", [(2, 3, 6)], lambda g, x: g.rotate_half(x),
         lambda x: torch.cat([-x[..., 3:], x[..., :3]], -1)),
    Case("layer_norm", [(4, 6), (6,), (6,)], lambda g, x, w, b: g.layer_norm(x, 6, w, b),
         lambda x, w, b: F.layer_norm(x, (6,), w, b)),
    Case("layer_norm_2d", [(3, 4, 5), (4, 5), (4, 5)],
         lambda g, x, w, b: g.layer_norm(x, (4, 5), w, b),
         lambda x, w, b: F.layer_norm(x, (4, 5), w, b)),
    Case("rms_norm", [(4, 6), (6,)], lambda g, x, w: g.rms_norm(x, w, eps=1e-6),
         lambda x, w: F.rms_norm(x, (6,), w, eps=1e-6)),
    Case("group_norm", [(2, 6, 3, 3), (6,), (6,)], lambda g, x, w, b: g.group_norm(x, 3, w, b),
         lambda x, w, b: F.group_norm(x, 3, w, b)),
    Case("batch_norm_train", [(3, 4, 2, 3), (4,), (4,)],
         lambda g, x, w, b: g.batch_norm(x, weight=w, bias=b, training=True),
         lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True)),
    Case("batch_norm_eval", [(3, 4, 2, 3), (4,), (4,)],
         lambda g, x, w, b, rm, rv: g.batch_norm(x, rm, rv, w, b),
         lambda x, w, b, rm, rv: F.batch_norm(x, rm, rv, w, b),
         extras={"rm": lambda rng: rng.standard_normal(4).astype(np.float32),
                 "rv": lambda rng: rng.uniform(0.5, 2.0, 4).astype(np.float32)}),
    Case("conv2d", [(2, 3, 6, 5), (4, 3, 3, 3), (4,)],
         lambda g, x, w, b: g.conv2d(x, w, b, padding=1),
         lambda x, w, b: F.conv2d(x, w, b, padding=1)),
    Case("conv2d_stride_dilation_groups", [(2, 4, 7, 7), (6, 2, 3, 2)],
         lambda g, x, w: g.conv2d(x, w, stride=(2, 1), padding=(1, 2), dilation=(2, 1),
                                  groups=2),
         lambda x, w: F.conv2d(x, w, stride=(2, 1), padding=(1, 2), dilation=(2, 1), groups=2)),
    Case("conv2d_depthwise_stride2", [(1, 4, 6, 6), (4, 1, 3, 3)],
         lambda g, x, w: g.conv2d(x, w, stride=2, padding=1, groups=4),
         lambda x, w: F.conv2d(x, w, stride=2, padding=1, groups=4)),
    Case("conv2d_register_tiles_rows", [(2, 3, 9, 9), (5, 3, 3, 3)],
         lambda g, x, w: g.conv2d(x, w, padding=1), lambda x, w: F.conv2d(x, w, padding=1)),
    Case("conv2d_register_tiles_cols", [(1, 2, 6, 6), (33, 2, 3, 3)],
         lambda g, x, w: g.conv2d(x, w, padding=1), lambda x, w: F.conv2d(x, w, padding=1)),
    Case("conv2d_wide_input_stride2", [(1, 33, 5, 5), (2, 33, 3, 3)],
         lambda g, x, w: g.conv2d(x, w, stride=2), lambda x, w: F.conv2d(x, w, stride=2)),
    Case("conv1d", [(2, 3, 10), (4, 3, 3), (4,)],
         lambda g, x, w, b: g.conv1d(x, w, b, stride=2, padding=1),
         lambda x, w, b: F.conv1d(x, w, b, stride=2, padding=1)),
    Case("max_pool2d", [(2, 3, 6, 6)], lambda g, a: g.max_pool2d(a, 3, 2, 1),
         lambda a: F.max_pool2d(a, 3, 2, 1)),
    Case("max_pool2d_2x2", [(1, 2, 4, 6)], lambda g, a: g.max_pool2d(a, 2),
         lambda a: F.max_pool2d(a, 2)),
    Case("avg_pool2d", [(2, 3, 6, 6)], lambda g, a: g.avg_pool2d(a, 3, 2, 1),
         lambda a: F.avg_pool2d(a, 3, 2, 1)),
    Case("max_pool2d_ceil_window_longer_than_axis", [(1, 2, 1, 5)],
         lambda g, a: g.max_pool2d(a, (3, 2), ceil_mode=True),
         lambda a: F.max_pool2d(a, (3, 2), ceil_mode=True)),
    Case("global_avg_pool2d", [(2, 3, 4, 5)], lambda g, a: g.global_avg_pool2d(a),
         lambda a: F.adaptive_avg_pool2d(a, 1)),
    Case("attention_cross", [(2, 2, 4, 8), (2, 2, 5, 8), (2, 2, 5, 6)],
         lambda g, q, k, v: g.scaled_dot_product_attention(q, k, v),
         F.scaled_dot_product_attention),
    Case("attention_causal", [(1, 2, 5, 4), (1, 2, 5, 4), (1, 2, 5, 4)],
         lambda g, q, k, v: g.scaled_dot_product_attention(q, k, v, causal=True),
         lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    Case("attention_gqa_causal", [(1, 4, 5, 4), (1, 2, 5, 4), (1, 2, 5, 4)],
         lambda g, q, k, v: g.scaled_dot_product_attention(q, k, v, causal=True),
         lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                        enable_gqa=True)),
    Case("attention_mask", [(1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4)],
         lambda g, q, k, v, mask: g.scaled_dot_product_attention(q, k, v, mask=mask),
         lambda q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
         extras={"mask": lambda rng: rng.standard_normal((3, 5)).astype(np.float32)}),
    Case("flash_attention_cross", [(2, 2, 4, 8), (2, 2, 5, 8), (2, 2, 5, 6)],
         lambda g, q, k, v: g.scaled_dot_product_attention(q, k, v, fused=True),
         F.scaled_dot_product_attention),
    Case("flash_attention_causal", [(1, 2, 5, 4), (1, 2, 5, 4), (1, 2, 5, 4)],
         lambda g, q, k, v: g.scaled_dot_product_attention(q, k, v, causal=True, fused=True),
         lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    Case("flash_attention_gqa_causal_cross", [(2, 4, 5, 4), (2, 2, 7, 4), (2, 2, 7, 3)],
         lambda g, q, k, v: g.scaled_dot_product_attention(q, k, v, causal=True, scale=0.3,
                                                           fused=True),
         lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3,
                                                        enable_gqa=True)),
]


def rope_ref(x, theta=10000.0):
    """Hugging Face LLaMA's rotary embedding (rotate_half convention), positions 0..S-1."""
    length, dim = x.shape[-2:]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    emb = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq).repeat(1, 2)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * emb.cos() + rotated * emb.sin()


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


def build_session(case: Case, device, rng, caps=None):
    """The case compiled for `device`, or for `caps` (another device's capabilities, to run
    that device's kernel variants here) and bound to `device`."""
    operands = make_operands(case, rng)
    extras = {name: make(rng) for name, make in case.extras.items()}
    g = vkml.Graph()
    params = [g.param(f"p{i}", x.shape, init=x) for i, x in enumerate(operands)]
    extra_inputs = {name: g.input(name, v.shape, "i32" if v.dtype == np.int32 else "f32")
                    for name, v in extras.items()}
    out = case.build(g, *params, **extra_inputs)
    weights = rng.standard_normal(out.shape).astype(np.float32)
    loss = g.sum(g.mul(out, g.constant(weights)))  # a generic scalar to differentiate
    if caps is None:
        session = vkml.compile(g, loss=loss, outputs={"out": out}, device=device)
    else:
        from vkml.compiler.stages import lower
        from vkml.session import Session
        session = Session(lower(g, caps, loss=loss, outputs={"out": out}).plan, device)
    for name, v in extras.items():
        session.set_input(name, v)
    return session, operands, extras, weights


def case_tests(cases: list[Case]) -> tuple[Callable, Callable]:
    """The two tests of every case (against torch, against finite differences), parametrized
    over `cases`, for a test module to bind to its own names."""
    @pytest.mark.parametrize("case", cases, ids=lambda c: c.name)
    def forward_and_gradient_match_torch(case: Case, device, rng):
        check_against_torch(case, device, rng)

    @pytest.mark.parametrize("case", cases, ids=lambda c: c.name)
    def gradient_matches_finite_differences(case: Case, device, rng):
        check_finite_differences(case, device, rng)

    return forward_and_gradient_match_torch, gradient_matches_finite_differences


test_forward_and_gradient_match_torch, test_gradient_matches_finite_differences = case_tests(CASES)


def check_against_torch(case: Case, device, rng, caps=None) -> None:
    """The case's output and its operands' gradients against PyTorch's in float64."""
    session, operands, extras, weights = build_session(case, device, rng, caps)
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


def check_finite_differences(case: Case, device, rng) -> None:
    """The case's gradient along a random direction against central differences of its loss."""
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


NAN_UNARY = ["relu", "sigmoid", "tanh", "gelu", "silu", "exp", "log", "neg", "sqrt", "rsqrt",
             "square", "abs"]


def test_pointwise_ops_propagate_nan_as_torch_does(device):
    """A NaN input gives NaN wherever PyTorch gives NaN (and finite values elsewhere), so NaN
    data cannot vanish into a finite loss while corrupting parameters."""
    x = np.array([np.nan, -2.0, 0.5, 3.0, np.nan, 1.0], np.float32)
    g = vkml.Graph()
    xi = g.input("x", x.shape)
    for name in NAN_UNARY:
        g.output(name, getattr(g, name)(xi))
    g.output("clamp", g.clamp(xi, -1.0, 1.0))
    g.output("add", xi + 1.0)
    g.output("mul", g.mul(xi, xi))
    session = vkml.compile(g, device=device)
    session.set_input("x", x)
    session.forward()
    t = torch.tensor(x)
    expected = {name: getattr(torch, name, None) or getattr(F, name) for name in NAN_UNARY}
    expected["clamp"] = lambda v: v.clamp(-1.0, 1.0)
    expected["add"] = lambda v: v + 1.0
    expected["mul"] = lambda v: v * v
    for name, fn in expected.items():
        want = np.isnan(fn(t).numpy())
        assert np.array_equal(np.isnan(session.read(name)), want), name


SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -2.5, 3e38]
COMPARISONS = {"equal": torch.eq, "not_equal": torch.ne, "less": torch.lt, "less_equal": torch.le,
               "greater": torch.gt, "greater_equal": torch.ge, "logical_and": torch.logical_and,
               "logical_or": torch.logical_or, "logical_xor": torch.logical_xor}
PREDICATES = {"logical_not": torch.logical_not, "isnan": torch.isnan, "isinf": torch.isinf}


@pytest.mark.parametrize("dtype", ["f32", "i32"])
def test_comparisons_and_logic_match_torch_on_every_pair(dtype, device):
    """Every pair of special values (NaN, infinities, signed zeros, ties) through every
    comparison and logical op, as f32 masks, and `where` choosing by them: exactly torch's."""
    values = (np.array(SPECIAL, np.float32) if dtype == "f32"
              else np.array([0, 1, -1, 7, -7, 2**31 - 1, -2**31], np.int32))
    a, b = np.meshgrid(values, values, indexing="ij")
    g = vkml.Graph()
    ai, bi = g.input("a", a.shape, dtype), g.input("b", b.shape, dtype)
    for name in COMPARISONS:
        g.output(name, getattr(g, name)(ai, bi))
    for name in PREDICATES if dtype == "f32" else ("logical_not",):
        g.output(name, getattr(g, name)(ai))
    g.output("where", g.where(g.greater(ai, bi), ai, bi))
    g.output("scalar", g.less(ai, 1))  # a number becomes a constant of the tensor's dtype
    session = vkml.compile(g, device=device)
    session.set_input("a", a)
    session.set_input("b", b)
    session.forward()
    ta, tb = torch.tensor(a), torch.tensor(b)
    expected = {name: fn(ta, tb) for name, fn in COMPARISONS.items()}
    expected |= {name: fn(ta) for name, fn in PREDICATES.items() if name in session.plan.outputs}
    expected["scalar"] = ta < 1
    for name, want in expected.items():
        got = session.read(name)
        assert got.dtype == np.float32, name
        np.testing.assert_array_equal(got, want.numpy().astype(np.float32), err_msg=name)
    np.testing.assert_array_equal(session.read("where"), torch.where(ta > tb, ta, tb).numpy())


def test_mixed_dtypes_are_refused_naming_the_fix():
    g = vkml.Graph()
    x, ids = g.input("x", (3,)), g.input("ids", (3,), "i32")
    with pytest.raises(vkml.GraphError, match="cast"):
        g.less(x, ids)
    with pytest.raises(vkml.GraphError, match="cast"):
        g.less(ids, 0.5)
    with pytest.raises(vkml.GraphError, match="cast"):
        g.where(x > 0, x, ids)


@pytest.mark.parametrize("pool", ["max", "avg"])
@pytest.mark.parametrize("shape, kernel, stride, padding, ceil", [
    ((1, 1, 1, 5), (3, 2), None, 0, False),  # found by tools/fuzz.py: max_pool2d gave (1,1,0,2)
    ((1, 1, 15, 1), (2, 3), 1, (1, 0), True),  # max_pool2d (1,1,16,-1), avg_pool2d IndexError
    ((1, 1, 1, 5), (3, 2), None, 0, True),
    ((1, 1, 4, 4), 3, 2, 1, True),
])
def test_pooling_windows_refused_where_torch_refuses_them(pool, shape, kernel, stride,
                                                          padding, ceil):
    """A window that leaves no output position is a GraphError, as PyTorch's RuntimeError;
    one that fits gives torch's output shape."""
    ref = getattr(F, f"{pool}_pool2d")
    try:
        want = ref(torch.zeros(shape), kernel, stride, padding, ceil_mode=ceil).shape
    except RuntimeError:
        want = None
    g = vkml.Graph()
    x = g.input("x", shape)
    build = getattr(g, f"{pool}_pool2d")
    if want is None:
        with pytest.raises(vkml.GraphError, match="does not fit an input axis"):
            build(x, kernel, stride, padding, ceil_mode=ceil)
    else:
        assert build(x, kernel, stride, padding, ceil_mode=ceil).shape == tuple(want)


def test_batch_norm_backward_sums_twice(device):
    # Batch norm's training form has PyTorch's backward (ops/composite.py `normalized`): the
    # sums of dy and of dy * xhat give the input's, the weight's and the bias's gradients, where
    # differentiating its parts made four sums. Its values are checked against torch above.
    from vkml.compiler.stages import lower
    g = vkml.Graph()
    x = g.param("x", (2, 3, 4, 5), init=np.ones((2, 3, 4, 5), np.float32))
    y = g.batch_norm(x, weight=g.param("w", (3,), 1.0), bias=g.param("b", (3,), 0.0),
                     training=True)
    loss = g.sum(g.mul(y, g.constant(np.ones(y.shape, np.float32))))
    ops = [d.op for d in lower(g, device.caps, loss=loss).plan.dispatches if d.op]
    # forward: the mean, the variance and the loss; backward: two
    assert sum(op in ("sum", "fused_sum") for op in ops) == 5, ops


def test_gpu_reductions_read_several_terms_a_trip(device, rng):
    # On GPUs each thread of a long reduction reads several terms a trip (kernels/reduce.py,
    # unroll); lavapipe takes the CPU kernels, so that variant is checked here with a GPU's
    # capabilities: batch norm's sums in training (prologues reading the broadcast statistics,
    # forward and backward) and a maximum, 4092 terms each: 7 trips of 4 and a rest.
    import dataclasses

    from vkml.compiler.stages import lower
    from vkml.session import Session
    caps = dataclasses.replace(device.caps, device_type="discrete")
    shape = (4, 6, 33, 31)
    x = rng.standard_normal(shape).astype(np.float32)
    weights = rng.standard_normal(shape).astype(np.float32)
    g = vkml.Graph()
    px = g.param("x", shape, init=x)
    y = g.output("y", g.batch_norm(px, training=True))
    g.output("m", g.amax(px, axis=(0, 2, 3)))
    loss = g.sum(g.mul(y, g.constant(weights)))
    plan = lower(g, caps, loss=loss).plan
    assert any("rt +" in d.kernel.wgsl for d in plan.dispatches)
    session = Session(plan, device)
    session.step()
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    ty = F.batch_norm(tx, None, None, training=True)
    (ty * torch.tensor(weights, dtype=torch.float64)).sum().backward()
    assert rel_l2(session.read("y"), ty.detach().numpy()) < 1e-5
    assert rel_l2(session.grad("x"), tx.grad.numpy()) < 1e-5
    np.testing.assert_array_equal(session.read("m"), x.max(axis=(0, 2, 3)))
    session.close()

@pytest.mark.parametrize("shape, axes", [((50, 72), (0,)), ((1500, 24), (0,)),
                                         ((3, 5), (0,)), ((6000, 7), (0,)),
                                         ((4, 6, 33, 2), (0, 1)), ((20000, 3), (0,))])
def test_gpu_sums_over_leading_axes_read_along_rows(shape, axes, device, rng):
    # On GPUs sums over leading axes (bias gradients) take the column layout (kernels/reduce.py
    # _column_layout): columns side by side, rows spread over lanes, 6000 rows with the lanes
    # doubled; 3 rows keep a thread per output and 20000 the workgroup per output. A plain
    # sum, a maximum, and a bias's gradient (a fused sum with a prologue and an epilogue).
    import dataclasses

    from vkml.compiler.stages import lower
    from vkml.kernels.reduce import _column_layout
    from vkml.session import Session
    caps = dataclasses.replace(device.caps, device_type="discrete")
    x = rng.standard_normal(shape).astype(np.float32)
    weights = rng.standard_normal(shape).astype(np.float32)
    kept = shape[len(axes):]
    g = vkml.Graph()
    px = g.param("x", shape, init=x)
    b = rng.standard_normal(kept).astype(np.float32)
    bias = g.param("b", kept, init=b)
    g.output("s", g.sum(px, axis=axes))
    g.output("m", g.amax(px, axis=axes))
    loss = g.sum(g.mul(g.tanh(g.add(px, bias)), g.constant(weights)))
    plan = lower(g, caps, loss=loss).plan
    columns = [d for d in plan.dispatches if "lane = lid" in d.kernel.wgsl]
    assert len(columns) == (3 if _column_layout(shape, axes, caps) else 0), \
        [d.kernel.name for d in plan.dispatches]
    session = Session(plan, device)
    session.step()
    # f32 sums of thousands of terms in another order: within a few ulps of the magnitudes
    np.testing.assert_allclose(session.read("s"), x.astype(np.float64).sum(axis=axes),
                               rtol=0, atol=1e-6 * np.abs(x).sum(axis=axes).max())
    np.testing.assert_array_equal(session.read("m"), x.max(axis=axes))
    tx = torch.tensor(x, dtype=torch.float64)
    tbias = torch.tensor(b, dtype=torch.float64, requires_grad=True)
    (torch.tanh(tx + tbias) * torch.tensor(weights, dtype=torch.float64)).sum().backward()
    assert rel_l2(session.grad("b"), tbias.grad.numpy()) < 1e-5
    session.close()


@pytest.mark.parametrize("gpu", [False, True])
def test_abs_max_is_the_largest_magnitude_along_the_last_axis(gpu, device, rng):
    # What the backward pass's f16 products scale their gradient operands by
    # (compiler/scale.py); tiny values as gradients are, and the GPU kernel's variant too.
    import dataclasses

    from vkml.compiler.stages import lower
    from vkml.session import Session
    caps = dataclasses.replace(device.caps, device_type="discrete") if gpu else device.caps
    for shape in [(37, 300), (3, 20, 64)]:
        x = (rng.standard_normal(shape) * 1e-7).astype(np.float32)
        g = vkml.Graph()
        g.output("m", g.apply("abs_max", [g.param("x", shape, init=x)], axes=(len(shape) - 1,)))
        session = Session(lower(g, caps).plan, device)
        session.step()
        np.testing.assert_array_equal(session.read("m"), np.abs(x).max(axis=-1))
        session.close()


@pytest.mark.parametrize("fused", [False, True])
def test_causal_mask_is_added_by_the_scores_product(fused, device):
    # the composed attention and the fused one's backward add the causal mask to the scores'
    # product itself (ops/composite.py attention_scores), whose epilogue then adds it: no pass of
    # its own over the scores (SmolLM2's training step 2592 -> 2562 dispatches); their values
    # and gradients are the attention cases above
    import dataclasses

    from vkml.compiler.stages import lower
    caps = dataclasses.replace(device.caps, device_type="discrete")
    g = vkml.Graph()
    q = g.param("q", (1, 4, 16, 8))
    k, v = g.param("k", (1, 2, 16, 8)), g.param("v", (1, 2, 16, 8))
    out = g.scaled_dot_product_attention(q, k, v, causal=True, fused=fused)
    stages = lower(g, caps, loss=g.sum(g.mul(out, out)))
    scores = 4 * 16 * 16
    of_scores = [d for d, node in zip(stages.plan.dispatches, stages.nodes)
                 if node is not None and node.size == scores]
    products = [d for d in of_scores if "matmul" in d.kernel.name and "ep1" in d.kernel.wgsl]
    assert products, [d.kernel.name for d in stages.plan.dispatches]
    adds = [d.kernel.name for d in of_scores if d.kernel.name.startswith("add_")]
    assert not adds, adds


@pytest.mark.parametrize("causal,shapes", [
    # 70 queries and 45 keys: blocks of 32 queries and tiles of 32 keys end part-filled
    (False, [(1, 2, 70, 8), (1, 2, 45, 8), (1, 2, 45, 12)]),
    (True, [(2, 4, 37, 4), (2, 2, 37, 4), (2, 2, 37, 8)]),  # grouped query heads
])
def test_gpu_flash_attention_is_tiled(causal, shapes, device, rng):
    # GPUs take the tiled flash attention (forward and the backward's log-sum-exp, kernels/
    # attention.py); lavapipe takes the per-row kernels, so the tiled one is checked here with a
    # GPU's capabilities, values and gradients against float64 torch.
    import dataclasses

    from vkml.compiler.stages import lower
    from vkml.session import Session
    if device.backend_name != "vulkan":
        pytest.skip("the variants are a codegen choice; one backend is enough to check them")
    caps = dataclasses.replace(device.caps, device_type="discrete")
    operands = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    g = vkml.Graph()
    q, k, v = (g.param(n, s, init=x) for n, s, x in zip("qkv", shapes, operands))
    out = g.output("out", g.scaled_dot_product_attention(q, k, v, causal=causal, fused=True))
    weights = rng.standard_normal(out.shape).astype(np.float32)
    plan = lower(g, caps, loss=g.sum(g.mul(out, g.constant(weights)))).plan
    tiled = [d.op for d in plan.dispatches if d.kernel.name.endswith("_tiled")]
    assert sorted(tiled) == ["flash_attention", "flash_attention_lse"]
    session = Session(plan, device)
    session.step()
    ref = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in operands]
    want = F.scaled_dot_product_attention(*ref, is_causal=causal, enable_gqa=True)
    (want * torch.tensor(weights, dtype=torch.float64)).sum().backward()
    assert rel_l2(session.read("out"), want.detach().numpy()) < 1e-5
    for name, r in zip("qkv", ref):
        assert rel_l2(session.grad(name), r.grad.numpy()) < 1e-5
    session.close()


COOPERATIVE_ATTENTION = {  # q, k, v shapes, causal
    # 150 queries and keys: the last block of 64 rows and the last tile of 64 keys part-filled
    "edges": ([(1, 2, 150, 64), (1, 2, 150, 64), (1, 2, 150, 64)], False),
    "grouped_causal_narrow_values": ([(2, 4, 100, 64), (2, 2, 100, 64), (2, 2, 100, 32)], True),
    "cross_few_keys": ([(1, 3, 64, 32), (1, 3, 16, 32), (1, 3, 16, 48)], False),
}
# cases whose q, k, v are the heads' transposes of (batch, rows, heads, width) projections and
# whose output is merged back by the transpose: the kernel reads and writes those layouts
HEADS_INNER = {"edges", "grouped_causal_narrow_values"}
SWAP_HEADS = (0, 2, 1, 3)


def cooperative_attention_case(name, rng):
    """The graph of COOPERATIVE_ATTENTION[name] (output "out") and its operands, as held."""
    shapes, causal = COOPERATIVE_ATTENTION[name]
    inner = name in HEADS_INNER
    operands = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    if inner:  # held as (batch, rows, heads, width)
        operands = [x.transpose(SWAP_HEADS).copy() for x in operands]
    g = vkml.Graph()
    q, k, v = (g.param(n, x.shape, init=x) for n, x in zip("qkv", operands))
    if inner:
        q, k, v = (g.transpose(x, SWAP_HEADS) for x in (q, k, v))
    out = g.scaled_dot_product_attention(q, k, v, causal=causal)
    g.output("out", g.transpose(out, SWAP_HEADS) if inner else out)
    return g, operands


def cooperative_attention_reference(name, operands):
    """COOPERATIVE_ATTENTION[name]'s output from the operands as held (torch tensors)."""
    causal, inner = COOPERATIVE_ATTENTION[name][1], name in HEADS_INNER
    if inner:
        operands = [x.permute(SWAP_HEADS) for x in operands]
    want = F.scaled_dot_product_attention(*operands, is_causal=causal, enable_gqa=True)
    return want.permute(SWAP_HEADS) if inner else want


@pytest.mark.parametrize("name", COOPERATIVE_ATTENTION)
def test_accelerated_inference_plans_composed_attention_on_cooperative_matrices(name, device,
                                                                                 rng):
    # compiler/compose.py replaces the composed attention of an inference at precision "f16"
    # by the fused kernel on cooperative matrices (kernels/attention.py `_cooperative`) where
    # the keys are few (COOP_MAX_KEYS); a training step (its backward reads the probabilities),
    # strict precision and longer sequences keep the composition. The kernel is translated to
    # SPIR-V here; its values are checked on a GPU with cooperative matrices by
    # tests/gpu/test_accelerated.py, which says so where it cannot run them.
    import dataclasses

    from vkml.compiler.stages import lower
    from vkml.vk import compile_wgsl
    if device.backend_name != "vulkan":
        pytest.skip("a codegen choice; one backend is enough to check it")
    inner = name in HEADS_INNER
    g, _ = cooperative_attention_case(name, rng)
    out = g.outputs["out"]
    caps = dataclasses.replace(device.caps, device_type="discrete", cooperative_matrix=True,
                               shader_f16=True, subgroup_size=32, max_shared_memory_bytes=49152)

    def ops(plan):
        return [d.op for d in plan.dispatches if d.op is not None]

    stages = lower(g, caps, precision="f16")
    ((fused, node),) = zip(stages.plan.dispatches, stages.nodes)
    assert fused.op == "flash_attention" and fused.kernel.name.endswith("_c")
    assert node.attrs["heads_inner"] == (inner,) * 4  # q, k, v, the output
    compile_wgsl(fused.kernel.wgsl, fused.kernel.name)  # barriers in uniform control flow
    assert "flash_attention" not in ops(lower(g, caps).plan)
    assert "flash_attention" not in ops(lower(g, caps, loss=g.sum(out), precision="f16").plan)
    g_long = vkml.Graph()  # past COOP_MAX_KEYS keys the composition ran faster on an H200
    long_k = g_long.input("k", (1, 2, 300, 64))
    g_long.output("o", g_long.scaled_dot_product_attention(
        g_long.input("q", (1, 2, 8, 64)), long_k, long_k))
    assert "flash_attention" not in ops(lower(g_long, caps, precision="f16").plan)


@pytest.mark.parametrize("length", [1500, 2500])
def test_softmax_rows_held_in_registers_or_passed_over(length, device, rng):
    # a row of at most HELD elements a thread is held in registers (read once), a longer one is
    # read in three passes (kernels/reduce.py); lavapipe's 64-thread workgroups hold 1500
    from vkml.kernels import reduce
    x = rng.standard_normal((3, length)).astype(np.float32) * 4
    g = vkml.Graph()
    px = g.param("x", x.shape, init=x)
    g.output("s", px.softmax())
    g.output("l", px.log_softmax())
    session = vkml.compile(g, device=device)
    session.step()
    loops = ["for (var c" in d.kernel.wgsl for d in session.plan.dispatches]
    assert loops == [length > reduce.HELD * reduce.WORKGROUP] * 2
    t = torch.tensor(x, dtype=torch.float64)
    assert rel_l2(session.read("s"), t.softmax(-1).numpy()) < 1e-6
    assert rel_l2(session.read("l"), t.log_softmax(-1).numpy()) < 1e-6
    session.close()
