"""ONNX files as users have them, not only fresh torch.onnx exports: old and new opsets from
both exporters, float16 / bfloat16 / float64 / int8 weights, external data, open dimensions,
old-style graphs (initializers as inputs, every Constant form, empty optional inputs), each
imported and checked against onnxruntime run in the test (its optimizations off where they
approximate: a DequantizeLinear into a MatMul becomes an integer product) or PyTorch in float64.
"""

from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import pytest

import vkml
from tests.conftest import rel_l2
from tests.test_import import (
    FORWARD_TOL,
    GRAD_TOL,
    MLP,
    SmallCNN,
    TinyBlock,
    _with_running_stats,
)

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402

vulkan_only = pytest.mark.parametrize("device", ["vulkan"], indirect=True)
NEWEST = onnx.defs.onnx_opset_version()
tensor_info = helper.make_tensor_value_info


def onnxruntime_exact(model, feeds):
    """onnxruntime with its graph optimizations off: what the file says, computed as it says."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"]).run(None,
                                                                                      feeds)


def vkml_forward(model, feeds, device, shapes=None):
    imp = vkml.import_onnx(model, shapes=shapes)
    s = vkml.compile(imp.graph, outputs=imp.outputs, device=device)
    for name, value in feeds.items():
        s.set_input(name, value)
    s.forward()
    return imp, [s.read(name) for name in imp.outputs]


def check_against_onnxruntime(model, feeds, device, shapes=None, tol=FORWARD_TOL):
    imp, got = vkml_forward(model, feeds, device, shapes)
    for name, have, want in zip(imp.outputs, got, onnxruntime_exact(model, feeds)):
        assert rel_l2(have, want) < tol, name
    return imp


def make_model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def export(module, x, dynamo: bool, opset: int):
    """torch.onnx's model at `opset`: the legacy (TorchScript) exporter writes it directly up to
    its newest (18 here), newer ones come from onnx's version converter; the dynamo exporter
    writes 18 and converts itself."""
    file = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        written = torch.onnx.export(module, (x,), None if dynamo else file, dynamo=dynamo,
                                    input_names=["x"], output_names=["logits"],
                                    opset_version=min(opset, 18) if not dynamo else opset)
    model = written.model_proto if dynamo else onnx.load_from_string(file.getvalue())
    if model.opset_import[0].version != opset:
        from onnx import version_converter
        model = version_converter.convert_version(model, opset)
    return model


class Block(TinyBlock):
    """TinyBlock with attention written out (a constant causal mask, no
    scaled_dot_product_attention or triu), so the legacy exporter writes it down to opset 11."""

    def __init__(self, dim=16, heads=2, length=6):
        super().__init__(dim, heads)
        mask = np.triu(np.full((length, length), -1e9, np.float32), 1)
        self.register_buffer("causal", torch.tensor(mask))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5 + self.causal
        a = torch.softmax(scores, -1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))
        return self.head(x[:, -1])


def _models():
    torch.manual_seed(0)
    return {"cnn": (_with_running_stats(SmallCNN()).eval(), torch.randn(2, 3, 8, 8)),
            "block": (Block().eval(), torch.randn(2, 6, 16))}


# The dynamo exporter below 18 and the block at the newest opset are left out: torch writes
# invalid files there (Split's num_outputs at 17, which onnxruntime and vkml both refuse; its
# converter has no Gelu adapter past 19). It writes 18 and converts from there itself, so the
# CNN at the newest opset stands for both.
SPREAD = [(m, False, o) for m in ("cnn", "block") for o in (11, 13, 17, 18, NEWEST)] + \
    [("cnn", True, NEWEST), ("block", True, 18)]


@vulkan_only
@pytest.mark.parametrize("name, dynamo, opset", SPREAD,
                         ids=[f"{m}-{'dynamo' if d else 'legacy'}-{o}" for m, d, o in SPREAD])
def test_opset_spread_matches_onnxruntime(device, name, dynamo, opset):
    """Opsets below 13 are converted to 13 at import by onnx's version converter (Softmax
    flattened to 2-D before 13, Split's and the reductions' attributes that became inputs)."""
    module, x = _models()[name]
    model = export(module, x, dynamo, opset)
    assert model.opset_import[0].version == opset
    check_against_onnxruntime(model, {"x": x.numpy()}, device)


@vulkan_only
@pytest.mark.parametrize("opset", [7, 9, 10])
def test_model_zoo_era_opsets_match_onnxruntime(device, opset):
    """Opsets before any torch.onnx of today: Upsample with its scales as an attribute (7, 8)
    or an input (9), Resize-10, and Softmax over axis 1 of a 4-D value, which before opset 13
    means over all of axes 1 to 3 flattened together."""
    rng = np.random.default_rng(0)
    stats = [numpy_helper.from_array(rng.random(2).astype(np.float32) + 0.5, n) for n in "sbmv"]
    scales = [1.0, 1.0, 2.0, 2.0]
    if opset == 7:
        upsample = helper.make_node("Upsample", ["bn"], ["up"], mode="nearest", scales=scales)
    else:
        upsample = helper.make_node("Upsample" if opset < 10 else "Resize", ["bn", "scales"],
                                    ["up"], mode="nearest")
        stats.append(numpy_helper.from_array(np.array(scales, np.float32), "scales"))
    nodes = [helper.make_node("BatchNormalization", ["x", *"sbmv"], ["bn"], epsilon=1e-3),
             upsample, helper.make_node("Softmax", ["up"], ["soft"], axis=1),
             helper.make_node("Flatten", ["soft"], ["flat"]),
             helper.make_node("Gemm", ["flat", "w", "c"], ["y"], transB=1)]
    weights = [numpy_helper.from_array(rng.standard_normal((4, 72)).astype(np.float32), "w"),
               numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "c")]
    model = make_model(nodes, [tensor_info("x", T.FLOAT, (1, 2, 3, 3))],
                       [tensor_info("y", T.FLOAT, (1, 4))], stats + weights, opset)
    model.ir_version = 4
    x = rng.standard_normal((1, 2, 3, 3)).astype(np.float32)
    check_against_onnxruntime(model, {"x": x}, device)


def test_old_opset_conversion_failure_is_named():
    ones = [numpy_helper.from_array(np.ones(3, np.float32), n) for n in "sbmv"]
    node = helper.make_node("BatchNormalization", ["x", *"sbmv"], ["y"], spatial=0)
    model = make_model([node], [tensor_info("x", T.FLOAT, (2, 3))],
                       [tensor_info("y", T.FLOAT, (2, 3))], ones, opset=7)
    with pytest.raises(vkml.ModelImportError, match="opset 7.*version_converter.*spatial"):
        vkml.import_onnx(model)


# ---- dtypes ------------------------------------------------------------------------------------
def float16_models(module, x, tmp_path):
    """The two float16 files users have: model.half() exported (weights, inputs and outputs in
    float16) and onnxconverter_common's conversion of a float32 export (keep_io_types=False)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(copy.deepcopy(module).half(), (x.half(),), str(tmp_path / "half.onnx"),
                          dynamo=False, input_names=["x"], output_names=["logits"])
        torch.onnx.export(module, (x,), str(tmp_path / "f32.onnx"), dynamo=False,
                          input_names=["x"], output_names=["logits"])
    models = {"half": onnx.load(str(tmp_path / "half.onnx"))}
    float16 = pytest.importorskip("onnxconverter_common.float16")
    models["converted"] = float16.convert_float_to_float16(onnx.load(str(tmp_path / "f32.onnx")))
    # float32 inputs and outputs, Casts to and from float16 inside
    models["keep_io_types"] = float16.convert_float_to_float16(
        onnx.load(str(tmp_path / "f32.onnx")), keep_io_types=True)
    return models


def float64_reference(module, x):
    """The module in float64 with its weights and input rounded to float16, as the file holds
    them: what vkml computes (in f32) from a float16 file."""
    wide = copy.deepcopy(module).half().double()
    return wide(x.half().double()).detach().numpy()


@vulkan_only
def test_float16_models_compute_in_f32_from_their_float16_values(device, tmp_path):
    """vkml casts at the boundary: float16 weights become f32 parameters, float16 inputs are
    taken as f32, outputs read as f32; inside, everything is f32, so the result is the float16
    model's function computed more precisely than onnxruntime's float16 arithmetic."""
    torch.manual_seed(0)
    module, x = MLP(), torch.randn(5, 6)
    for kind, model in float16_models(module, x, tmp_path).items():
        io = T.FLOAT if kind == "keep_io_types" else T.FLOAT16
        assert model.graph.input[0].type.tensor_type.elem_type == io, kind
        assert model.graph.initializer[0].data_type == T.FLOAT16, kind
        feeds = {"x": x.half().numpy() if io == T.FLOAT16 else x.half().float().numpy()}
        imp, (got,) = vkml_forward(model, feeds, device)
        assert got.dtype == np.float32
        assert rel_l2(got, float64_reference(module, x)) < FORWARD_TOL, kind
        (fp16,) = onnxruntime_exact(model, feeds)
        assert rel_l2(got, fp16) < 2e-3, kind  # onnxruntime rounds every step to float16


def _matmul_model(weight, nodes=(), extra=(), io=T.FLOAT, weight_name="w", opset=17):
    return make_model([*nodes, helper.make_node("MatMul", ["x", weight_name], ["y"])],
                      [tensor_info("x", io, (2, 4))], [tensor_info("y", io, (2, 3))],
                      [weight, *extra], opset)


@vulkan_only
def test_float64_and_bfloat16_initializers_train_and_save_back(device, tmp_path):
    import ml_dtypes
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    x = rng.standard_normal((2, 4)).astype(np.float32)
    bf16 = helper.make_tensor("wb", T.BFLOAT16, (4, 3),
                              w.astype(ml_dtypes.bfloat16).view(np.uint16).tobytes(), raw=True)
    models = {
        "float64": (_matmul_model(numpy_helper.from_array(w.astype(np.float64), "w"),
                                  io=T.DOUBLE), "w", x.astype(np.float64)),
        "bfloat16": (_matmul_model(bf16, [helper.make_node("Cast", ["wb"], ["w"], to=T.FLOAT)]),
                     "wb", x)}
    for kind, (model, weight, xin) in models.items():
        imp = check_against_onnxruntime(model, {"x": xin}, device)
        assert set(imp.graph.params) == {weight}, kind  # a trainable parameter
        g = imp.graph
        s = vkml.compile(g, loss=g.sum(imp.outputs["y"]), optimizer=vkml.SGD(lr=0.5),
                         outputs=imp.outputs, device=device)
        s.set_input("x", xin)
        s.step()
        saved = tmp_path / f"{kind}.onnx"
        imp.save_onnx(s, str(saved))
        back = onnx.load(str(saved)).graph.initializer[0]
        original = model.graph.initializer[0]
        assert (back.name, back.data_type) == (original.name, original.data_type), kind
        # one SGD step on sum(x @ w): w - 0.5 * x^T 1, then rounded to the file's dtype
        stored = numpy_helper.to_array(original).astype(np.float64)
        want = stored - 0.5 * xin.astype(np.float64).sum(0)[:, None]
        written = numpy_helper.to_array(back).astype(np.float64)
        assert rel_l2(written, want) < (1e-2 if kind == "bfloat16" else 1e-6), kind


@vulkan_only
@pytest.mark.parametrize("dtype, axis", [(np.int8, 1), (np.uint8, None)])
def test_quantized_initializers_dequantize_at_import(device, dtype, axis):
    """An int8 / uint8 weight through DequantizeLinear at opset 13 (onnx's reference has the
    op only from 19 on): computed at import by numpy, per axis or per tensor."""
    rng = np.random.default_rng(0)
    info = np.iinfo(dtype)
    q = rng.integers(info.min, info.max, (4, 3)).astype(dtype)
    scale = np.array([0.02, 0.05, 0.01] if axis is not None else 0.03, np.float32)
    zero = np.array([1, -3, 0] if axis is not None else 128, dtype)
    attrs = {"axis": axis} if axis is not None else {}
    node = helper.make_node("DequantizeLinear", ["wq", "s", "z"], ["w"], **attrs)
    model = _matmul_model(numpy_helper.from_array(q, "wq"), [node],
                          [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zero, "z")],
                          weight_name="w", opset=13)
    x = rng.standard_normal((2, 4)).astype(np.float32)
    imp = check_against_onnxruntime(model, {"x": x}, device)
    _, (got,) = vkml_forward(model, {"x": x}, device)
    weight = (q.astype(np.float64) - zero.astype(np.float64)) * scale.astype(np.float64)
    assert rel_l2(got, x.astype(np.float64) @ weight) < FORWARD_TOL
    assert not imp.graph.params  # a constant: an integer initializer holds no trained floats


def _quantized(tmp_path, module, x, how):
    """onnxruntime.quantization's forms of a float32 export: quantize_dynamic (weights int8 per
    tensor or per channel; activations uint8 by DynamicQuantizeLinear at run time, products by
    MatMulInteger / ConvInteger) or quantize_static's QOperator format."""
    from onnxruntime import quantization as q
    source, target = str(tmp_path / "f32.onnx"), str(tmp_path / f"{how}.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), source, dynamo=False, input_names=["x"],
                          output_names=["logits"])
    if how == "qoperator":
        class Calibration(q.CalibrationDataReader):
            def __init__(self):
                self.feeds = [{"x": x.numpy()}]

            def get_next(self):
                return self.feeds.pop() if self.feeds else None

        q.quantize_static(source, target, Calibration(), quant_format=q.QuantFormat.QOperator)
    else:
        q.quantize_dynamic(source, target, weight_type=q.QuantType.QInt8,
                           per_channel=how == "dynamic per channel")
    return onnx.load(target)


@vulkan_only
@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("how", ["dynamic", "dynamic per channel"])
def test_dynamically_quantized_models_match_onnx_reference(device, tmp_path, name, how):
    """Integer products exact in f32 here (sums below 2**24), as onnx's reference computes
    them; onnxruntime's uint8 x int8 kernel on a CPU without VNNI saturates pairs of products
    in int16 (7% and 17% off these two models' logits), so it is no reference for them."""
    from onnx.reference import ReferenceEvaluator
    torch.manual_seed(0)
    module, x = {"mlp": (MLP(), torch.randn(5, 6)),
                 "cnn": (_with_running_stats(SmallCNN()).eval(), torch.randn(2, 3, 8, 8))}[name]
    model = _quantized(tmp_path, module, x, how)
    ops = {n.op_type for n in model.graph.node}
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= ops
    assert name == "mlp" or "ConvInteger" in ops
    _, (got,) = vkml_forward(model, {"x": x.numpy()}, device)
    (want,) = ReferenceEvaluator(model).run(None, {"x": x.numpy()})
    assert rel_l2(got, want) < FORWARD_TOL
    assert rel_l2(got, module(x).detach().numpy()) < 0.1  # what quantization keeps of it


@vulkan_only
@pytest.mark.parametrize("x", [np.zeros((2, 3)), [[0, 1, 2], [3, 4, 5]], [[-1, 0.5, 2.0]]],
                         ids=["zeros", "positive", "both signs"])
def test_dynamic_quantize_linear_matches_onnxruntime(device, x):
    """Its scale, zero point and uint8 values exactly; an input of zeros at onnxruntime's scale
    of 1."""
    x = np.asarray(x, np.float32)
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "scale", "zero"])
    model = make_model([node], [tensor_info("x", T.FLOAT, x.shape)],
                       [tensor_info("y", T.UINT8, x.shape), tensor_info("scale", T.FLOAT, ()),
                        tensor_info("zero", T.UINT8, ())])
    _, got = vkml_forward(model, {"x": x}, device)
    for have, want in zip(got, onnxruntime_exact(model, {"x": x})):
        np.testing.assert_array_equal(have, want)


@vulkan_only
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_qoperator_quantized_models_match_onnxruntime(device, tmp_path, name):
    """quantize_static's QOperator format: QLinearConv, QGemm, QLinearGlobalAveragePool and
    max pooling of the quantized values, each op as its float form between DequantizeLinear
    and QuantizeLinear."""
    torch.manual_seed(0)
    module, x = {"mlp": (MLP(), torch.randn(5, 6)),
                 "cnn": (_with_running_stats(SmallCNN()).eval(), torch.randn(2, 3, 8, 8))}[name]
    model = _quantized(tmp_path, module, x, "qoperator")
    assert "QGemm" in {n.op_type for n in model.graph.node}
    check_against_onnxruntime(model, {"x": x.numpy()}, device)


def _u8(*shape, seed=0):
    return np.random.default_rng(seed).integers(0, 256, shape).astype(np.uint8)


def _scale(value, size=None):
    return np.full(size, value, np.float32) if size else np.array(value, np.float32)


def _zero(value, size=None, dtype=np.uint8):
    return np.full(size, value, dtype) if size else np.array(value, dtype)


# (name, op, domain, inputs, attrs): input 0 (and 3 for the binary ops) fed, the rest
# initializers; the output uint8 (QGemm's without a y_scale float)
QOPERATOR_CASES = [
    # uint8 weights: onnxruntime's uint8 x int8 kernels saturate here (see above)
    ("conv_per_channel_bias", "QLinearConv", "",
     [_u8(1, 3, 5, 5), _scale(0.02), _zero(120), _u8(4, 3, 3, 3, seed=1),
      np.linspace(0.005, 0.02, 4).astype(np.float32), _zero(128, 4), _scale(0.05),
      _zero(128), np.arange(-2, 2, dtype=np.int32) * 300], {"pads": [1, 1, 1, 1]}),
    ("matmul_per_column", "QLinearMatMul", "",
     [_u8(4, 6), _scale(0.03), _zero(100), _u8(6, 3, seed=1), _scale(0.01, 3),
      _zero(128, 3), _scale(0.2), _zero(90)], {}),
    ("gemm_float_out", "QGemm", "com.microsoft",
     [_u8(4, 6), _scale(0.03), _zero(100), _u8(3, 6, seed=1), _scale(0.01), _zero(128),
      np.array([100, -200, 50], np.int32)], {"transB": 1}),
    ("add", "QLinearAdd", "com.microsoft",
     [_u8(2, 6), _scale(0.05), _zero(128), _u8(2, 6, seed=1), _scale(0.02), _zero(50),
      _scale(0.08), _zero(100)], {}),
    ("mul", "QLinearMul", "com.microsoft",
     [_u8(2, 6), _scale(0.05), _zero(128), _u8(2, 6, seed=1), _scale(0.02), _zero(50),
      _scale(0.3), _zero(100)], {}),
    ("global_average_pool", "QLinearGlobalAveragePool", "com.microsoft",
     [_u8(1, 3, 4, 4), _scale(0.05), _zero(128), _scale(0.02), _zero(120)], {}),
    ("average_pool", "QLinearAveragePool", "com.microsoft",
     [_u8(1, 2, 4, 4), _scale(0.05), _zero(128), _scale(0.04), _zero(120)],
     {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ("sigmoid", "QLinearSigmoid", "com.microsoft",
     [_u8(2, 6), _scale(0.05), _zero(128), _scale(1 / 256), _zero(0)], {}),
    ("leaky_relu", "QLinearLeakyRelu", "com.microsoft",
     [_u8(2, 6), _scale(0.05), _zero(128), _scale(0.04), _zero(100)], {"alpha": 0.1}),
    ("concat", "QLinearConcat", "com.microsoft",
     [_scale(0.05), _zero(120), _u8(2, 3), _scale(0.04), _zero(128), _u8(2, 2, seed=1),
      _scale(0.06), _zero(100)], {"axis": 1}),
]


@vulkan_only
@pytest.mark.parametrize("name, op, domain, inputs, attrs", QOPERATOR_CASES,
                         ids=[c[0] for c in QOPERATOR_CASES])
def test_qoperator_op_matches_onnxruntime(device, name, op, domain, inputs, attrs):
    fed = {3} if op in ("QLinearAdd", "QLinearMul") else {2} if op == "QLinearConcat" else set()
    fed.add(0 if op != "QLinearConcat" else 5)
    names = [f"in{k}" for k in range(len(inputs))]
    feeds = {names[k]: inputs[k] for k in sorted(fed)}
    graph_inputs = [tensor_info(names[k], helper.np_dtype_to_tensor_dtype(inputs[k].dtype),
                                inputs[k].shape) for k in sorted(fed)]
    initializers = [numpy_helper.from_array(v, n) for k, (n, v) in enumerate(zip(names, inputs))
                    if k not in fed]
    node = helper.make_node(op, names, ["y"], domain=domain, **attrs)
    model = helper.make_model(
        helper.make_graph([node], op, graph_inputs, [onnx.ValueInfoProto(name="y")],
                          initializers),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    (want,) = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, feeds)
    model.graph.ClearField("output")
    model.graph.output.append(tensor_info("y", helper.np_dtype_to_tensor_dtype(want.dtype),
                                          want.shape))
    _, (got,) = vkml_forward(model, feeds, device)
    if want.dtype.kind == "f":
        assert rel_l2(got, want) < FORWARD_TOL
    else:
        np.testing.assert_array_equal(got, want)


# ---- external data -----------------------------------------------------------------------------
def _external(tmp_path, module, x):
    path = tmp_path / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), str(tmp_path / "plain.onnx"), dynamo=False,
                          input_names=["x"], output_names=["logits"])
    onnx.save_model(onnx.load(str(tmp_path / "plain.onnx")), str(path),
                    save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=0)
    return path


def one_step_against_float64(imp, wide, x: np.ndarray, device):
    """One SGD step of the imported model on sum(logits^2), every gradient checked against
    `wide` (the module in float64, holding the file's values) on the same input."""
    g = imp.graph
    s = vkml.compile(g, loss=g.sum(g.square(imp.outputs["logits"])),
                     optimizer=vkml.SGD(lr=0.01), outputs=imp.outputs, device=device,
                     keep_grads=True)
    s.set_input("x", x)
    s.step()
    wide(torch.tensor(x, dtype=torch.float64)).square().sum().backward()
    for name, p in wide.named_parameters():
        assert rel_l2(s.grad(name), p.grad.numpy()) < GRAD_TOL, name
    return s


@vulkan_only
def test_external_data_model_trains_and_saves_back(device, tmp_path):
    """Weights in a side file, loaded by path: the gradients against PyTorch's, the trained
    model saved back (names and dtypes kept) runs in onnxruntime as vkml computes it."""
    torch.manual_seed(0)
    module, x = MLP(), torch.randn(5, 6)
    path = _external(tmp_path, module, x)
    assert (tmp_path / "weights.bin").stat().st_size > 0
    imp = vkml.import_onnx(path)
    s = one_step_against_float64(imp, copy.deepcopy(module).double(), x.numpy(), device)
    saved = tmp_path / "tuned.onnx"
    imp.save_onnx(s, str(saved))
    tuned = onnx.load(str(saved))
    assert {(t.name, t.data_type) for t in tuned.graph.initializer} == \
        {(t.name, t.data_type) for t in onnx.load(str(path)).graph.initializer}
    s.forward()
    (after,) = onnxruntime_exact(str(saved), {"x": x.numpy()})
    assert rel_l2(after, s.read("logits")) < FORWARD_TOL


def test_missing_external_data_names_the_file(tmp_path):
    torch.manual_seed(0)
    path = _external(tmp_path, MLP(), torch.randn(5, 6))
    unloaded = onnx.load(str(path), load_external_data=False)
    with pytest.raises(vkml.ModelImportError, match="weights.bin.*pass the file's path"):
        vkml.import_onnx(unloaded)
    (tmp_path / "weights.bin").unlink()
    with pytest.raises(vkml.ModelImportError, match=f"{tmp_path / 'weights.bin'}"):
        vkml.import_onnx(path)


@vulkan_only
def test_float16_model_trains_and_saves_back_in_float16(device, tmp_path):
    """A model.half() export trained in f32 from its float16 weights: gradients against
    PyTorch in float64 from the same values; saved back, its initializers are float16 again
    under their names, and onnxruntime runs it."""
    torch.manual_seed(0)
    module, x = MLP(), torch.randn(5, 6)
    model = float16_models(module, x, tmp_path)["half"]
    imp = vkml.import_onnx(model)
    s = one_step_against_float64(imp, copy.deepcopy(module).half().double(), x.half().numpy(),
                                 device)
    saved = tmp_path / "tuned.onnx"
    imp.save_onnx(s, str(saved))
    tuned = onnx.load(str(saved))
    assert {(t.name, t.data_type) for t in tuned.graph.initializer} == \
        {(t.name, t.data_type) for t in model.graph.initializer}
    for t in tuned.graph.initializer:
        if t.name in s.params():
            assert np.array_equal(numpy_helper.to_array(t),
                                  s.params()[t.name].astype(np.float16)), t.name
    (after,) = onnxruntime_exact(str(saved), {"x": x.half().numpy()})
    assert after.dtype == np.float16


# ---- open dimensions ---------------------------------------------------------------------------
def _ids_and_mask_model():
    table = np.random.default_rng(0).standard_normal((10, 4)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"]),
             helper.make_node("Unsqueeze", ["mask", "last"], ["m"]),
             helper.make_node("Mul", ["e", "m"], ["y"])]
    return make_model(nodes, [tensor_info("ids", T.INT64, ("batch", "seq")),
                              tensor_info("mask", T.FLOAT, ("batch", "seq"))],
                      [tensor_info("y", T.FLOAT, ("batch", "seq", 4))],
                      [numpy_helper.from_array(table, "table"),
                       numpy_helper.from_array(np.array([-1]), "last")])


@vulkan_only
@pytest.mark.parametrize("shapes", [{"batch": 2, "seq": 5}, {"ids": (2, 5)},
                                    {"ids": (2, 5), "mask": (2, 5)}, {"batch": 2, "mask": (2, 5)}])
def test_named_dimensions_resolve_by_name_or_by_input(device, shapes):
    """A dimension fixed once (by its name, or by an input's shape) is fixed for every input
    that has it."""
    rng = np.random.default_rng(0)
    feeds = {"ids": rng.integers(0, 10, (2, 5)), "mask": (rng.random((2, 5)) > 0.3)
             .astype(np.float32)}
    imp = check_against_onnxruntime(_ids_and_mask_model(), feeds, device, shapes=shapes)
    assert imp.inputs["mask"].shape == (2, 5)


@vulkan_only
def test_exported_dynamic_axes_resolve_at_any_size(device, tmp_path):
    """torch.onnx's dynamic_axes: the shape arithmetic the exporter writes for them (Shape,
    Gather, Concat into Reshape) is computed at import for the sizes given."""
    torch.manual_seed(0)
    path = str(tmp_path / "block.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(TinyBlock().eval(), (torch.randn(2, 6, 16),), path, dynamo=False,
                          input_names=["x"], output_names=["logits"],
                          dynamic_axes={"x": {0: "batch", 1: "seq"}}, opset_version=17)
    for batch, seq in ((3, 9), (1, 4)):
        x = torch.randn(batch, seq, 16).numpy()
        check_against_onnxruntime(path, {"x": x}, device, shapes={"batch": batch, "seq": seq})


def test_open_dimensions_are_named_with_the_fix():
    model = _ids_and_mask_model()
    with pytest.raises(vkml.ModelImportError,
                       match=r"'ids' \('batch', 'seq'\): axis 1 'seq'.*shapes=\{'batch': 1, "
                             r"'seq': 1\}"):
        vkml.import_onnx(model, shapes={"batch": 2})
    with pytest.raises(vkml.ModelImportError, match="dimension 'seq' two sizes, 6 and 5"):
        vkml.import_onnx(model, shapes={"ids": (2, 5), "seq": 6})
    with pytest.raises(vkml.ModelImportError, match=r"\['bogus'\].*\['batch', 'seq'\]"):
        vkml.import_onnx(model, shapes={"bogus": 3})
    for how in ("minus one", "zero", "unnamed"):
        x = tensor_info("x", T.FLOAT, (3, 4))
        dim = x.type.tensor_type.shape.dim[0]
        dim.Clear()
        if how != "unnamed":
            dim.dim_value = -1 if how == "minus one" else 0
        relu = make_model([helper.make_node("Relu", ["x"], ["y"])], [x],
                          [tensor_info("y", T.FLOAT, ("n", 4))])
        with pytest.raises(vkml.ModelImportError,
                           match=r"'x' \(\(unnamed\), 4\): axis 0 \(unnamed\).*'x': \(1, 4\)"):
            vkml.import_onnx(relu)
        assert vkml.import_onnx(relu, shapes={"x": (3, 4)}).inputs["x"].shape == (3, 4)


# ---- old-style and unusual graphs --------------------------------------------------------------
def _x_w():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((2, 4)).astype(np.float32),
            rng.standard_normal((4, 3)).astype(np.float32))


@vulkan_only
def test_initializers_listed_as_inputs_are_parameters(device):
    """IR version 3 files list every initializer among the graph's inputs too."""
    x, w = _x_w()
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])],
                       [tensor_info("x", T.FLOAT, (2, 4)), tensor_info("w", T.FLOAT, (4, 3))],
                       [tensor_info("y", T.FLOAT, (2, 3))], [numpy_helper.from_array(w, "w")])
    model.ir_version = 3
    imp = check_against_onnxruntime(model, {"x": x}, device)
    assert list(imp.inputs) == ["x"] and list(imp.graph.params) == ["w"]
    # as torch.onnx writes them (keep_initializers_as_inputs, opset 11: IR version 6)
    torch.manual_seed(0)
    module, x = MLP(), torch.randn(5, 6)
    file = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), file, dynamo=False, input_names=["x"],
                          output_names=["logits"], keep_initializers_as_inputs=True,
                          opset_version=11)
    model = onnx.load_from_string(file.getvalue())
    assert len(model.graph.input) == 5
    imp = check_against_onnxruntime(model, {"x": x.numpy()}, device)
    assert list(imp.inputs) == ["x"] and set(imp.graph.params) == set(module.state_dict())


@vulkan_only
def test_sparse_initializers_are_constants(device):
    x, w = _x_w()
    values = helper.make_tensor("w", T.FLOAT, (3,), [1.5, -2.0, 0.5])
    positions = helper.make_tensor("w_at", T.INT64, (3,), [0, 5, 10])
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])],
                       [tensor_info("x", T.FLOAT, (2, 4))], [tensor_info("y", T.FLOAT, (2, 3))])
    model.graph.sparse_initializer.append(helper.make_sparse_tensor(values, positions, (4, 3)))
    imp = check_against_onnxruntime(model, {"x": x}, device)
    assert not imp.graph.params


@vulkan_only
def test_local_functions_are_inlined_and_saved_back_as_they_were(device, tmp_path):
    """torch.onnx's export_modules_as_functions: each module a function of the model."""
    torch.manual_seed(0)
    module, x = TinyBlock().eval(), torch.randn(2, 6, 16)
    path = tmp_path / "functions.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), str(path), dynamo=False, input_names=["x"],
                          output_names=["logits"], opset_version=17,
                          export_modules_as_functions={torch.nn.LayerNorm, torch.nn.Linear})
    model = onnx.load(str(path))
    assert model.functions
    imp = check_against_onnxruntime(model, {"x": x.numpy()}, device)
    g = imp.graph
    (name, y), = imp.outputs.items()  # the exporter names it itself here
    s = vkml.compile(g, loss=g.sum(g.square(y)), optimizer=vkml.SGD(lr=0.1), outputs=imp.outputs,
                     device=device)
    s.set_input("x", x.numpy())
    s.step()
    imp.save_onnx(s, str(tmp_path / "tuned.onnx"))
    tuned = onnx.load(str(tmp_path / "tuned.onnx"))
    assert [f.name for f in tuned.functions] == [f.name for f in model.functions]
    s.forward()
    (after,) = onnxruntime_exact(str(tmp_path / "tuned.onnx"), {"x": x.numpy()})
    assert rel_l2(after, s.read(name)) < FORWARD_TOL


CONSTANTS = {
    "value": helper.make_tensor("c", T.FLOAT, (3,), [1.0, 2.0, 3.0]),
    "value_float": 2.5, "value_floats": [1.0, -2.0, 3.0], "value_int": 2,
    "value_ints": [1, 2, 3],
    "sparse_value": helper.make_sparse_tensor(helper.make_tensor("v", T.FLOAT, (2,), [5.0, 7.0]),
                                              helper.make_tensor("i", T.INT64, (2,), [1, 2]),
                                              (3,)),
}


@vulkan_only
@pytest.mark.parametrize("form", CONSTANTS)
def test_constant_nodes_in_every_form(device, form):
    nodes = [helper.make_node("Constant", [], ["c"], **{form: CONSTANTS[form]}),
             helper.make_node("Cast", ["c"], ["cf"], to=T.FLOAT),
             helper.make_node("Add", ["x", "cf"], ["y"])]
    model = make_model(nodes, [tensor_info("x", T.FLOAT, (2, 3))],
                       [tensor_info("y", T.FLOAT, (2, 3))])
    check_against_onnxruntime(model, {"x": _x_w()[1][:2]}, device)


@vulkan_only
def test_empty_optional_inputs_and_outputs(device):
    """"" for an input or output an op may leave out: Clip's minimum, Resize's roi, Dropout's
    mask output."""
    x = _x_w()[1][:2]
    nodes = [helper.make_node("Clip", ["x", "", "top"], ["c"]),
             helper.make_node("Dropout", ["c"], ["d", ""]),
             helper.make_node("Reshape", ["d", "square"], ["r"]),
             helper.make_node("Resize", ["r", "", "scales"], ["y"], mode="nearest")]
    model = make_model(nodes, [tensor_info("x", T.FLOAT, (2, 3))],
                       [tensor_info("y", T.FLOAT, (1, 1, 4, 6))],
                       [numpy_helper.from_array(np.array(0.3, np.float32), "top"),
                        numpy_helper.from_array(np.array([1, 1, 2, 3]), "square"),
                        numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")])
    check_against_onnxruntime(model, {"x": x}, device)


@vulkan_only
def test_outputs_that_are_inputs_or_initializers_and_unused_initializers(device):
    x, w = _x_w()
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])],
                       [tensor_info("x", T.FLOAT, (2, 4))],
                       [tensor_info("y", T.FLOAT, (2, 3)), tensor_info("w", T.FLOAT, (4, 3)),
                        tensor_info("x", T.FLOAT, (2, 4)), tensor_info("k", T.INT64, (2,))],
                       [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w, "unused"),
                        numpy_helper.from_array(np.array([3, 4]), "k")])
    imp = check_against_onnxruntime(model, {"x": x}, device)
    assert list(imp.outputs) == ["y", "w", "x", "k"] and "unused" not in imp.graph.params


def _branch(op, name, initializer=None):
    nodes = [helper.make_node(op, ["x", *([initializer.name] if initializer else [])], [name])]
    return helper.make_graph(nodes, name, [], [tensor_info(name, T.FLOAT, (2, 4))],
                             [initializer] if initializer else [])


@vulkan_only
@pytest.mark.parametrize("condition", ["initializer", "constant", "shape arithmetic"])
def test_if_on_a_condition_known_at_import_is_inlined(device, condition):
    """The branch taken, with its own initializers and reading the outer graph's values."""
    bias = numpy_helper.from_array(np.full((2, 4), 0.5, np.float32), "bias")
    node = helper.make_node("If", ["cond"], ["y"], then_branch=_branch("Add", "t", bias),
                            else_branch=_branch("Neg", "e"))
    nodes, initializers = [node], []
    if condition == "initializer":
        initializers = [numpy_helper.from_array(np.array(True), "cond")]
    elif condition == "constant":
        nodes.insert(0, helper.make_node("Constant", [], ["cond"],
                                         value=numpy_helper.from_array(np.array(False))))
    else:  # 2 + 4 > 5
        nodes[:0] = [helper.make_node("Shape", ["x"], ["shape"]),
                     helper.make_node("ReduceSum", ["shape"], ["total"], keepdims=0),
                     helper.make_node("Greater", ["total", "five"], ["cond"])]
        initializers = [numpy_helper.from_array(np.array(5), "five")]
    model = make_model(nodes, [tensor_info("x", T.FLOAT, (2, 4))],
                       [tensor_info("y", T.FLOAT, (2, 4))], initializers)
    check_against_onnxruntime(model, {"x": _x_w()[0]}, device)


def test_if_on_a_run_time_condition_is_refused():
    node = helper.make_node("If", ["cond"], ["y"], then_branch=_branch("Relu", "t"),
                            else_branch=_branch("Neg", "e"))
    model = make_model([node], [tensor_info("x", T.FLOAT, (2, 4)),
                                tensor_info("cond", T.BOOL, ())],
                       [tensor_info("y", T.FLOAT, (2, 4))])
    with pytest.raises(vkml.ModelImportError, match="condition must be known at import"):
        vkml.import_onnx(model)


def test_loops_are_refused_even_over_a_known_trip_count():
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Add", ["total_in", "x"], ["total_out"])], "body",
        [tensor_info("i", T.INT64, ()), tensor_info("cond_in", T.BOOL, ()),
         tensor_info("total_in", T.FLOAT, (2, 4))],
        [tensor_info("cond_out", T.BOOL, ()), tensor_info("total_out", T.FLOAT, (2, 4))])
    model = make_model([helper.make_node("Loop", ["three", "", "zeros"], ["y"], body=body)],
                       [tensor_info("x", T.FLOAT, (2, 4))], [tensor_info("y", T.FLOAT, (2, 4))],
                       [numpy_helper.from_array(np.array(3), "three"),
                        numpy_helper.from_array(np.zeros((2, 4), np.float32), "zeros")])
    with pytest.raises(vkml.ModelImportError, match="Loop.*not even over a trip count known"):
        vkml.import_onnx(model)


@vulkan_only
def test_missing_and_wrong_shape_information_is_not_needed(device):
    """vkml computes every shape itself: a value_info that contradicts the graph (onnx's
    strict shape inference fails on it), none at all, and outputs declared by name alone
    (typed from onnx's inference for its checker)."""
    x, w = _x_w()
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    wrong = make_model(nodes, [tensor_info("x", T.FLOAT, (2, 4))],
                       [tensor_info("y", T.FLOAT, (2, 3))], [numpy_helper.from_array(w, "w")])
    wrong.graph.value_info.append(tensor_info("h", T.FLOAT, (7, 7)))
    with pytest.raises(onnx.shape_inference.InferenceError):
        onnx.shape_inference.infer_shapes(wrong, strict_mode=True)
    check_against_onnxruntime(wrong, {"x": x}, device)
    untyped = make_model(nodes, [tensor_info("x", T.FLOAT, (2, 4))],
                         [onnx.ValueInfoProto(name="y")], [numpy_helper.from_array(w, "w")])
    check_against_onnxruntime(untyped, {"x": x}, device)
    assert not untyped.graph.output[0].HasField("type")  # the caller's model left as it was


# ---- onnxruntime's offline optimizer and its contrib ops ---------------------------------------
class Mixer(torch.nn.Module):
    """What onnxruntime's fusions look for: nn.MultiheadAttention (its batched products become
    FusedMatMul with transBatch), LayerNorm after a residual sum (SkipLayerNormalization),
    exact, tanh and quick GELU, a convolution with ReLU (FusedConv)."""

    def __init__(self, dim=16):
        super().__init__()
        self.conv = torch.nn.Conv1d(dim, dim, 3, padding=1)
        self.attn = torch.nn.MultiheadAttention(dim, 2, batch_first=True)
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.fc1, self.fc2 = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)
        self.fc3 = torch.nn.Linear(dim, dim)

    def forward(self, x):
        h = self.ln1(x)
        x = self.ln2(x + self.attn(h, h, h, need_weights=False)[0])
        x = torch.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        h = self.fc3(torch.nn.functional.gelu(x, approximate="tanh"))
        return h * torch.sigmoid(1.702 * h)


def onnxruntime_optimized(tmp_path, level: str, opset: int, module=None, x=None):
    """A module (Mixer) exported at `opset`, as onnxruntime's offline optimizer writes it at
    `level`."""
    torch.manual_seed(0)
    if module is None:
        module, x = Mixer().eval(), torch.randn(2, 6, 16)
    source = str(tmp_path / "model.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), source, dynamo=False, input_names=["x"],
                          output_names=["y"], opset_version=opset)
    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, f"ORT_ENABLE_{level}")
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    return onnx.load(options.optimized_model_filepath), x


@vulkan_only
@pytest.mark.parametrize("level", ["BASIC", "EXTENDED"])
@pytest.mark.parametrize("opset", [14, 17])
def test_onnxruntime_optimized_models_match_onnxruntime(device, tmp_path, level, opset):
    """Written by onnxruntime's offline optimizer: at EXTENDED its fusions (contrib ops), and at
    opset 14 its LayerNormalization in the standard domain, which ONNX defines only from 17."""
    model, x = onnxruntime_optimized(tmp_path, level, opset)
    ops = {n.op_type for n in model.graph.node if n.domain == "com.microsoft"}
    if level == "EXTENDED":
        assert {"FusedConv", "FusedMatMul", "Gelu", "QuickGelu", "SkipLayerNormalization"} <= ops
        assert "LayerNormalization" in {n.op_type for n in model.graph.node if not n.domain}
    check_against_onnxruntime(model, {"x": x.numpy()}, device)


# onnxruntime has these for its GPUs only: the float64 reference stands in for it
ORT_CPU_LACKS = {"BiasAdd"}


def _ms_model(op, inputs, attrs, outputs=("y",), reference=None):
    """One com.microsoft node: floats of more than one element as initializers (parameters),
    the rest graph inputs; outputs typed by onnxruntime's run of it (or the reference's)."""
    names = [f"in{k}" if v is not None else "" for k, v in enumerate(inputs)]
    feeds, initializers, graph_inputs = {}, [], []
    for name, value in zip(names, inputs):
        if value is None:
            continue
        if value.dtype.kind == "f" and value.size > 1 and name != "in0":
            initializers.append(numpy_helper.from_array(value, name))
        else:
            feeds[name] = value
            graph_inputs.append(tensor_info(name, helper.np_dtype_to_tensor_dtype(value.dtype),
                                            value.shape))
    node = helper.make_node(op, names, list(outputs), domain="com.microsoft", **attrs)
    untyped = [onnx.ValueInfoProto(name=o) for o in outputs if o]
    model = helper.make_model(helper.make_graph([node], op, graph_inputs, untyped, initializers),
                              opset_imports=[helper.make_opsetid("", 17),
                                             helper.make_opsetid("com.microsoft", 1)])
    if op in ORT_CPU_LACKS:
        wide = [torch.tensor(v, dtype=torch.float64) for v in inputs]
        values = [reference(*wide).numpy().astype(np.float32)]
    else:
        values = ort.InferenceSession(model.SerializeToString(),
                                      providers=["CPUExecutionProvider"]).run(None, feeds)
    model.graph.ClearField("output")
    model.graph.output.extend(tensor_info(o, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                              for o, v in zip([o for o in outputs if o], values))
    return model, feeds, values


def _f(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _sdpa(q, k, v, heads, mask=None, causal=False, scale=None):
    b, s, _ = q.shape
    split = [z.reshape(b, z.shape[1], heads, -1).transpose(1, 2) for z in (q, k, v)]
    y = torch.nn.functional.scaled_dot_product_attention(*split, attn_mask=mask,
                                                         is_causal=causal, scale=scale)
    return y.transpose(1, 2).reshape(b, s, -1)


def _gelu(x, approximate="none"):
    return torch.nn.functional.gelu(x, approximate=approximate)


def _qkv(x, w, bias):
    return (x @ w + bias).split(w.shape[1] // 3, -1)


RAW_MASK = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.int32)
PADDING = torch.tensor(np.where(RAW_MASK > 0, 0.0, -10000.0)[:, None, None, :])
# keys 1 to 3 of the first row, all of the second
LEFT_PADDING = torch.tensor(np.where([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]], 0.0,
                                     -10000.0)[:, None, None, :])
IDS = np.random.default_rng(5).integers(0, 10, (2, 5)).astype(np.int32)
# (name, op, inputs (in0 the graph's input), attributes, the float64 torch reference of the
# initializers (in1...) given in0, or None for forward only)
MS_CASES = [
    ("fused_conv_leaky_z", "FusedConv", [_f(2, 3, 6, 6), _f(4, 3, 3, 3, seed=1), _f(4, seed=2),
                                         _f(2, 4, 6, 6, seed=3)],
     {"activation": "LeakyRelu", "activation_params": [0.2], "pads": [1, 1, 1, 1]},
     lambda x, w, b, z: torch.nn.functional.leaky_relu(
         torch.nn.functional.conv2d(x, w, b, padding=1) + z, 0.2)),
    ("fused_conv_clip", "FusedConv", [_f(1, 3, 5, 5), _f(2, 3, 3, 3, seed=1)],
     {"activation": "Clip", "activation_params": [-0.5, 0.5], "strides": [2, 2]},
     lambda x, w: torch.clamp(torch.nn.functional.conv2d(x, w, stride=2), -0.5, 0.5)),
    ("fused_matmul_trans", "FusedMatMul", [_f(2, 5, 3), _f(2, 4, 5, seed=1)],
     {"alpha": 0.5, "transA": 1, "transB": 1},
     lambda a, b: 0.5 * a.transpose(-1, -2) @ b.transpose(-1, -2)),
    ("fused_matmul_trans_batch", "FusedMatMul", [_f(5, 4, 3), _f(2, 4, 3, seed=1)],
     {"transBatchA": 1, "transBatchB": 1, "transB": 1},
     lambda a, b: a.transpose(0, 1) @ b.permute(1, 0, 2).transpose(-1, -2)),
    ("fused_matmul_trans_batch_4d", "FusedMatMul", [_f(5, 2, 3, 4), _f(2, 3, 4, 6, seed=1)],
     {"transBatchA": 1}, lambda a, b: a.permute(1, 2, 0, 3) @ b),
    ("gelu", "Gelu", [_f(3, 8)], {}, None),
    ("bias_gelu", "BiasGelu", [_f(3, 8), _f(8, seed=1)], {}, lambda x, b: _gelu(x + b)),
    ("fast_gelu_bias", "FastGelu", [_f(3, 8), _f(8, seed=1)], {},
     lambda x, b: _gelu(x + b, "tanh")),
    ("quick_gelu", "QuickGelu", [_f(3, 8)], {"alpha": 1.5}, None),
    ("bias_add", "BiasAdd", [_f(2, 4, 8), _f(8, seed=1), _f(2, 4, 8, seed=2)], {},
     lambda x, b, s: x + b + s),
    ("skip_layer_norm", "SkipLayerNormalization",
     [_f(2, 3, 8), _f(2, 3, 8, seed=1), _f(8, seed=2), _f(8, seed=3), _f(8, seed=4)],
     {"epsilon": 1e-5},
     lambda x, s, g, b, c: torch.nn.functional.layer_norm(x + s + c, (8,), g, b, 1e-5)),
    ("skip_simplified_layer_norm", "SkipSimplifiedLayerNormalization",
     [_f(2, 3, 8), _f(2, 3, 8, seed=1), _f(8, seed=2)], {"epsilon": 1e-6},
     lambda x, s, g: torch.nn.functional.rms_norm(x + s, (8,), g, 1e-6)),
    ("attention_mask", "Attention",
     [_f(2, 5, 8), _f(8, 24, seed=1), _f(24, seed=2), RAW_MASK], {"num_heads": 2},
     lambda x, w, b, m: _sdpa(*_qkv(x, w, b), 2, PADDING)),
    ("attention_unidirectional", "Attention", [_f(2, 5, 8), _f(8, 24, seed=1), _f(24, seed=2)],
     {"num_heads": 2, "unidirectional": 1, "scale": 0.25},
     lambda x, w, b: _sdpa(*_qkv(x, w, b), 2, causal=True, scale=0.25)),
    ("attention_value_width", "Attention", [_f(2, 5, 8), _f(8, 20, seed=1), _f(20, seed=2)],
     {"num_heads": 2, "qkv_hidden_sizes": [8, 8, 4]},
     lambda x, w, b: _sdpa(*(x @ w + b).split([8, 8, 4], -1), 2)),
    ("attention_lengths", "Attention",
     [_f(2, 5, 8), _f(8, 24, seed=1), _f(24, seed=2), RAW_MASK.sum(1).astype(np.int32)],
     {"num_heads": 2}, lambda x, w, b, m: _sdpa(*_qkv(x, w, b), 2, PADDING)),
    ("attention_left_padding", "Attention",
     [_f(2, 5, 8), _f(8, 24, seed=1), _f(24, seed=2), np.array([4, 5, 1, 0], np.int32)],
     {"num_heads": 2}, lambda x, w, b, m: _sdpa(*_qkv(x, w, b), 2, LEFT_PADDING)),
    ("embed_layer_norm", "EmbedLayerNormalization",
     [IDS, IDS % 2, _f(10, 8), _f(6, 8, seed=1), _f(2, 8, seed=2), _f(8, seed=3),
      _f(8, seed=4), RAW_MASK], {},
     lambda ids, seg, w, p, st, gm, bt, m: torch.nn.functional.layer_norm(
         w[ids.long()] + p[:5] + st[seg.long()], (8,), gm, bt, 1e-12)),
    ("multi_head_attention", "MultiHeadAttention",
     [_f(2, 4, 8), _f(2, 5, 8, seed=1), _f(2, 5, 8, seed=2), _f(24, seed=3), RAW_MASK],
     {"num_heads": 2, "scale": 0.0},  # onnxruntime's "unset": 1 / sqrt(size)
     lambda q, k, v, b, m: _sdpa(q + b[:8], k + b[8:16], v + b[16:], 2, PADDING)),
]


@vulkan_only
@pytest.mark.parametrize("name, op, inputs, attrs, reference", MS_CASES,
                         ids=[c[0] for c in MS_CASES])
def test_contrib_op_matches_onnxruntime_and_torch(device, name, op, inputs, attrs, reference):
    # the saved statistics left out (vkml does not give them), the sum of the inputs read
    outputs = {"SkipLayerNormalization": ("y", "", "", "sum"),
               "SkipSimplifiedLayerNormalization": ("y", "", "", "sum"),
               "EmbedLayerNormalization": ("y", "mask_index", "sum")}.get(op, ("y",))
    model, feeds, wants = _ms_model(op, inputs, attrs, outputs, reference)
    imp = vkml.import_onnx(model)
    g = imp.graph
    y = imp.outputs["y"]
    weights = np.random.default_rng(7).standard_normal(y.shape).astype(np.float32)
    loss = g.sum(g.mul(y, g.constant(weights))) if reference is not None else None
    s = vkml.compile(g, loss=loss, outputs=imp.outputs, device=device)
    for feed, value in feeds.items():
        s.set_input(feed, value)
    s.step() if loss is not None else s.forward()
    for output, want in zip([o for o in outputs if o], wants):
        if want.dtype.kind in "iu":
            np.testing.assert_array_equal(s.read(output), want)
        else:
            assert rel_l2(s.read(output), want) < FORWARD_TOL, output
    if reference is None:
        return
    tensors = [torch.tensor(v, dtype=torch.float64, requires_grad=v.dtype.kind == "f")
               for v in inputs]
    out = reference(*tensors)
    assert rel_l2(out.detach().numpy(), wants[0]) < FORWARD_TOL  # the reference is onnxruntime's
    (out * torch.tensor(weights, dtype=torch.float64)).sum().backward()
    for k, t in enumerate(tensors):
        if f"in{k}" in imp.graph.params:
            assert rel_l2(s.grad(f"in{k}"), t.grad.numpy()) < GRAD_TOL, k


@vulkan_only
def test_onnxruntime_layout_optimizations_are_refused_by_domain(device, tmp_path):
    """ORT_ENABLE_ALL's layouts for the CPU it ran on (blocked channels on x86 with AVX2 or
    AVX-512): com.microsoft.nchwc's ops, refused; where it wrote none, the model imports."""
    model, x = onnxruntime_optimized(tmp_path, "ALL", 17, SmallCNN().eval(),
                                     torch.randn(2, 3, 8, 8))
    if any(n.domain == "com.microsoft.nchwc" for n in model.graph.node):
        with pytest.raises(vkml.ModelImportError, match=r"com\.microsoft\.nchwc::Conv x"):
            vkml.import_onnx(model)
    else:
        check_against_onnxruntime(model, {"x": x.numpy()}, device)


NBITS = [(bits, zero) for bits in (2, 4, 8) for zero in ("float", "packed", "none")
         if (bits, zero) != (8, "float")]  # onnxruntime's CPU kernel refuses that one


@vulkan_only
@pytest.mark.parametrize("bits, zero", NBITS, ids=[f"{b}bit-{z}" for b, z in NBITS])
def test_matmul_nbits_matches_onnxruntime(device, bits, zero):
    """Block-quantized weights (K = 20 in blocks of 16: the last one padded), zero points as
    floats, packed like the weights, or the default 2 ** (bits - 1)."""
    rng = np.random.default_rng(bits)
    depth, width, block = 20, 3, 16
    blocks = -(-depth // block)
    initializers = [
        numpy_helper.from_array(rng.integers(0, 256, (width, blocks, block * bits // 8))
                                .astype(np.uint8), "B"),
        numpy_helper.from_array(rng.random(width * blocks).astype(np.float32) * 0.1, "s")]
    if zero == "float":
        initializers.append(numpy_helper.from_array(
            rng.random(width * blocks).astype(np.float32) * 2 ** bits, "z"))
    elif zero == "packed":
        initializers.append(numpy_helper.from_array(
            rng.integers(0, 256, width * -(-blocks * bits // 8)).astype(np.uint8), "z"))
    node = helper.make_node("MatMulNBits", ["A", *[t.name for t in initializers][:3]], ["y"],
                            domain="com.microsoft", K=depth, N=width, bits=bits,
                            block_size=block)
    model = helper.make_model(
        helper.make_graph([node], "nbits", [tensor_info("A", T.FLOAT, (2, depth))],
                          [tensor_info("y", T.FLOAT, (2, width))], initializers),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    x = rng.standard_normal((2, depth)).astype(np.float32)
    check_against_onnxruntime(model, {"A": x}, device)


@vulkan_only
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_quantized_model_matches_onnxruntime(device, tmp_path, symmetric):
    """onnxruntime's MatMulNBitsQuantizer (int4 weights in blocks of 16, as LLM exports carry
    them) of a two-layer MLP."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                 torch.nn.Linear(64, 16))
    x = torch.randn(1, 3, 32)  # 3-D: Linear exported as MatMul, which the quantizer takes
    file = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), file, dynamo=False, input_names=["x"],
                          output_names=["logits"])
    quantizer = MatMulNBitsQuantizer(onnx.load_from_string(file.getvalue()), block_size=16,
                                     is_symmetric=symmetric)
    quantizer.process()
    model = quantizer.model.model
    assert [n.op_type for n in model.graph.node].count("MatMulNBits") == 2
    imp = check_against_onnxruntime(model, {"x": x.numpy()}, device)
    assert set(imp.graph.params) == {"0.bias", "2.bias"}  # the int4 weights are constants


ROPE = [("3d", 0, "ids"), ("3d", 1, "offset"), ("4d", 1, "ids"), ("4d", 0, "offset")]


@vulkan_only
@pytest.mark.parametrize("layout, interleaved, positions", ROPE,
                         ids=["-".join(map(str, c)) for c in ROPE])
def test_contrib_rotary_embedding_matches_onnxruntime(device, layout, interleaved, positions):
    """com.microsoft's RotaryEmbedding: (batch, length, hidden) or (batch, heads, length,
    size), position ids per token or one offset, both fed at run time."""
    rng = np.random.default_rng(interleaved)
    batch, length, heads, size = 2, 5, 2, 8
    shape = (batch, length, heads * size) if layout == "3d" else (batch, heads, length, size)
    caches = [numpy_helper.from_array(f(rng.random((16, size // 2))).astype(np.float32), name)
              for f, name in ((np.cos, "cos"), (np.sin, "sin"))]
    ids = (rng.integers(0, 10, (batch, length)) if positions == "ids" else np.array([3]))
    attrs = {"interleaved": interleaved, **({"num_heads": heads} if interleaved else {})}
    node = helper.make_node("RotaryEmbedding", ["x", "ids", "cos", "sin"], ["y"],
                            domain="com.microsoft", **attrs)
    model = helper.make_model(
        helper.make_graph([node], "rope", [tensor_info("x", T.FLOAT, shape),
                                           tensor_info("ids", T.INT64, ids.shape)],
                          [tensor_info("y", T.FLOAT, shape)], caches),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    x = rng.standard_normal(shape).astype(np.float32)
    check_against_onnxruntime(model, {"x": x, "ids": ids}, device)


def test_contrib_ops_vkml_lacks_are_refused_by_domain_and_name():
    model, _, _ = _ms_model("Attention", [_f(2, 5, 8), _f(8, 24, seed=1), _f(24, seed=2), None,
                                          _f(2, 2, 2, 3, 4, seed=3)], {"num_heads": 2},
                            ("y", "present"))
    with pytest.raises(vkml.ModelImportError, match="past key/value state"):
        vkml.import_onnx(model)
    model, _, _ = _ms_model("Inverse", [_f(3, 3)], {})
    with pytest.raises(vkml.ModelImportError, match="com.microsoft::Inverse x1"):
        vkml.import_onnx(model)
