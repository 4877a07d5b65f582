"""Both variants of the GEMM core on the device at hand, for matmul and for the three
convolution kernels: codegen picks workgroup-memory tiles for GPUs and direct reads for CPU
drivers, so on lavapipe the GPU variant would otherwise go untested here."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import rel_l2

import vkml
from vkml.compiler.stages import lower
from vkml.kernels import conv_cpu
from vkml.session import Session

CASES = {  # name: (a shape, b shape, transpose_a, transpose_b)
    "nn_edges": ((20, 24), (24, 18), False, False),
    "nt": ((20, 24), (18, 24), False, True),
    "tn": ((24, 20), (24, 18), True, False),
    "tt_register_tile_2x2": ((40, 40), (36, 40), True, True),
    "batched_broadcast": ((3, 20, 17), (17, 18), False, False),
    # a long sum over few output tiles: partial sums on GPUs (compiler/split.py), then their sum
    # with the epilogue
    "split_k": ((40, 3000), (24, 3000), False, True),
}


@pytest.mark.parametrize("device_type", ["discrete", "cpu"])
@pytest.mark.parametrize("name", CASES)
def test_matmul_variant_matches_numpy(name, device_type, device, rng):
    if device.backend_name != "vulkan":
        pytest.skip("the variants are a codegen choice; one backend is enough to check them")
    a_shape, b_shape, ta, tb = CASES[name]
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    g = vkml.Graph()
    pa, pb = g.param("a", a_shape, init=a), g.param("b", b_shape, init=b)
    g.output("c", g.matmul(pa, pb, transpose_a=ta, transpose_b=tb).relu())  # with an epilogue
    caps = dataclasses.replace(device.caps, device_type=device_type)
    session = Session(lower(g, caps).plan, device)
    session.step()
    a64 = np.swapaxes(a, -1, -2) if ta else a
    b64 = np.swapaxes(b, -1, -2) if tb else b
    expected = np.maximum(a64.astype(np.float64) @ b64.astype(np.float64), 0)
    staged = any("var<workgroup>" in d.kernel.wgsl for d in session.plan.dispatches)
    assert staged == (device_type != "cpu")
    if name == "split_k" and device_type != "cpu":
        assert [d.op for d in session.plan.dispatches] == ["matmul", "fused_sum"]
    assert rel_l2(session.read("c"), expected) < 1e-5


CONVS = {  # name: (x shape, weight shape, stride, padding, dilation, groups)
    "3x3_pad": ((2, 3, 9, 7), (5, 3, 3, 3), 1, 1, 1, 1),
    "strided_grouped_dilated": ((2, 4, 11, 10), (6, 2, 3, 2), 2, (1, 2), (2, 1), 2),
    "1x1": ((2, 8, 5, 5), (4, 8, 1, 1), 1, 0, 1, 1),
    # images of a multiple of 4 pixels: on GPUs every operand but the input gradient's weight
    # is read 4 elements at a time (gemm.indexed)
    "1x1_wide": ((3, 8, 4, 6), (12, 8, 1, 1), 1, 0, 1, 1),
    # 4096 products per weight element over few output tiles: on GPUs the weight gradient is
    # computed as partial sums over splits of them (compiler/split.py)
    "split_weight_grad": ((4, 2, 32, 32), (3, 2, 3, 3), 1, 1, 1, 1),
    # few pixels, many channels: the forward splits on GPUs
    "split_forward": ((1, 256, 4, 4), (16, 256, 3, 3), 1, 1, 1, 1),
    # strided over images the stride divides: on GPUs the input gradient is one product per
    # phase of the stride and tap that reaches it (kernels/conv.py `phased`)
    "phased_3x3": ((2, 4, 8, 6), (6, 4, 3, 3), 2, 1, 1, 1),
    "phased_1x1": ((2, 8, 6, 4), (4, 8, 1, 1), 2, 0, 1, 1),  # three phases without any tap
    "phased_uneven_grouped": ((2, 4, 6, 9), (6, 2, 3, 4), (2, 3), (1, 2), 1, 2),
    # many output channels over few pixels: the phased input gradient splits its sums too
    "phased_split": ((1, 4, 4, 4), (256, 4, 3, 3), 2, 1, 1, 1),
}
PHASED = {"phased_3x3", "phased_1x1", "phased_uneven_grouped", "phased_split"}


# "cpu_short_loops": a CPU driver whose loop limit (1 here) the CPU kernels' channel loops
# exceed, so the GEMM core's direct variant runs, its sums split to fit the limit
@pytest.mark.parametrize("name,device_type",
                         [(n, t) for n in CONVS for t in ("discrete", "cpu")]
                         + [(n, "cpu_short_loops") for n in ("3x3_pad", "strided_grouped_dilated")])
def test_conv_variant_and_gradients_match_torch(name, device_type, device, rng):
    if device.backend_name != "vulkan":
        pytest.skip("the variants are a codegen choice; one backend is enough to check them")
    x_shape, w_shape, stride, padding, dilation, groups = CONVS[name]
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    g = vkml.Graph()
    px, pw = g.param("x", x_shape, init=x), g.param("w", w_shape, init=w)
    y = g.output("y", g.conv2d(px, pw, stride=stride, padding=padding, dilation=dilation,
                               groups=groups))
    weights = rng.standard_normal(y.shape).astype(np.float32)
    loss = g.sum(g.mul(y, g.constant(weights)))
    caps = dataclasses.replace(device.caps, device_type=device_type.removesuffix("_short_loops"))
    if device_type == "cpu_short_loops":
        caps = dataclasses.replace(caps, max_loop_iterations=1)
    stages = lower(g, caps, loss=loss)
    session = Session(stages.plan, device)
    session.step()
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    tw = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    ty = F.conv2d(tx, tw, stride=stride, padding=padding, dilation=dilation, groups=groups)
    (ty * torch.tensor(weights, dtype=torch.float64)).sum().backward()
    kinds = {d.op for d in session.plan.dispatches if d.op is not None}
    assert {"conv2d", "conv2d_input_grad", "conv2d_weight_grad"} <= kinds
    split = {node.op for node in stages.nodes
             if node is not None and node.attrs.get("splits", 1) > 1}
    # a phased input gradient sums each tap into a partial sum of its own where a phase has
    # several (not at 1x1)
    expected = {"split_weight_grad": {"conv2d_weight_grad"}, "split_forward": {"conv2d"},
                **dict.fromkeys(PHASED - {"phased_1x1"}, {"conv2d_input_grad"})}.get(name, set())
    if device_type == "cpu_short_loops":
        expected = {"conv2d", "conv2d_input_grad", "conv2d_weight_grad"}
    assert split == (set() if device_type == "cpu" else expected)
    own = {"conv2d": conv_cpu.generate_conv2d, "conv2d_weight_grad":
           conv_cpu.generate_conv2d_weight_grad, "conv2d_input_grad":
           conv_cpu.generate_conv2d_input_grad}
    for d, node in zip(stages.plan.dispatches, stages.nodes):
        if d.op in own and node.attrs.get("splits", 1) == 1:
            assert (d.kernel.wgsl == own[d.op](node, caps).wgsl) == (device_type == "cpu")
            assert ("var<workgroup>" in d.kernel.wgsl) == (device_type == "discrete" or (
                device_type == "cpu" and d.op == "conv2d_weight_grad"))
    phased = {"let ry = " in d.kernel.wgsl for d in session.plan.dispatches
              if d.op is not None and d.op == "conv2d_input_grad"}
    assert phased == {name in PHASED and device_type == "discrete"}
    if name == "1x1_wide":
        # (vec4 inputs, vec4 output): the outputs run along memory in fours too (24 pixels an
        # image, 8 taps a weight row), so GPUs store four at once (gemm.WideStore)
        wide = {d.op: (d.kernel.wgsl.count("in0: array<vec4<f32>>")
                            + d.kernel.wgsl.count("in1: array<vec4<f32>>"),
                            d.kernel.wgsl.count("out: array<vec4<f32>>"))
                for d in session.plan.dispatches
                if d.op is not None and d.op.startswith("conv2d")}
        assert wide == ({"conv2d": (2, 1), "conv2d_input_grad": (1, 1),
                         "conv2d_weight_grad": (2, 1)}
                        if device_type == "discrete" else dict.fromkeys(wide, (0, 0)))
    assert rel_l2(session.read("y"), ty.detach().numpy()) < 1e-5
    assert rel_l2(session.grad("x"), tx.grad.numpy()) < 1e-5
    assert rel_l2(session.grad("w"), tw.grad.numpy()) < 1e-5


def with_cooperative_matrices(device, **changes):
    """This device's capabilities as a discrete GPU's with cooperative matrices (lavapipe has
    none: kernels made for them are generated and translated here, not run)."""
    return dataclasses.replace(device.caps, device_type="discrete", cooperative_matrix=True,
                               shader_f16=True, **changes)


def test_accelerated_mode_takes_cooperative_tiles_only_for_large_products(device):
    # measured on an H200 (tools/KERNELS.md, v3, v7, v9, v10): staged f32 was as fast or faster
    # below gemm.COOP_MIN in any dimension (for matmuls below gemm.COOP_MIN_MATMUL's rows and
    # columns, or over a shorter depth), so precision="f16" changes nothing there
    from vkml.kernels import gemm, matmul
    caps = with_cooperative_matrices(device, precision="f16")
    strict = dataclasses.replace(caps, precision="f32")
    for outputs, depth in ((gemm.COOP_MIN, gemm.COOP_MIN), gemm.COOP_MIN_MATMUL):
        least = (outputs, depth)
        assert isinstance(gemm.choose(outputs, outputs, depth, 1, caps, coop_min=least),
                          gemm.CoopTiling)
        assert not isinstance(gemm.choose(outputs, outputs, depth, 1, strict, coop_min=least),
                              gemm.CoopTiling)
        for m, n, k in [(outputs // 2, outputs, depth), (outputs, outputs // 2, depth),
                        (outputs, outputs, depth // 2), (32, 32, 32)]:
            assert (gemm.choose(m, n, k, 1, caps, coop_min=least)
                    == gemm.choose(m, n, k, 1, strict, coop_min=least)), (m, n, k)
    # Whisper's attention: values (64 columns, 1500 deep) on cooperative tiles, and the 64-deep
    # scores too, as a product stored straight to memory (matmul.COOP_MIN_DIRECT_DEPTH), on
    # 64 x 64 tiles (gemm's SHALLOW); f32 in the backward pass (scaled operands) and with an
    # epilogue (a mask added by the rewrite stage)
    g = vkml.Graph()
    p = g.param("p", (6, 1500, 1500))
    v, k = g.param("v", (6, 1500, 64)), g.param("k", (6, 1500, 64))
    scores = g.matmul(v, k, transpose_b=True)
    tiling = {name: matmul.generate(product, caps).name.rsplit("_", 1)[-1]
              for name, product in (("values", g.matmul(p, v)), ("scores", scores))}
    assert tiling["values"].startswith("c") and tiling["scores"] == "c64x64k32f2x2", tiling
    backward = dataclasses.replace(caps, scaled_operands=True)
    assert isinstance(matmul.choose(scores, backward), gemm.Tiling)
    g.output("masked", g.add(scores, g.constant(np.zeros((1500, 1500), np.float32))))
    stages = lower(g, caps)
    fused = [(d, node) for d, node in zip(stages.plan.dispatches, stages.nodes)
             if "matmul" in d.kernel.name]
    assert fused and all("epilogue" in node.attrs and "_s" in d.kernel.name
                         for d, node in fused), [d.kernel.name for d, _ in fused]
    # Whisper's FFN down projection: cooperative as a matmul, f32 as a convolution's GEMM
    g = vkml.Graph()
    product = g.matmul(g.param("a", (1500, 1536)), g.param("b", (1536, 384)))
    assert "_c64x64" in matmul.generate(product, caps).name
    assert not isinstance(gemm.choose(1500, 384, 1536, 1, caps), gemm.CoopTiling)
    # a device with less workgroup memory gets the largest cooperative tile that fits in it
    little = dataclasses.replace(caps, max_shared_memory_bytes=16384)
    roomy = dataclasses.replace(caps, max_shared_memory_bytes=49152)  # an H200's
    huge = 2 * gemm.COOP_MIN  # the largest tiles fill the device
    assert gemm.choose(huge, huge, huge, 1, little) == gemm.CoopTiling(2, 2, 2, 2)
    assert gemm.choose(huge, huge, huge, 1, roomy) == gemm.COOP[0] != gemm.CoopTiling(2, 2, 2, 2)


def test_a_product_that_would_leave_large_tiles_half_idle_takes_tiles_of_half_the_outputs(device):
    # ResNet-50's stem convolution: 50176 pixels by 64 channels fills the GPU with 128 x 128
    # tiles, half of each idle; 128 x 64 ones cover it exactly. SmolLM2's LM-head gradient
    # (576 columns: 10% of 128 x 128 tiles idle) keeps them.
    from vkml.kernels import gemm
    caps = dataclasses.replace(device.caps, device_type="discrete",
                               max_shared_memory_bytes=49152, max_workgroup_invocations=1024)
    stem = gemm.choose(4 * 112 * 112, 64, 3 * 7 * 7, 1, caps)
    assert (stem.bm, stem.bn) == (128, 64), stem
    head = gemm.choose(49152, 576, 128, 1, caps, plain=True)
    assert (head.bm, head.bn) == (128, 128), head
    square = gemm.choose(4096, 4096, 512, 1, caps, plain=True)
    assert (square.bm, square.bn) == (128, 128), square


def test_cooperative_tiles_store_plain_products_straight_to_memory(device):
    # gemm.PlainStore: in a product stored as computed (no epilogue) the workgroups whose tile
    # lies inside C store each fragment straight there (4096^3 203 -> 216 TFLOP/s on an H200,
    # tools/KERNELS.md v11); edge tiles, and products with an epilogue, go through workgroup
    # memory. The kernels are translated to SPIR-V here; tests/gpu/test_accelerated.py runs
    # both paths where there are cooperative matrices (lavapipe has none).
    from vkml.vk import compile_wgsl
    caps = with_cooperative_matrices(device)

    def planned(relu: bool, rows: int = 1500):
        g = vkml.Graph()
        product = g.matmul(g.param("a", (rows, 384)), g.param("b", (384, 1024)))
        g.output("c", g.relu(product) if relu else product)
        (kernel,) = [d.kernel for d in lower(g, caps, precision="f16").plan.dispatches]
        compile_wgsl(kernel.wgsl, kernel.name)  # barriers in uniform control flow only
        return kernel

    plain, fused, divided = planned(False), planned(True), planned(False, rows=1024)
    assert "_c" in plain.name and "coopStoreT(acc0_0, &mat_c[" in plain.wgsl
    assert "coopStoreT(acc0_0, &Cs[" in plain.wgsl  # 1500 rows: the last tiles' path
    assert "_c" in fused.name and "&mat_c[" not in fused.wgsl
    # tiles that divide C (1024 x 1024: every cooperative tiling does) need no other path
    assert "coopStoreT(acc0_0, &mat_c[" in divided.wgsl and "&Cs[" not in divided.wgsl


def test_backward_products_scale_their_operands_on_cooperative_tiles(device):
    # Gradients often lie far below f16's smallest normal (Whisper's attention gradients around
    # 1e-7), so the backward pass's cooperative products scale the rows of a gradient operand
    # by powers of two first, from its largest magnitudes (compiler/scale.py), and undo it as
    # they store; before this the whole backward pass stayed f32. Convolutions' gradients stay
    # f32. Translated to SPIR-V here; tests/gpu/test_accelerated.py runs such products where
    # there are cooperative matrices (lavapipe has none).
    from vkml.vk import compile_wgsl
    caps = with_cooperative_matrices(device, max_shared_memory_bytes=49152)
    g = vkml.Graph()
    x = g.input("x", (1, 256, 48, 48))
    h = g.conv2d(x, g.param("w", (2048, 256, 3, 3)), padding=1)
    y = g.matmul(g.reshape(h, (2048, 2304)), g.param("v", (512, 2304)), transpose_b=True)
    stages = lower(g, caps, loss=g.mean(g.square(y)), precision="f16")
    plan = stages.plan
    kernels = {(d.phase, d.op if d.op is not None else "update"): d.kernel
               for d in plan.dispatches}
    assert "_c" in kernels["forward", "matmul"].name  # cooperative, unscaled
    assert "_scaled" not in kernels["forward", "matmul"].name
    assert "_c" in kernels["forward", "conv2d"].name
    # dH = dY V: dY's rows scale A's rows; dV = dY^T H: dY's rows run along the sum
    assert "abs_max" in kernels["backward", "abs_max"].name
    products = [(d, node) for d, node in zip(plan.dispatches, stages.nodes)
                if d.phase == "backward" and d.op == "matmul"]
    modes = sorted(node.attrs["scales"] for _, node in products)
    assert modes == [("depth", None), ("rows", None)], modes
    for d, _ in products:
        assert d.kernel.name.endswith("_scaled") and "a_scale[a_scale_base" in d.kernel.wgsl
        assert "ldexp(Cs[" in d.kernel.wgsl and "&mat_c[" not in d.kernel.wgsl  # undone
        compile_wgsl(d.kernel.wgsl, d.kernel.name)
    weight_grad = kernels["backward", "conv2d_weight_grad"].name  # 2048 x 2304 x 2304: f32
    assert weight_grad.rsplit("_", 1)[-1].startswith("s"), weight_grad
    # x used twice: its gradient's second product adds the first in an epilogue, whose input
    # is bound after the magnitudes; the weights' gradients scale B along the sum
    g = vkml.Graph()
    x = g.param("x", (512, 384))
    y = g.add(g.matmul(x, g.param("w1", (384, 384))), g.matmul(x, g.param("w2", (384, 384))))
    stages = lower(g, caps, loss=g.mean(g.square(g.relu(y))), precision="f16")
    backward = [(d, node) for d, node in zip(stages.plan.dispatches, stages.nodes)
                if d.phase == "backward" and d.op in ("matmul", "fused_matmul")]
    ((fused, fused_node),) = [(d, node) for d, node in backward if d.op == "fused_matmul"]
    assert fused_node.attrs["scales"] == ("rows", None) and len(fused_node.inputs) == 4
    assert fused.kernel.wgsl.index("a_scale") < fused.kernel.wgsl.index("ep1")
    assert {node.attrs["scales"] for _, node in backward} == {("rows", None), (None, "depth")}
    for d, _ in backward:
        compile_wgsl(d.kernel.wgsl, d.kernel.name)


def test_split_products_are_tiled_as_the_split_stage_planned(device):
    # the split stage counts its workgroups with the unsplit product's tiling; lowering once
    # chose again over the split layers and took 128 x 128 tiles half empty at n = 64 (Whisper's
    # attention times values, 2x slower on the H200: tools/KERNELS.md, v4). Here ResNet-50's
    # first 3x3 convolution, 64 output channels: only planned, never run.
    from vkml.kernels import gemm
    caps = dataclasses.replace(device.caps, device_type="discrete")
    g = vkml.Graph()
    x = g.input("x", (4, 64, 56, 56))
    w = g.input("w", (64, 64, 3, 3))
    g.output("y", g.conv2d(x, w, padding=1))
    kernels = [d.kernel.name for d in lower(g, caps).plan.dispatches if d.op == "conv2d"]
    planned = gemm.choose(4 * 56 * 56, 64, 64 * 9, 1, caps)
    assert planned != gemm.choose(4 * 56 * 56, 64, 64 * 9, 3, caps)  # what choosing again gives
    assert len(kernels) == 1 and kernels[0].startswith("conv2d_3x"), kernels  # three splits
    assert kernels[0].endswith(f"_{planned}"), (kernels, planned)


def test_pointwise_convolutions_are_tiled_as_matmuls(device):
    # a 1x1 convolution over images of a multiple of 4 pixels is a product of plain matrices
    # (kernels/conv.py `plain`): tiled and split as a matmul of its shape is (32 x 32 tiles where
    # 64 x 64 ones would not fill the GPU; ResNet-50 3.28 -> 3.04 ms inference on an H200,
    # tools/KERNELS.md v8); a 3x3 one, or one over 7 x 7 pixels, keeps the convolutions' rule.
    from vkml.kernels import gemm
    caps = dataclasses.replace(device.caps, device_type="discrete")

    def planned(x_shape, w_shape, padding=0):
        g = vkml.Graph()
        y = g.conv2d(g.param("x", x_shape), g.param("w", w_shape), padding=padding)
        loss = g.sum(g.mul(y, y))
        return {d.op: d.kernel.name for d in lower(g, caps, loss=loss).plan.dispatches
                if d.op.startswith("conv2d")}

    n, c, o, side = 4, 256, 64, 14  # ResNet-50's 1x1 reduction at 14 x 14: m = 784 pixels
    kernels = planned((n, c, side, side), (o, c, 1, 1))
    pixels = n * side * side
    shapes = {"conv2d": (pixels, o, c), "conv2d_input_grad": (pixels, c, o),
              "conv2d_weight_grad": (o, c, pixels)}
    for op, (m, cols, depth) in shapes.items():
        as_matmul = gemm.choose(m, cols, depth, 1, caps, plain=True)
        assert as_matmul != gemm.choose(m, cols, depth, 1, caps), op  # the rules differ here
        assert kernels[op].endswith(f"_{as_matmul}"), (op, kernels[op], as_matmul)
    for x_shape, w_shape, padding in [((n, c, side, side), (o, c, 3, 3), 1),
                                      ((n, c, 7, 7), (o, c, 1, 1), 0)]:
        kernels = planned(x_shape, w_shape, padding)
        assert all("s32x32" not in name for name in kernels.values()), kernels


@pytest.mark.parametrize("device_type", ["discrete", "cpu"])
@pytest.mark.parametrize("shape,stores_checked,loads_checked", [
    ((2, 64, 32, 64), False, False), ((2, 64, 32, 60), True, True),
    ((2, 60, 32, 64), True, True), ((2, 64, 24, 64), False, True)])
def test_bounds_checks_only_where_tiles_leave_an_edge(shape, stores_checked, loads_checked,
                                                      device_type, device, rng):
    # gemm.Edges: where the tiles divide rows, columns and depth the kernel loads and stores
    # unchecked; one extent off the tiles brings its checks back, and the result is right
    # either way
    z, m, k, n = shape
    a = rng.standard_normal((z, m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    g = vkml.Graph()
    g.output("c", g.matmul(g.param("a", a.shape, init=a), g.param("b", b.shape, init=b)))
    caps = dataclasses.replace(device.caps, device_type=device_type)
    session = Session(lower(g, caps).plan, device)
    session.step()
    (kernel,) = [d.kernel for d in session.plan.dispatches]
    assert ("if (true)" not in kernel.wgsl) == stores_checked, kernel.wgsl
    loads = re.search(r"if \((?:[ab]i\d+ <|kn \+)", kernel.wgsl) is not None
    assert loads == (loads_checked and device_type != "cpu"), kernel.wgsl  # direct: clamped
    assert rel_l2(session.read("c"), a.astype(np.float64) @ b.astype(np.float64)) < 1e-5
    session.close()


def test_the_largest_tiles_only_where_they_pad_the_matrix_no_more(device):
    # 256 x 128 f32 tiles beat 128 x 128 ones at 4096^3 on an H200 and lost on Whisper's 64-deep
    # attention scores (tools/KERNELS.md v11); a product of 576 rows would pad to 768 with them
    # against 640, and keeps 128 x 128
    from vkml.kernels import gemm
    caps = dataclasses.replace(device.caps, device_type="discrete")
    largest, next_largest = gemm.STAGED[:2]
    assert (largest.bm, largest.bn, next_largest.bm, next_largest.bn) == (256, 128, 128, 128)
    assert gemm.choose(4096, 4096, 4096, 1, caps) == largest
    assert gemm.choose(49152, 576, 1024, 1, caps) == largest
    assert gemm.choose(576, 49152, 1024, 1, caps) == next_largest
    assert gemm.choose(1500, 1500, 64, 6, caps) == next_largest
    assert gemm.choose(128, 49152, 1024, 1, caps) == next_largest


def test_wide_operands_bind_on_every_backend(device, rng):
    # operands read four elements at a time and a result stored four at a time are bound as
    # arrays of vec4 (gemm.indexed, gemm.WideStore); WebGPU checks a binding's size against its
    # type, so the GPU variant runs on both backends here
    a = rng.standard_normal((20, 24)).astype(np.float32)
    b = rng.standard_normal((40, 24)).astype(np.float32)
    g = vkml.Graph()
    g.output("c", g.matmul(g.param("a", a.shape, init=a), g.param("b", b.shape, init=b),
                           transpose_b=True))
    caps = dataclasses.replace(device.caps, device_type="discrete")
    session = Session(lower(g, caps).plan, device)
    session.step()
    assert any(d.kernel.wgsl.count("array<vec4<f32>>") == 3 for d in session.plan.dispatches)
    assert rel_l2(session.read("c"), a.astype(np.float64) @ b.T.astype(np.float64)) < 1e-5
    session.close()


def test_matmul_epilogue_stores_four_columns_at_once(device, rng):
    # rows of a multiple of 4 columns: GPUs store four outputs at once (gemm.WideStore), each
    # through the fused epilogue with its own column index (a bias read along the columns, a
    # term read along the rows, batched)
    a = rng.standard_normal((2, 20, 24)).astype(np.float32)
    b = rng.standard_normal((24, 36)).astype(np.float32)
    bias = rng.standard_normal(36).astype(np.float32)
    rows = rng.standard_normal((20, 1)).astype(np.float32)
    g = vkml.Graph()
    product = g.matmul(g.param("a", a.shape, init=a), g.param("b", b.shape, init=b))
    g.output("c", g.add(g.add(product, g.param("bias", bias.shape, init=bias)),
                        g.param("rows", rows.shape, init=rows)).relu())
    caps = dataclasses.replace(device.caps, device_type="discrete")
    session = Session(lower(g, caps).plan, device)
    session.step()
    (kernel,) = [d.kernel for d in session.plan.dispatches]
    assert "mat_c: array<vec4<f32>>" in kernel.wgsl and "ep2" in kernel.wgsl
    expected = np.maximum(a.astype(np.float64) @ b + bias + rows, 0)
    assert rel_l2(session.read("c"), expected) < 1e-5
    session.close()


@pytest.mark.parametrize("k,wide", [(64, True), (300, False)])
def test_large_register_tiles_store_four_at_once_only_over_short_sums(device, k, wide):
    # gemm.stores_wide: on an H200 wide stores took Whisper's 64-deep attention scores (128 x 128
    # tiles, 8 x 8 a thread) from 0.106 to 0.063 ms but the 4096^3 product from 40.0 to 34.3
    # TFLOP/s; 4 x 4 register tiles store four at once over any k
    from vkml.kernels import gemm, matmul
    g = vkml.Graph()
    c = g.matmul(g.param("a", (256, k)), g.param("b", (k, 256)))
    caps = dataclasses.replace(device.caps, device_type="discrete")
    four_by_four = next(t for t in gemm.STAGED if t.tm * t.tn == 16)
    for tiling, expected in ((gemm.STAGED[0], wide), (four_by_four, True)):
        kernel = matmul.generate(c, caps, tiling)
        assert ("mat_c: array<vec4<f32>>" in kernel.wgsl) == expected, (tiling, k)


EPILOGUE_CONVS = {  # name: (x shape, weight shape, stride, padding)
    "3x3": ((2, 3, 9, 7), (5, 3, 3, 3), 1, 1),
    # 24 pixels an image: on GPUs four outputs a store, each through the epilogue
    "1x1_wide": ((3, 8, 4, 6), (12, 8, 1, 1), 1, 0),
    # split on GPUs: the partial sums' sum takes the epilogue
    "split_forward": ((1, 256, 4, 4), (16, 256, 3, 3), 1, 1),
}


@pytest.mark.parametrize("device_type", ["discrete", "cpu"])
@pytest.mark.parametrize("name", EPILOGUE_CONVS)
def test_batch_norm_inference_and_residual_move_into_the_convolution(name, device_type, device,
                                                                     rng):
    # ResNet's inference form: conv, batch norm from running statistics (its per-channel scale
    # and shift computed again at each element), a residual add and a ReLU: one kernel on CPU
    # drivers, and on GPUs where the convolution is not split
    if device.backend_name != "vulkan":
        pytest.skip("the variants are a codegen choice; one backend is enough to check them")
    x_shape, w_shape, stride, padding = EPILOGUE_CONVS[name]
    channels = w_shape[0]
    values = {"x": rng.standard_normal(x_shape), "w": rng.standard_normal(w_shape),
              "gamma": rng.standard_normal(channels), "beta": rng.standard_normal(channels),
              "mean": rng.standard_normal(channels), "var": rng.uniform(0.5, 2, channels)}
    values = {k: v.astype(np.float32) for k, v in values.items()}
    g = vkml.Graph()
    p = {k: g.param(k, v.shape, init=v) for k, v in values.items() if k != "x"}
    # an input: a convolution of parameters alone would be computed once (the prologue)
    y = g.conv2d(g.input("x", x_shape), p["w"], stride=stride, padding=padding)
    residual = g.input("residual", y.shape)
    normed = g.batch_norm(y, p["mean"], p["var"], p["gamma"], p["beta"], training=False)
    g.output("z", (normed + residual).relu())
    caps = dataclasses.replace(device.caps, device_type=device_type)
    session = Session(lower(g, caps).plan, device)
    ops = [d.op for d in session.plan.dispatches]
    split = name == "split_forward" and device_type == "discrete"
    assert ops == (["conv2d", "fused_sum"] if split else ["fused_conv2d"]), ops
    r = rng.standard_normal(y.shape).astype(np.float32)
    session.set_input("x", values["x"])
    session.set_input("residual", r)
    session.step()
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()}
    ty = F.batch_norm(F.conv2d(t["x"], t["w"], stride=stride, padding=padding), t["mean"],
                      t["var"], t["gamma"], t["beta"], training=False, eps=1e-5)
    expected = torch.relu(ty + torch.tensor(r, dtype=torch.float64)).numpy()
    assert rel_l2(session.read("z"), expected) < 1e-5


@pytest.mark.parametrize("stride", [1, 2])  # 2: phased on GPUs
@pytest.mark.parametrize("device_type", ["discrete", "cpu"])
def test_an_input_gradient_takes_the_activation_derivative_into_its_store(device_type, stride,
                                                                         device, rng):
    # conv(relu(h)): h's gradient is the input gradient times relu's derivative, applied as
    # the transposed convolution stores
    if device.backend_name != "vulkan":
        pytest.skip("the variants are a codegen choice; one backend is enough to check them")
    x_shape, w_shape = (2, 4, 8, 6), (6, 4, 3, 3)
    h = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    g = vkml.Graph()
    ph, pw = g.param("h", x_shape, init=h), g.param("w", w_shape, init=w)
    y = g.output("y", g.conv2d(ph.relu(), pw, stride=stride, padding=1))
    weights = rng.standard_normal(y.shape).astype(np.float32)
    loss = g.sum(g.mul(y, g.constant(weights)))
    caps = dataclasses.replace(device.caps, device_type=device_type)
    session = Session(lower(g, caps, loss=loss).plan, device)
    grads = [d for d in session.plan.dispatches
             if d.op is not None and d.op.endswith("conv2d_input_grad")]
    assert len(grads) == 1
    phased = "let ry = " in grads[0].kernel.wgsl
    assert phased == (stride == 2 and device_type == "discrete")
    # phased, a partial sum a tap: the sum of them stores through the derivative
    assert grads[0].op == ("conv2d_input_grad" if phased else "fused_conv2d_input_grad")
    session.step()
    th = torch.tensor(h, dtype=torch.float64, requires_grad=True)
    tw = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    ty = F.conv2d(torch.relu(th), tw, stride=stride, padding=1)
    (ty * torch.tensor(weights, dtype=torch.float64)).sum().backward()
    assert rel_l2(session.read("y"), ty.detach().numpy()) < 1e-5
    assert rel_l2(session.grad("h"), th.grad.numpy()) < 1e-5
    assert rel_l2(session.grad("w"), tw.grad.numpy()) < 1e-5


def test_f16_products_are_decided_by_the_capabilities(device):
    # Capabilities.f16_products, the one place the device's f16 arithmetic is chosen:
    # cooperative matrices where the device has them, else f16 arithmetic in the staged tiles
    # where it has shaderFloat16, else precision="f16" is refused naming the fix
    from vkml.compiler.options import CompileOptions
    from vkml.errors import DeviceError
    base = dataclasses.replace(device.caps, precision="f16")
    for coop, f16, want in [(True, True, "cooperative"), (False, True, "simt"),
                            (False, False, None), (True, False, None)]:
        caps = dataclasses.replace(base, cooperative_matrix=coop, shader_f16=f16)
        assert caps.f16_products == want
        assert dataclasses.replace(caps, precision="f32").f16_products is None
        if want is None:
            with pytest.raises(DeviceError, match="shaderFloat16.*precision='f32'"):
                CompileOptions(precision="f16").target(caps)
        else:
            assert CompileOptions(precision="f16").target(caps).f16_products == want


@pytest.mark.parametrize("name", CASES)
def test_f16_arithmetic_products_and_gradients_match_torch(name, device, rng):
    # precision="f16" without cooperative matrices (lavapipe, and most mobile GPUs): matmuls
    # on staged tiles held and multiplied in f16, each slice's sums added in f32 (gemm's
    # docstring); the backward products scale both operands into f16's range first. The
    # loss weights make the gradients about 1e-7, which f16 would flush to zero unscaled.
    # Within 1% (PROTOCOL.md's forward gate) of float64 torch, and above f32's error: f16 ran.
    # The epilogue adds a bias, not a ReLU: an output within f16's error of 0 (0.008 of
    # sums about 5 here) may take the other side of a ReLU, whose gradient then differs there
    # whole (one such element: 10% of this small gradient).
    if device.backend_name != "vulkan":
        pytest.skip("the variants are a codegen choice; one backend is enough to check them "
                    "(test_models.py's f16 SmolLM2 runs them on both)")
    if dataclasses.replace(device.caps, precision="f16").f16_products != "simt":
        pytest.skip(f"{device.caps.device_name} has no f16 arithmetic without cooperative "
                    "matrices: the staged f16 tiles were not run")
    a_shape, b_shape, ta, tb = CASES[name]
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    g = vkml.Graph()
    pa, pb = g.param("a", a_shape, init=a), g.param("b", b_shape, init=b)
    product = g.matmul(pa, pb, transpose_a=ta, transpose_b=tb)
    bias = rng.standard_normal(product.shape[-1]).astype(np.float32)
    y = g.output("c", g.add(product, g.constant(bias)))
    weights = (rng.standard_normal(y.shape) * 1e-7).astype(np.float32)
    session = vkml.compile(g, loss=g.sum(g.mul(y, g.constant(weights))), keep_grads=True,
                           precision="f16", device=device)
    session.step()
    products = [(d.phase, d.kernel.name) for d in session.plan.dispatches
                if "matmul" in d.kernel.name]
    assert sorted(phase for phase, _ in products) == ["backward", "backward", "forward"]
    for phase, kernel in products:  # "h": staged f16 tiles
        assert re.search(r"_s\d+x\d+k\d+r\d+x\d+h" + ("_scaled" if phase == "backward" else "")
                         + "$", kernel), (phase, kernel)
    ta64 = torch.tensor(a, dtype=torch.float64, requires_grad=True)
    tb64 = torch.tensor(b, dtype=torch.float64, requires_grad=True)
    want = ((ta64.transpose(-1, -2) if ta else ta64) @ (tb64.transpose(-1, -2) if tb else tb64)
            + torch.tensor(bias, dtype=torch.float64))
    (want * torch.tensor(weights, dtype=torch.float64)).sum().backward()
    errors = [rel_l2(session.read("c"), want.detach().numpy()),
              rel_l2(session.grad("a"), ta64.grad.numpy()),
              rel_l2(session.grad("b"), tb64.grad.numpy())]
    assert all(1e-5 < e < 1e-2 for e in errors), errors
    session.close()


def test_f16_arithmetic_leaves_convolutions_f32(device):
    # ResNet-50's accelerated training failed its gradient gates with f16 convolutions (the
    # README), and so did the tiny bottleneck ResNet's with its forward convolutions on staged
    # f16 tiles (on lavapipe: a batch norm weight's gradient at cosine 0.75, logits 0.8%; the
    # tiny U-Net passed), so the staged f16 tiles take matmuls only; convolutions keep f32
    caps = dataclasses.replace(device.caps, cooperative_matrix=False, shader_f16=True)
    g = vkml.Graph()
    y = g.conv2d(g.param("x", (2, 8, 8, 8)), g.param("w", (8, 8, 3, 3)), padding=1)
    plan = lower(g, caps, loss=g.sum(g.mul(y, y)), precision="f16").plan
    convs = [d.kernel.name for d in plan.dispatches if d.op.startswith("conv2d")]
    assert len(convs) == 3 and all(re.search(r"_s\d+x\d+k\d+r\d+x\d+$", n) for n in convs), convs


def test_staged_f16_tiles_sum_each_slice_in_f16_and_the_slices_in_f32(device):
    # 2048 then ones along the sum: within the first staged slice f16 arithmetic drops every
    # 1 (f16's spacing at 2048 is 2, and ties go to even), the second slice's ones are summed
    # exactly and added in f32: 2048 + bk, where f32 sums would give 2048 + 2 bk - 1.
    # (Lavapipe computes f16 as f16, so this runs the arithmetic a mobile GPU would.)
    if dataclasses.replace(device.caps, precision="f16").f16_products != "simt":
        pytest.skip(f"{device.caps.device_name} has no f16 arithmetic without cooperative "
                    "matrices: the staged f16 tiles were not run")
    from vkml.kernels import gemm
    bk = 16
    a = np.ones((4, 2 * bk), np.float32)
    a[:, 0] = 2048
    g = vkml.Graph()
    g.output("c", g.matmul(g.param("a", a.shape, init=a), g.constant(np.ones((2 * bk, 4),
                                                                              np.float32))))
    session = vkml.compile(g, precision="f16", device=device)
    session.step()
    (kernel,) = [d.kernel.name for d in session.plan.dispatches]
    assert kernel.endswith(f"k{bk}r4x4h") and kernel in {
        f"matmul_nn_4x4x{2 * bk}_{t}" for t in gemm.STAGED_F16}, kernel
    np.testing.assert_array_equal(session.read("c"), np.full((4, 4), 2048 + bk, np.float32))
    session.close()
