"""The indexing, broadcasting, reduction, einsum, convolution and resizing ops the model
importers map onto, forward and backward against PyTorch in float64 and against finite
differences, as tests/test_ops.py checks the rest."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_ops import Case, case_tests, check_against_torch, check_finite_differences

import vkml

ZERO_ROWS = np.array([[1.0], [0.0], [1.0], [0.0]], np.float32)


def ids(low: int, high: int, shape: tuple[int, ...]):
    """i32 indices drawn from [low, high) (negative ones count from the end)."""
    return lambda rng: rng.integers(low, high, shape).astype(np.int32)


def index_select(x, axis, index):
    """torch.index_select of an index of any shape with ONNX's negative indices."""
    flat = index.long().reshape(-1) % x.shape[axis]
    out = torch.index_select(x, axis, flat)
    return out.reshape(*x.shape[:axis], *index.shape, *x.shape[axis + 1:])


# (4, 5): a row with no entry, a column no row reads, a row of three
SPARSE = np.array([[0.5, 0, 0, -1.5, 0], [0, 0, 0, 0, 0], [0.25, 2.0, 0, 0, 1.0],
                   [0, 0, 0, 0.75, 0]], np.float32)

CASES = [
    Case("gather_middle_2d_indices", [(3, 5, 4)], lambda g, x, i: g.gather(x, i, 1),
         lambda x, i: index_select(x, 1, i), extras={"i": ids(-5, 5, (2, 3))}),
    Case("gather_first_axis", [(6, 4)], lambda g, x, i: g.gather(x, i, 0),
         lambda x, i: index_select(x, 0, i), extras={"i": ids(-6, 6, (7,))}),
    Case("gather_last_axis", [(2, 3, 5)], lambda g, x, i: g.gather(x, i, -1),
         lambda x, i: index_select(x, 2, i), extras={"i": ids(-5, 5, (2, 2))}),
    Case("gather_scalar_index", [(4, 6)], lambda g, x, i: g.gather(x, i, 1),
         lambda x, i: index_select(x, 1, i), extras={"i": ids(-6, 6, ())}),
    Case("gather_constant_indices", [(5, 3)],
         lambda g, x: g.gather(x, g.constant(np.array([[4, -1], [0, 2]]), "i32"), 0),
         lambda x: index_select(x, 0, torch.tensor([[4, -1], [0, 2]]))),
    Case("index_select", [(3, 7)], lambda g, x, i: g.index_select(x, 1, i),
         lambda x, i: torch.index_select(x, 1, i.long()), extras={"i": ids(0, 7, (9,))}),
    Case("index_adjacent_broadcast", [(3, 4, 5)], lambda g, x, i, j: g.index(x, [i, j]),
         lambda x, i, j: x[i.long(), j.long()],
         extras={"i": ids(-3, 3, (2, 3)), "j": ids(-4, 4, (3,))}),
    Case("index_inner_axes", [(3, 4, 5)], lambda g, x, i, j: g.index(x, [None, i, j]),
         lambda x, i, j: x[:, i.long(), j.long()],
         extras={"i": ids(-4, 4, (2,)), "j": ids(-5, 5, (2,))}),
    Case("index_apart", [(3, 4, 5)], lambda g, x, i, j: g.index(x, [i, None, j]),
         lambda x, i, j: x[i.long(), :, j.long()],
         extras={"i": ids(-3, 3, (2, 1)), "j": ids(-5, 5, (3,))}),
    Case("gather_elements", [(3, 5, 4)], lambda g, x, i: g.gather_elements(x, i, 1),
         lambda x, i: torch.gather(x, 1, i.long() % 5), extras={"i": ids(-5, 5, (2, 6, 3))}),
    Case("gather_elements_last", [(4, 6)], lambda g, x, i: g.gather_elements(x, i, -1),
         lambda x, i: torch.gather(x, -1, i.long()), extras={"i": ids(0, 6, (4, 9))}),
    Case("slice_step", [(3, 8, 2)], lambda g, x: g.slice(x, 1, 1, 8, 3),
         lambda x: x[:, 1:8:3]),
    Case("slice_step_to_the_end", [(7, 3)], lambda g, x: g.slice(x, 0, 0, 7, 2),
         lambda x: x[0:7:2]),
    Case("pad_stride", [(2, 3)], lambda g, x: g.pad(x, 1, 2, 1, stride=3),
         lambda x: F.pad(
             torch.stack([x, *[torch.zeros_like(x)] * 2], -1).reshape(2, 9)[:, :7], (2, 1))),
    Case("pad_reflect", [(2, 3, 5)], lambda g, x: g.pad(x, -1, 2, 1, mode="reflect"),
         lambda x: F.pad(x, (2, 1), mode="reflect")),
    Case("pad_replicate", [(2, 3, 5)], lambda g, x: g.pad(x, 1, 1, 2, mode="replicate"),
         lambda x: F.pad(x, (0, 0, 1, 2), mode="replicate")),
    # found by tools/fuzz.py: amounts past the axis's length were refused; torch repeats the edge
    Case("pad_replicate_past_length", [(2, 2, 3)],
         lambda g, x: g.pad(x, 1, 3, 5, mode="replicate"),
         lambda x: F.pad(x, (0, 0, 3, 5), mode="replicate")),
    Case("pad_circular", [(2, 3, 5)], lambda g, x: g.pad(x, 2, 1, 3, mode="circular"),
         lambda x: F.pad(x, (1, 3), mode="circular")),
    Case("pad_value", [(2, 3)], lambda g, x: g.pad(x, 1, 1, 2, value=1.5),
         lambda x: F.pad(x, (1, 2), value=1.5)),
    Case("pad_crop", [(2, 5)], lambda g, x: g.pad(x, 1, -1, 2),
         lambda x: F.pad(x, (-1, 2))),
    Case("flip", [(2, 3, 4)], lambda g, x: g.flip(x, (0, 2)), lambda x: torch.flip(x, (0, 2))),
    Case("roll", [(3, 2, 5)], lambda g, x: g.roll(x, (1, -2), (0, 2)),
         lambda x: torch.roll(x, (1, -2), (0, 2))),
    Case("expand", [(3, 1)], lambda g, x: g.expand(x, (2, -1, 4)),
         lambda x: x.expand(2, -1, 4)),
    Case("expand_onnx_two_way", [(3, 1)], lambda g, x: g.expand(x, (1, 5)),
         lambda x: x.expand(3, 5)),
    Case("tile", [(2, 3)], lambda g, x: g.tile(x, (2, 3)), lambda x: x.repeat(2, 3)),
    Case("tile_new_axes", [(2, 3)], lambda g, x: g.tile(x, (2, 1, 2)),
         lambda x: x.repeat(2, 1, 2)),
    Case("mean_outer_axes_keepdims", [(3, 4, 5)], lambda g, x: g.mean(x, (0, 2), keepdims=True),
         lambda x: x.mean((0, 2), keepdim=True)),
    Case("amax_all_axes", [(3, 4)], lambda g, x: g.amax(x), lambda x: x.amax()),
    Case("amin_middle_keepdims", [(3, 4, 5)], lambda g, x: g.amin(x, 1, keepdims=True),
         lambda x: x.amin(1, keepdim=True)),
    Case("amin_outer_axes", [(3, 4, 5)], lambda g, x: g.amin(x, (0, 2)),
         lambda x: x.amin((0, 2))),
    Case("logsumexp", [(3, 4, 5)], lambda g, x: g.logsumexp(x * 30.0, (1, 2)),
         lambda x: torch.logsumexp(x * 30.0, (1, 2))),
    Case("instance_norm", [(2, 3, 4, 5), (3,), (3,)],
         lambda g, x, w, b: g.instance_norm(x, w, b, eps=1e-4),
         lambda x, w, b: F.instance_norm(x, weight=w, bias=b, eps=1e-4)),
    Case("conv_transpose2d_stride2_output_padding", [(2, 3, 4, 5), (3, 4, 3, 3), (4,)],
         lambda g, x, w, b: g.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1),
         lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1)),
    Case("conv_transpose2d_groups_dilation", [(1, 4, 5, 4), (4, 3, 2, 3)],
         lambda g, x, w: g.conv_transpose2d(x, w, stride=(1, 2), padding=(0, 1), dilation=(2, 1),
                                            groups=2),
         lambda x, w: F.conv_transpose2d(x, w, stride=(1, 2), padding=(0, 1), dilation=(2, 1),
                                         groups=2)),
    *[Case(f"einsum_{equation.replace(',', '_').replace('->', '_to_').replace('...', 'e')}",
           shapes, lambda g, *xs, e=equation: g.einsum(e, *xs),
           lambda *xs, e=equation: torch.einsum(e, *xs))
      for equation, shapes in [
          ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)]),
          ("bhqk,bhkd->bhqd", [(2, 3, 4, 6), (2, 3, 6, 5)]),
          ("bij,bjk->bik", [(1, 3, 4), (2, 4, 5)]),
          ("ij->ji", [(3, 4)]),
          ("ijk->j", [(3, 4, 2)]),
          ("bi,bj->bij", [(2, 3), (2, 4)]),
          ("...ij,jk->...ik", [(2, 3, 4, 5), (5, 6)]),
          ("ijk,jil->lk", [(3, 4, 2), (4, 3, 5)]),
          ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),
          ("ij,jk", [(2, 3), (3, 4)]),
          ("bn,anm,bm->ba", [(2, 3), (4, 3, 5), (2, 5)]),
          ("ii->i", [(4, 4)]),
          ("ii", [(3, 3)]),
          ("bjij,jk->bik", [(2, 3, 4, 3), (3, 5)]),
      ]],
    Case("resample_sparse_rows_and_columns", [(2, 5, 3)],
         lambda g, x: g.resample(x, 1, SPARSE), lambda x: torch.einsum(
             "oi,bij->boj", torch.tensor(SPARSE, dtype=torch.float64), x)),
    Case("interpolate_nearest_2x", [(2, 3, 3, 4)],
         lambda g, x: g.interpolate(x, scale_factor=2),
         lambda x: F.interpolate(x, scale_factor=2, mode="nearest")),
    Case("interpolate_nearest_fractional", [(1, 2, 4, 5)],
         lambda g, x: g.interpolate(x, scale_factor=(2.5, 0.7)),
         lambda x: F.interpolate(x, scale_factor=(2.5, 0.7), mode="nearest")),
    Case("interpolate_nearest_sizes", [(1, 2, 4, 5)],
         lambda g, x: g.interpolate(x, size=(3, 7)),
         lambda x: F.interpolate(x, size=(3, 7), mode="nearest")),
    Case("interpolate_nearest_exact_1d", [(2, 3, 5)],
         lambda g, x: g.interpolate(x, size=8, mode="nearest-exact"),
         lambda x: F.interpolate(x, size=8, mode="nearest-exact")),
    Case("interpolate_bilinear_2x", [(2, 3, 3, 4)],
         lambda g, x: g.interpolate(x, scale_factor=2, mode="bilinear"),
         lambda x: F.interpolate(x, scale_factor=2, mode="bilinear")),
    Case("interpolate_bilinear_sizes_down_and_up", [(1, 2, 6, 5)],
         lambda g, x: g.interpolate(x, size=(4, 7), mode="bilinear"),
         lambda x: F.interpolate(x, size=(4, 7), mode="bilinear")),
    Case("interpolate_bilinear_align_corners", [(1, 2, 4, 5)],
         lambda g, x: g.interpolate(x, size=(7, 3), mode="bilinear", align_corners=True),
         lambda x: F.interpolate(x, size=(7, 3), mode="bilinear", align_corners=True)),
    Case("interpolate_bicubic", [(1, 2, 4, 5)],
         lambda g, x: g.interpolate(x, size=(7, 3), mode="bicubic"),
         lambda x: F.interpolate(x, size=(7, 3), mode="bicubic")),
    Case("interpolate_bicubic_align_corners", [(1, 2, 4, 5)],
         lambda g, x: g.interpolate(x, scale_factor=1.5, mode="bicubic", align_corners=True),
         lambda x: F.interpolate(x, scale_factor=1.5, mode="bicubic", align_corners=True)),
    Case("interpolate_linear_1d", [(2, 3, 6)],
         lambda g, x: g.interpolate(x, scale_factor=1.5, mode="linear"),
         lambda x: F.interpolate(x, scale_factor=1.5, mode="linear")),
    Case("max_pool2d_ceil_mode", [(2, 3, 8, 6)], lambda g, x: g.max_pool2d(x, 3, 2, ceil_mode=True),
         lambda x: F.max_pool2d(x, 3, 2, ceil_mode=True)),
    Case("max_pool2d_ceil_mode_padded", [(1, 2, 6, 5)],
         lambda g, x: g.max_pool2d(x, 2, 2, 1, ceil_mode=True),
         lambda x: F.max_pool2d(x, 2, 2, 1, ceil_mode=True)),
    Case("avg_pool2d_ceil_mode", [(2, 3, 8, 6)],
         lambda g, x: g.avg_pool2d(x, 3, 2, ceil_mode=True),
         lambda x: F.avg_pool2d(x, 3, 2, ceil_mode=True)),
    Case("avg_pool2d_without_padding_in_counts", [(1, 2, 5, 6)],
         lambda g, x: g.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
         lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False)),
    Case("avg_pool2d_ceil_mode_padded_uncounted", [(1, 2, 6, 5)],
         lambda g, x: g.avg_pool2d(x, (3, 2), (2, 2), (1, 1), ceil_mode=True,
                                   count_include_pad=False),
         lambda x: F.avg_pool2d(x, (3, 2), (2, 2), (1, 1), ceil_mode=True,
                                count_include_pad=False)),
    Case("avg_pool2d_divisor_override", [(1, 2, 4, 4)],
         lambda g, x: g.avg_pool2d(x, 2, divisor_override=3),
         lambda x: F.avg_pool2d(x, 2, divisor_override=3)),
    Case("adaptive_avg_pool2d_uneven", [(2, 3, 7, 5)],
         lambda g, x: g.adaptive_avg_pool2d(x, (3, 4)),
         lambda x: F.adaptive_avg_pool2d(x, (3, 4))),
    Case("adaptive_avg_pool2d_whole_windows", [(1, 2, 6, 4)],
         lambda g, x: g.adaptive_avg_pool2d(x, (3, 2)),
         lambda x: F.adaptive_avg_pool2d(x, (3, 2))),
    Case("adaptive_avg_pool3d_uneven", [(1, 2, 3, 5, 4)],
         lambda g, x: g.adaptive_avg_pool(x, (2, None, 3)),
         lambda x: F.adaptive_avg_pool3d(x, (2, 5, 3))),
    Case("adaptive_avg_pool1d_up", [(2, 3, 2)], lambda g, x: g.adaptive_avg_pool(x, (5,)),
         lambda x: F.adaptive_avg_pool1d(x, 5)),
    Case("max_pool3d_ceil_mode", [(1, 2, 5, 4, 5)],
         lambda g, x: g.max_pool3d(x, (2, 3, 3), 2, (1, 1, 0), ceil_mode=True),
         lambda x: F.max_pool3d(x, (2, 3, 3), 2, (1, 1, 0), ceil_mode=True)),
    Case("avg_pool3d_padded_uncounted", [(1, 2, 5, 4, 5)],
         lambda g, x: g.avg_pool3d(x, 3, 2, 1, count_include_pad=False),
         lambda x: F.avg_pool3d(x, 3, 2, 1, count_include_pad=False)),
    Case("conv3d_padded", [(1, 2, 3, 4, 4), (3, 2, 3, 3, 3), (3,)],
         lambda g, x, w, b: g.conv3d(x, w, b, 1, 1),
         lambda x, w, b: F.conv3d(x, w, b, 1, 1)),
    Case("conv3d_strided_dilated_groups", [(1, 4, 6, 7, 6), (6, 2, 2, 3, 1)],
         lambda g, x, w: g.conv3d(x, w, None, (2, 1, 2), (1, 0, 1), (2, 1, 1), 2),
         lambda x, w: F.conv3d(x, w, None, (2, 1, 2), (1, 0, 1), (2, 1, 1), 2)),
    Case("conv3d_temporal_only", [(1, 3, 5, 3, 4), (2, 3, 3, 1, 1)],
         lambda g, x, w: g.conv3d(x, w, None, (1, 1, 1), (1, 0, 0)),
         lambda x, w: F.conv3d(x, w, None, (1, 1, 1), (1, 0, 0))),
    Case("cumsum_exclusive", [(3, 5)], lambda g, x: g.cumsum(x, 1, exclusive=True),
         lambda x: x.cumsum(1) - x),
    Case("cumsum_exclusive_reverse", [(4, 3)],
         lambda g, x: g.cumsum(x, 0, reverse=True, exclusive=True),
         lambda x: x.flip(0).cumsum(0).flip(0) - x),
    Case("reduce_l2_keepdims", [(3, 4, 5)], lambda g, x: g.reduce_l2(x, -1, keepdims=True),
         lambda x: torch.linalg.vector_norm(x, 2, -1, keepdim=True)),
    # found by tools/fuzz.py: a norm of zeros had a NaN gradient (sqrt's inf times 2x = 0);
    # torch's is 0. Rows 1 and 3 are zeros.
    Case("reduce_l2_zero_rows", [(4, 5)],
         lambda g, x: g.reduce_l2(g.mul(x, g.constant(ZERO_ROWS)), -1),
         lambda x: torch.linalg.vector_norm(x * torch.tensor(ZERO_ROWS, dtype=x.dtype), 2, -1)),
]


test_forward_and_gradient_match_torch, test_gradient_matches_finite_differences = case_tests(CASES)

# Cases whose kernels differ on GPUs (the conv GEMM core and its phased input gradient, the
# reductions' column layout): run here with a discrete GPU's capabilities.
# A minimum over 40 rows takes the column layout there (too sparse a gradient for finite
# differences in f32 to check, so it is here only).
GPU_VARIANTS = [
    *[c for c in CASES if c.name in ("conv_transpose2d_stride2_output_padding",
                                     "conv_transpose2d_groups_dilation", "amin_outer_axes",
                                     "interpolate_bilinear_sizes_down_and_up")],
    Case("amin_leading_long", [(40, 6)], lambda g, x: g.amin(x, 0), lambda x: x.amin(0))]


@pytest.mark.parametrize("case", GPU_VARIANTS, ids=lambda c: c.name)
def test_gpu_variants_match_torch(case, device, rng):
    if device.backend_name != "vulkan":
        pytest.skip("the variants are a codegen choice; one backend is enough to check them")
    check_against_torch(case, device, rng, dataclasses.replace(device.caps,
                                                               device_type="discrete"))


def test_gather_refuses_float_indices():
    g = vkml.Graph()
    x, i = g.input("x", (4, 3)), g.input("i", (2,))
    with pytest.raises(vkml.GraphError, match="i32 indices"):
        g.gather(x, i, 0)


def test_gather_of_i32_data_gathers_integers(device):
    g = vkml.Graph()
    x, i = g.input("x", (5,), "i32"), g.input("i", (3,), "i32")
    g.output("y", g.gather(x, i, 0))
    s = vkml.compile(g, device=device)
    s.set_input("x", np.array([10, -20, 30, 40, 2**30], np.int32))
    s.set_input("i", np.array([4, -4, 0], np.int32))
    s.forward()
    assert s.read("y").tolist() == [2**30, -20, 10]


def test_advanced_indices_are_checked_per_axis(device):
    """x[i, j] on (3, 4): j = 4 would land inside the flat (12) range, on the next row."""
    g = vkml.Graph()
    x, i, j = g.input("x", (3, 4)), g.input("i", (2,), "i32"), g.input("j", (2,), "i32")
    g.output("y", g.index(x, [i, j]))
    session = vkml.compile(g, device=device)
    session.set_input("i", np.array([0, -3]))
    with pytest.raises(vkml.InputError, match=r"'j' holds 4 .* outside \[-4, 4\).* axis 1"):
        session.set_input("j", np.array([1, 4]))


def test_gather_indices_out_of_range_are_refused(device):
    g = vkml.Graph()
    x, i = g.input("x", (4, 3)), g.input("i", (2,), "i32")
    g.output("y", g.gather(x, i, 0))
    g.output("z", g.gather(x, i, 1))
    session = vkml.compile(g, device=device)
    with pytest.raises(vkml.InputError, match=r"'i' holds 3 .* outside \[-3, 3\).* gather"):
        session.set_input("i", np.array([-3, 3]))
    with pytest.raises(vkml.GraphError, match=r"outside \[-4, 4\)"):
        g.gather(x, g.constant(np.array([0, -5]), "i32"), 0)


@pytest.mark.parametrize("axis, keepdims", [(0, False), (1, True), (-1, False)])
def test_argmax_and_argmin_take_the_first_extreme_as_torch(axis, keepdims, device, rng):
    x = rng.integers(-2, 3, (4, 5, 6)).astype(np.float32)  # small integers: many ties
    x[1, 2, 3] = x[2, 0, 1] = x[3, 4, 0] = np.nan
    g = vkml.Graph()
    xi = g.input("x", x.shape)
    g.output("max", g.argmax(xi, axis, keepdims))
    g.output("min", g.argmin(xi, axis, keepdims))
    session = vkml.compile(g, device=device)
    session.set_input("x", x)
    session.forward()
    ref = torch.tensor(x)
    for name, fn in (("max", torch.argmax), ("min", torch.argmin)):
        got = session.read(name)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, fn(ref, axis, keepdims).numpy())


def test_einsum_refuses_what_it_cannot_do_naming_the_equation():
    g = vkml.Graph()
    x = g.input("x", (3, 4))
    with pytest.raises(vkml.GraphError, match=r"einsum 'ii->i'.*different lengths"):
        g.einsum("ii->i", x)
    with pytest.raises(vkml.GraphError, match=r"einsum 'ij,jk->ik': 2 operand terms"):
        g.einsum("ij,jk->ik", x)


def test_einsum_of_attention_scores_is_one_product_and_no_transpose():
    g = vkml.Graph()
    q, k = g.input("q", (2, 3, 4, 5)), g.input("k", (2, 3, 6, 5))
    y = g.einsum("bhqd,bhkd->bhqk", q, k)
    ops = [t.op for t in g.reachable([y]) if t.op not in ("input", "reshape")]
    assert ops == ["matmul"]


def test_nearest_upsampling_by_integers_is_a_broadcast():
    """interpolate's integer nearest upsampling builds what upsample_nearest builds (the
    existing models' plans stay as they were), other factors resample."""
    def ops(build):
        g = vkml.Graph()
        y = build(g, g.input("x", (1, 2, 3, 4)))
        return [t.op for t in g.reachable([y])]
    assert ops(lambda g, x: g.interpolate(x, scale_factor=2)) == ops(
        lambda g, x: g.upsample_nearest(x, 2))
    assert "resample" in ops(lambda g, x: g.interpolate(x, scale_factor=1.5))


@pytest.mark.parametrize("mode, coordinates, rounding, target", [
    ("linear", "asymmetric", "floor", {"scales": [1.0, 1.0, 1.5, 0.75]}),
    ("linear", "pytorch_half_pixel", "floor", {"sizes": [1, 2, 1, 9]}),
    ("linear", "half_pixel", "floor", {"sizes": [1, 2, 7, 3]}),
    ("linear", "align_corners", "floor", {"scales": [1.0, 1.0, 2.0, 2.0]}),
    ("cubic", "half_pixel", "floor", {"scales": [1.0, 1.0, 1.5, 0.6]}),
    ("cubic", "asymmetric", "floor", {"sizes": [1, 2, 9, 7]}),
    ("nearest", "half_pixel", "round_prefer_floor", {"scales": [1.0, 1.0, 1.5, 2.5]}),
    ("nearest", "asymmetric", "ceil", {"sizes": [1, 2, 3, 7]}),
    ("nearest", "align_corners", "round_prefer_ceil", {"sizes": [1, 2, 6, 4]}),
])
def test_resize_matches_onnxruntime(mode, coordinates, rounding, target, device, rng):
    """ONNX Resize's modes against onnxruntime (forward; gradients by finite differences)."""
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper
    x = rng.standard_normal((1, 2, 4, 5)).astype(np.float32)
    key, values = next(iter(target.items()))
    inputs = ["x", "", key] if key == "scales" else ["x", "", "", key]
    node = helper.make_node("Resize", inputs, ["y"], mode=mode,
                            coordinate_transformation_mode=coordinates, nearest_mode=rounding)
    init = (helper.make_tensor(key, TensorProto.FLOAT if key == "scales" else TensorProto.INT64,
                               [4], values))
    model = helper.make_model(helper.make_graph(
        [node], "resize", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [init]),
        opset_imports=[helper.make_opsetid("", 19)], ir_version=9)  # older onnxruntimes read it
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]

    spatial = {("scale" if key == "scales" else "size"): values[2:]}
    case = Case(f"resize_{mode}_{coordinates}", [x.shape],
                lambda g, p: g.resize(p, mode=mode, coordinate_mode=coordinates,
                                      nearest_mode=rounding, **spatial), None)
    g = vkml.Graph()
    y = case.build(g, g.input("x", x.shape))
    g.output("y", y)
    session = vkml.compile(g, device=device)
    session.set_input("x", x)
    session.forward()
    np.testing.assert_allclose(session.read("y"), want, rtol=1e-5, atol=1e-6)
    check_finite_differences(case, device, rng)


def test_pad_with_infinity_leaves_maxima_alone(device, rng):
    x = rng.standard_normal((3, 4)).astype(np.float32)
    g = vkml.Graph()
    xi = g.input("x", x.shape)
    padded = g.output("padded", g.pad(xi, 1, 1, 2, value=-np.inf))
    g.output("max", g.amax(padded, 1))
    session = vkml.compile(g, device=device)
    session.set_input("x", x)
    session.forward()
    np.testing.assert_array_equal(session.read("padded"),
                                  F.pad(torch.tensor(x), (1, 2), value=-np.inf).numpy())
    np.testing.assert_array_equal(session.read("max"), x.max(1))


def test_cumsum_of_i32_counts_as_torch_does(device):
    """An i32 running count (RoBERTa's position ids: cumsum of a mask of its token ids) stays
    i32, exact, and wraps past 2**31 as torch's int32 does."""
    g = vkml.Graph()
    x = g.input("x", (3, 6), "i32")
    g.output("y", g.cumsum(x, 1))
    g.output("r", g.cumsum(x, 0, reverse=True, exclusive=True))
    s = vkml.compile(g, device=device)
    value = np.random.default_rng(0).integers(-5, 6, (3, 6)).astype(np.int32)
    value[1, :2] = 2**31 - 1  # the sum wraps
    s.set_input("x", value)
    s.forward()
    t = torch.from_numpy(value)
    assert s.read("y").dtype == np.int32
    np.testing.assert_array_equal(s.read("y"), torch.cumsum(t, 1, dtype=torch.int32).numpy())
    np.testing.assert_array_equal(
        s.read("r"), (t.flip(0).cumsum(0, dtype=torch.int32).flip(0) - t).numpy())


def test_concat_of_many_inputs_stays_within_the_binding_limit(device):
    """More inputs than a kernel may bind (an exported T5 concatenates 44) are concatenated in
    groups: values and gradients as torch.cat's."""
    from vkml.ops.indexing import CONCAT_INPUTS
    count = 3 * CONCAT_INPUTS + 2
    parts = [np.random.default_rng(k).standard_normal((2, k % 3 + 1)).astype(np.float32)
             for k in range(count)]
    g = vkml.Graph()
    params = [g.param(f"p{k}", part.shape, part) for k, part in enumerate(parts)]
    out = g.output("y", g.concat(params, 1))
    weights = np.random.default_rng(99).standard_normal(out.shape).astype(np.float32)
    loss = g.sum(g.mul(out, g.constant(weights)))
    s = vkml.compile(g, loss=loss, outputs={"y": out}, device=device)
    s.step()
    ts = [torch.tensor(p, dtype=torch.float64, requires_grad=True) for p in parts]
    ref = torch.cat(ts, 1)
    (ref * torch.tensor(weights, dtype=torch.float64)).sum().backward()
    assert np.allclose(s.read("y"), ref.detach().numpy(), atol=1e-6)
    for k, t in enumerate(ts):
        assert np.allclose(s.grad(f"p{k}"), t.grad.numpy(), atol=1e-6), k
    assert max(len(d.kernel.access) for d in s.plan.dispatches) <= CONCAT_INPUTS + 1


@pytest.mark.parametrize("start, stop, step", [(-101, -29, 1), (-3, 200, 2), (5, -1, 3),
                                               (-200, 4, 1)])
def test_slice_bounds_are_pythons(start, stop, step, device):
    """Found by tools/fuzz.py: negative bounds (and bounds past the axis) were refused, where
    Python's and torch's slicing count them from the end and clip them; an empty slice is
    still refused, naming it."""
    x = np.arange(130, dtype=np.float32)
    g = vkml.Graph()
    y = g.output("y", g.slice(g.input("x", x.shape), 0, start, stop, step))
    with vkml.compile(g, device=device) as session:
        session.set_input("x", x)
        session.forward()
        np.testing.assert_array_equal(session.read("y"), torch.from_numpy(x)[start:stop:step])
    assert y.shape == x[start:stop:step].shape
    with pytest.raises(vkml.GraphError, match="empty"):
        g.slice(y, 0, -1, -2)


@pytest.mark.parametrize("a, b", [((4,), (4, 3)), ((2, 4, 3), (3,)), ((5,), (5,)),
                                  ((4,), (2, 4, 3))])
def test_matmul_of_vectors_is_torchs(a, b, device):
    """Found by tools/fuzz.py: a rank-1 operand was refused (torch.matmul takes it as a row on
    the left, a column on the right, and drops that axis)."""
    rng = np.random.default_rng(0)
    xa, xb = (rng.standard_normal(s).astype(np.float32) for s in (a, b))
    g = vkml.Graph()
    pa, pb = g.param("a", a, init=xa), g.param("b", b, init=xb)
    y = g.output("y", g.matmul(pa, pb))
    ta, tb = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (xa, xb))
    want = torch.matmul(ta, tb)
    want.sum().backward()
    with vkml.compile(g, loss=g.sum(y), device=device) as session:
        session.step()
        np.testing.assert_allclose(session.read("y"), want.detach().numpy(), rtol=1e-5,
                                   atol=1e-5)
        for name, leaf in (("a", ta), ("b", tb)):
            np.testing.assert_allclose(session.grad(name), leaf.grad.numpy(), rtol=1e-5,
                                       atol=1e-5)
