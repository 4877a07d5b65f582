"""Convolutions over channels-last f16 operands (accelerated inference, kernels/conv.py
`channels_last`, compiler/layouts.py): the layout rewrite, the copy kernel, and the GEMM core's
variants reading the copies, against float64 torch. Lavapipe has f16 arithmetic without
cooperative matrices, so the automatic choice here is the staged f16 tiles; the staged f32 and
direct tiles are forced on the same plan; the cooperative tiles run in tests/gpu (and their
WGSL is checked through naga here)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import rel_l2

import vkml
from vkml.compiler.stages import lower
from vkml.kernels import conv, gemm
from vkml.session import Session

# name: (x shape, weight shape, stride, padding, groups, epilogue: "" | "bias_relu" | "residual")
CASES = {
    "3x3": ((2, 8, 9, 8), (12, 8, 3, 3), 1, 1, 1, "bias_relu"),
    "3x3_stride_2": ((2, 8, 9, 8), (12, 8, 3, 3), 2, 1, 1, ""),
    "1x1_residual": ((1, 16, 6, 5), (16, 16, 1, 1), 1, 0, 1, "residual"),
    "7x7_stem_3_channels": ((1, 3, 13, 12), (8, 3, 7, 7), 2, 3, 1, "bias_relu"),
    "grouped": ((1, 8, 6, 6), (8, 4, 3, 3), 1, 1, 2, ""),
    # a sum of 540 split four ways (compiler/split.py): 136 deep each, whole quads of channels
    "split_sum": ((1, 60, 5, 4), (8, 60, 3, 3), 1, 1, 1, "bias_relu"),
}
# the staged f32 tiles and the direct ones, forced on the channels-last plan
FORCED = {"staged_f32": gemm.Tiling(64, 64, 4, 4, 16, True),
          "direct": gemm.direct_tiling(64, 64)}


def _f16_caps(device):
    caps = dataclasses.replace(device.caps, precision="f16")
    if device.backend_name != "vulkan" or caps.f16_products is None:
        pytest.skip(f"{device.caps.device_name} ({device.backend_name}): no f16 arithmetic on "
                    "the Vulkan backend here, so channels-last f16 operands were not run")
    return caps


def _case(name: str, rng):
    return channels_last_case(CASES[name], rng)


def channels_last_case(spec: tuple, rng):
    """A graph of one convolution (x shape, weight shape, stride, padding, groups, epilogue:
    "" | "bias_relu" | "residual"), its output "y", and float64 torch's."""
    x_shape, w_shape, stride, padding, groups, epilogue = spec
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32)
    b = rng.standard_normal(w_shape[0]).astype(np.float32)
    g = vkml.Graph()
    px = g.param("x", x_shape, init=x)
    y = g.conv2d(px, g.param("w", w_shape, init=w), stride=stride, padding=padding,
                 groups=groups)
    t64 = {k: torch.tensor(v, dtype=torch.float64) for k, v in (("x", x), ("w", w), ("b", b))}
    want = F.conv2d(t64["x"], t64["w"], stride=stride, padding=padding, groups=groups)
    if epilogue == "bias_relu":
        y = g.relu(g.add(y, g.reshape(g.constant(b), (b.size, 1, 1))))
        want = torch.relu(want + t64["b"].reshape(-1, 1, 1))
    elif epilogue == "residual":
        y = g.add(y, px)
        want = want + t64["x"]
    g.output("y", y)
    return g, want.numpy()


@pytest.mark.parametrize("name", CASES)
def test_channels_last_convolutions_match_torch(name, device, rng, monkeypatch):
    caps = _f16_caps(device)
    monkeypatch.setattr(conv, "CHANNELS_LAST_MIN",
                        dict.fromkeys(conv.CHANNELS_LAST_MIN, 0))
    g, want = _case(name, rng)
    stages = lower(g, caps, precision="f16")
    ops = [d.op for d in stages.plan.dispatches]
    copies = ["channels_last_f16"] * (1 if name == "1x1_residual" else 2)  # weight read as is
    assert ops == [*copies, *(
        ["conv2d", "fused_sum"] if name == "split_sum" else
        ["conv2d"] if name in ("3x3_stride_2", "grouped") else ["fused_conv2d"])], ops
    (product,) = [n for n in stages.nodes if n is not None and "conv2d" in n.op]
    auto = gemm.choose(*conv.dims_conv2d(product, caps), caps, conv.plain(product),
                       conv.coop_min(product))
    assert auto.f16 if caps.f16_products == "simt" else isinstance(auto, gemm.CoopTiling)
    errors = {}
    for label, tiling in [("auto", None), *FORCED.items()]:
        plan = stages.plan if tiling is None else dataclasses.replace(
            stages.plan, dispatches=tuple(
                dataclasses.replace(d, kernel=conv.generate_conv2d(node, caps, tiling))
                if node is product else d for d, node in zip(stages.plan.dispatches,
                                                             stages.nodes)))
        session = Session(plan, device)
        session.step()
        errors[label] = rel_l2(session.read("y"), want)
        session.close()
    # f16 operands: within 1% of float64 (PROTOCOL.md's forward gate), above f32's error
    assert all(1e-5 < e < 1e-2 for e in errors.values()), errors


def test_cooperative_tiles_over_channels_last_operands_pass_naga(device, monkeypatch):
    # the GPU tests run them; here at least their WGSL is valid, with an epilogue and edges
    _f16_caps(device)
    from vkml.vk import naga
    monkeypatch.setattr(conv, "CHANNELS_LAST_MIN",
                        dict.fromkeys(conv.CHANNELS_LAST_MIN, 0))
    caps = dataclasses.replace(device.caps, precision="f16", cooperative_matrix=True,
                               device_type="discrete")
    g, _ = _case("7x7_stem_3_channels", np.random.default_rng(0))
    stages = lower(g, caps, precision="f16")
    (kernel,) = [d.kernel for d in stages.plan.dispatches if "conv2d" in d.op]
    assert "_c" in kernel.name and "vec4<f16>" in kernel.wgsl
    naga.compile_wgsl(kernel.wgsl, kernel.name)


def test_channels_last_is_on_where_measured_and_never_in_training(device, rng, monkeypatch):
    # on by default for cooperative matrices (measured faster), off for the staged f16 tiles
    caps = _f16_caps(device)
    g, _ = _case("3x3", rng)
    default = conv.CHANNELS_LAST_MIN
    assert default["cooperative"] == 0 and default["simt"] is None
    assert bool(_copies(lower(g, caps, precision="f16"))) == (caps.f16_products == "cooperative")
    monkeypatch.setattr(conv, "CHANNELS_LAST_MIN",
                        dict.fromkeys(conv.CHANNELS_LAST_MIN, 0))
    loss = g.sum(g.outputs["y"])
    assert not _copies(lower(g, caps, loss=loss, precision="f16"))
    assert not _copies(lower(g, caps, precision="f32"))
    assert len(_copies(lower(g, caps, precision="f16"))) == 2


def _copies(stages) -> list:
    return [n for n in stages.split.graph.nodes if n.op == conv.CHANNELS_LAST]


def test_one_copy_serves_every_convolution_reading_a_tensor(device, monkeypatch):
    # as a bottleneck's first convolution and its downsampling one read the same input; the
    # pointwise one reads its f32 weight as it is (its rows are patch rows already)
    caps = _f16_caps(device)
    monkeypatch.setattr(conv, "CHANNELS_LAST_MIN",
                        dict.fromkeys(conv.CHANNELS_LAST_MIN, 0))
    g = vkml.Graph()
    x = g.param("x", (1, 8, 4, 4))
    g.output("a", g.conv2d(x, g.param("wa", (4, 8, 3, 3)), padding=1))
    g.output("b", g.conv2d(x, g.param("wb", (16, 8, 1, 1))))
    copies = _copies(lower(g, caps, precision="f16"))
    assert sorted(n.inputs[0].name for n in copies) == ["wa", "x"]


def test_the_rule_takes_only_products_from_its_threshold(device, monkeypatch):
    caps = _f16_caps(device)
    g, _ = _case("3x3", np.random.default_rng(0))  # GEMM 162 x 12 x 72
    (node,) = [n for n in g.nodes if n.op == "conv2d"]
    monkeypatch.setattr(conv, "CHANNELS_LAST_MIN",
                        dict.fromkeys(conv.CHANNELS_LAST_MIN, 12))
    assert conv.channels_last(node, caps)
    monkeypatch.setattr(conv, "CHANNELS_LAST_MIN",
                        dict.fromkeys(conv.CHANNELS_LAST_MIN, 13))
    assert not conv.channels_last(node, caps)


@pytest.mark.parametrize("split", [False, True])
def test_a_convolution_read_only_by_another_stores_channels_last_itself(split, device, rng,
                                                                        monkeypatch):
    # conv -> bias + ReLU -> conv: the first writes the second's f16 copy itself (its store,
    # or where it is split, the sum of its partial sums), so that copy is gone
    caps = _f16_caps(device)
    monkeypatch.setattr(conv, "CHANNELS_LAST_MIN",
                        dict.fromkeys(conv.CHANNELS_LAST_MIN, 0))
    # a sum of 540 split four ways on lavapipe
    g, want = chain_case((1, 60, 5, 4) if split else (1, 8, 5, 4), 8, 12, rng)
    stages = lower(g, caps, precision="f16")
    producer = "fused_sum" if split else "fused_conv2d"
    stored = [n for n in stages.nodes if n is not None and "store" in n.attrs]
    assert [n.op for n in stored] == [producer], [n and n.op for n in stages.nodes]
    assert sorted(n.inputs[0].name for n in _copies(stages)) == ["w1", "w2", "x"]
    session = Session(stages.plan, device)
    session.step()
    assert 1e-5 < rel_l2(session.read("y"), want) < 1e-2
    session.close()


def chain_case(x_shape: tuple, middle: int, out: int, rng):
    """y = conv3x3(relu(conv3x3(x) + b)) of `middle`, then `out` channels, and float64
    torch's y."""
    values = {"x": rng.standard_normal(x_shape),
              "w1": rng.standard_normal((middle, x_shape[1], 3, 3)),
              "b": rng.standard_normal(middle), "w2": rng.standard_normal((out, middle, 3, 3))}
    values = {k: (v / np.sqrt(np.prod(v.shape[1:])) if k[0] == "w" else v).astype(np.float32)
              for k, v in values.items()}
    g = vkml.Graph()
    p = {k: g.param(k, v.shape, init=v) for k, v in values.items()}
    h = g.relu(g.add(g.conv2d(p["x"], p["w1"], padding=1), g.reshape(p["b"], (middle, 1, 1))))
    g.output("y", g.conv2d(h, p["w2"], padding=1))
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()}
    want = F.conv2d(torch.relu(F.conv2d(t["x"], t["w1"], padding=1) + t["b"].reshape(-1, 1, 1)),
                    t["w2"], padding=1)
    return g, want.numpy()


def test_tiny_resnet_inference_on_channels_last_operands_matches_torch(device, rng, monkeypatch):
    # the convolutions of the tiny bottleneck ResNet (inference form) whose input another
    # convolution writes read channels-last f16 copies, stored so by that convolution; those
    # reading the image or a block's output (which the residual add reads too) keep NCHW, as
    # a copy of their own would cost more than it saves: logits within 1% of float64
    import torch_reference as ref

    from vkml.models import resnet
    caps = _f16_caps(device)
    monkeypatch.setattr(conv, "CHANNELS_LAST_MIN",
                        dict.fromkeys(conv.CHANNELS_LAST_MIN, 0))
    cfg = dataclasses.replace(resnet.tiny("bottleneck"), bn="eval")
    built = resnet.build(cfg)
    stages = lower(built.graph, caps, outputs=built.outputs, precision="f16")
    convs = [n for n in stages.nodes if n is not None and "conv2d" in n.op]
    assert any(conv.is_channels_last(n) for n in convs)
    assert not all(conv.is_channels_last(n) for n in convs)
    assert any("store" in n.attrs for n in stages.nodes if n is not None)
    assert not [n for n in stages.nodes if n is not None and n.op == conv.CHANNELS_LAST]
    session = Session(stages.plan, device)
    for name, value in session.params().items():
        if name.endswith(("running_mean", "bias")):
            session.set_param(name, 0.1 * rng.standard_normal(value.shape).astype(np.float32))
        elif name.endswith("running_var"):
            session.set_param(name, rng.uniform(0.5, 2.0, value.shape).astype(np.float32))
    x = rng.standard_normal(built.inputs["x"].shape).astype(np.float32)
    session.set_input("x", x)
    session.step()
    module = ref.ResNet(cfg).double()
    module.load_state_dict({k: torch.tensor(v, dtype=torch.float64)
                            for k, v in session.params().items()}, strict=False)
    with torch.no_grad():
        want, _ = module.eval()(torch.tensor(x, dtype=torch.float64),
                                torch.zeros(cfg.batch, dtype=torch.int64))
    assert 1e-5 < rel_l2(session.read("logits"), want["logits"].numpy()) < 1e-2
    session.close()


def test_channels_last_only_where_its_copies_cost_the_step_nothing(device, monkeypatch):
    # a copy is free where the prologue makes it (weights) or the producing convolution stores
    # it; a convolution whose input would need a copy dispatch of its own keeps NCHW: the
    # image's, and one whose input another op (the residual add here) reads too
    caps = _f16_caps(device)
    monkeypatch.setattr(conv, "CHANNELS_LAST_MIN", dict.fromkeys(conv.CHANNELS_LAST_MIN, 0))
    g = vkml.Graph()
    x = g.input("x", (1, 8, 6, 6))
    a = g.conv2d(x, g.param("wa", (8, 8, 3, 3)), padding=1)
    b = g.conv2d(g.relu(a), g.param("wb", (8, 8, 3, 3)), padding=1)
    c = g.conv2d(b, g.param("wc", (8, 8, 3, 3)), padding=1)
    g.output("y", g.add(c, b))
    stages = lower(g, caps, precision="f16")
    def weight(node):  # the weight's name, through its channels-last copy if it has one
        w = node.inputs[1]
        return w.name if w.op == "param" else w.inputs[0].name
    taken = {weight(n): conv.is_channels_last(n) for n in stages.split.graph.nodes
             if "conv2d" in n.op}
    assert taken == {"wa": False, "wb": True, "wc": False}
    assert not [n for n in stages.nodes if n is not None and n.op == conv.CHANNELS_LAST]
