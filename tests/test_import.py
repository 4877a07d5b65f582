"""The front ends (vkml/importers/): small models exported by PyTorch to ONNX and through
torch.export, imported, and checked against onnxruntime and PyTorch: the forward pass,
every parameter's gradient, three AdamW steps against torch.optim, the trained model written
back (save_onnx -> onnxruntime, state_dict -> load_state_dict), and the refusals."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest

import vkml
from tests.conftest import rel_l2

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

FORWARD_TOL = 1e-4  # strict f32 against PyTorch / onnxruntime in f32
GRAD_TOL = 1e-4
STEPS = 3


# One backend: the importers build graphs; the backends are checked by every other test.
vulkan_only = pytest.mark.parametrize("device", ["vulkan"], indirect=True)


def export_onnx(module, args, path, names, outputs=("logits",), opset=17, **kw):
    """torch.onnx's TorchScript exporter: the spellings of older exports (LayerNorm, GELU and
    attention as primitives), and fast enough for a unit test."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), dynamo=False, input_names=list(names),
                          output_names=list(outputs), opset_version=opset, **kw)
    return str(path)


def onnxruntime_run(path, feeds):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def onnxruntime_error(path, x, device) -> float:
    """The imported model's logits for input `x` against onnxruntime's, relative L2."""
    imp = vkml.import_onnx(path)
    s = vkml.compile(imp.graph, outputs=imp.outputs, device=device)
    s.set_input("x", x.numpy())
    s.forward()
    (ref,) = onnxruntime_run(path, {"x": x.numpy()})
    return rel_l2(s.read("logits"), ref)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(6, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def torch_training(module, x, labels, steps=STEPS, lr=1e-2):
    """PyTorch's reference: the logits, every parameter's gradient at the start, and the
    parameters after `steps` AdamW steps on the mean cross-entropy."""
    module = copy.deepcopy(module)
    opt = torch.optim.AdamW(module.parameters(), lr=lr)
    grads, logits = {}, None
    for step in range(steps):
        opt.zero_grad()
        out = module(x)
        loss = torch.nn.functional.cross_entropy(out, labels)
        loss.backward()
        if step == 0:
            logits = out.detach().numpy()
            grads = {n: p.grad.numpy().copy() for n, p in module.named_parameters()}
        opt.step()
    return logits, grads, module


def check_training(imp, module, x, labels, vk, name_of=lambda n: n, tmp_path=None):
    """Forward, gradients and AdamW steps of an imported classifier against PyTorch's."""
    g = imp.graph
    (out_name, logits), = imp.outputs.items()
    (in_name,), = [tuple(imp.inputs)]
    loss = g.cross_entropy(logits, g.input("labels", (x.shape[0],), "i32"))
    ref_logits, ref_grads, trained = torch_training(module, x, labels)

    grads = vkml.compile(g, loss=loss, outputs=imp.outputs, device=vk)
    grads.set_input(in_name, x.numpy())
    grads.set_input("labels", labels.numpy())
    grads.step()
    assert rel_l2(grads.read(out_name), ref_logits) < FORWARD_TOL
    for torch_name, ref in ref_grads.items():
        assert rel_l2(grads.grad(name_of(torch_name)), ref) < GRAD_TOL, torch_name

    s = vkml.compile(g, loss=loss, optimizer=vkml.AdamW(lr=1e-2), outputs=imp.outputs,
                     device=vk)
    for _ in range(STEPS):
        s.set_input(in_name, x.numpy())
        s.set_input("labels", labels.numpy())
        s.step()
    params = s.params()
    for torch_name, p in trained.named_parameters():
        assert rel_l2(params[name_of(torch_name)], p.detach().numpy()) < FORWARD_TOL, torch_name
    return s, trained


@vulkan_only
def test_onnx_mlp_trains_as_pytorch_and_saves_back(device, tmp_path, monkeypatch):
    vk = device
    torch.manual_seed(0)
    module = MLP()
    x, labels = torch.randn(5, 6), torch.tensor([0, 3, 1, 2, 3])
    path = export_onnx(module, (x,), tmp_path / "mlp.onnx", ["x"])
    imp = vkml.import_onnx(path)
    assert set(imp.inputs) == {"x"} and set(imp.outputs) == {"logits"}
    assert set(imp.graph.params) == {n for n, _ in module.named_parameters()}
    s, trained = check_training(imp, module, x, labels, vk)

    tuned = tmp_path / "tuned.onnx"
    imp.save_onnx(s, str(tuned))
    (after,) = onnxruntime_run(tuned, {"x": x.numpy()})
    assert rel_l2(after, trained(x).detach().numpy()) < FORWARD_TOL
    s.forward()
    assert rel_l2(s.read("logits"), after) < FORWARD_TOL

    # a model past the size limit gets its tensors in a file beside it
    import vkml.importers.onnx as onnx_front
    monkeypatch.setattr(onnx_front, "EXTERNAL_DATA_ABOVE", 0)
    imp.save_onnx(s, str(tmp_path / "external.onnx"))
    assert (tmp_path / "external.onnx.data").stat().st_size > 0
    (external,) = onnxruntime_run(tmp_path / "external.onnx", {"x": x.numpy()})
    assert np.array_equal(external, after)


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        # no bias before a batch norm (its gradient is zero there in exact arithmetic)
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        y = torch.nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(y, 1), 1))


def _with_running_stats(module):
    """Running statistics other than the initial zeros and ones, so using them shows."""
    torch.manual_seed(1)
    for m in module.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    return module


@vulkan_only
def test_torch_cnn_batchnorm_trains_in_train_mode_and_loads_back(device):
    """Exported in train mode with training=True: batch norm over the batch's statistics, as
    PyTorch trains; the running statistics are frozen parameters; state_dict loads strictly."""
    torch.manual_seed(0)
    module = _with_running_stats(SmallCNN()).train()
    x, labels = torch.randn(2, 3, 8, 8), torch.tensor([2, 0])
    imp = vkml.import_torch(module, (x,), training=True)
    assert set(imp.frozen) == {"bn.running_mean", "bn.running_var"}
    assert set(imp.graph.params) == {n for n, _ in module.named_parameters()} | set(imp.frozen)
    s, _ = check_training(imp, module, x, labels, device)
    fresh = SmallCNN()
    fresh.load_state_dict(imp.state_dict(s), strict=True)
    for name, value in s.params().items():
        assert np.array_equal(fresh.state_dict()[name].numpy(), value), name
    # the running statistics come back as imported (vkml does not update them)
    assert torch.equal(fresh.bn.running_mean, module.bn.running_mean)


@vulkan_only
def test_torch_cnn_inference_form_uses_running_statistics(device):
    torch.manual_seed(0)
    module = _with_running_stats(SmallCNN()).train()
    x = torch.randn(2, 3, 8, 8)
    imp = vkml.import_torch(module, (x,), training=False)
    s = vkml.compile(imp.graph, outputs=imp.outputs, device=device)
    s.set_input("x", x.numpy())
    s.forward()
    assert rel_l2(s.read("output"), module.eval()(x).detach().numpy()) < FORWARD_TOL


class ConvTokens(torch.nn.Module):
    """LeViT's patch embedding's end: convolution, batch norm, then the image as tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x)).flatten(2).transpose(1, 2)


@vulkan_only
def test_torch_batchnorm_then_tokens_gets_the_true_gradient(device):
    """The reference spells batch norm as arithmetic: PyTorch's own CPU batch-norm backward
    (2.13, f32 and f64) sums the bias gradient wrongly for a batch of one whose incoming
    gradient has flatten(2).transpose(1, 2)'s strides (off 3x in a LeViT, where central
    differences agree with vkml), which made vkml's correct gradient look wrong."""
    torch.manual_seed(0)
    module = _with_running_stats(ConvTokens()).eval()
    with torch.no_grad():
        module.bn.weight.normal_()
        module.bn.bias.normal_()
    x = torch.randn(1, 3, 8, 8)
    target = torch.randn(1, 16, 4)
    imp = vkml.import_torch(module, (x,))
    g = imp.graph
    (y,) = imp.outputs.values()
    session = vkml.compile(g, loss=g.mse(y, g.input("target", target.shape)), device=device,
                           keep_grads=True)
    session.set_input("x", x.numpy())
    session.set_input("target", target.numpy())
    session.step()

    params = {n: p.detach().double().requires_grad_() for n, p in module.named_parameters()}
    bn = module.bn
    scale = params["bn.weight"] / torch.sqrt(bn.running_var.double() + bn.eps)
    conv = torch.nn.functional.conv2d(x.double(), params["conv.weight"], stride=2, padding=1)
    normed = ((conv - bn.running_mean.double()[:, None, None]) * scale[:, None, None]
              + params["bn.bias"][:, None, None])
    loss = torch.nn.functional.mse_loss(normed.flatten(2).transpose(1, 2), target.double())
    loss.backward()
    for name, p in params.items():
        assert rel_l2(session.grad(name), p.grad.numpy()) < GRAD_TOL, name
    session.close()


@vulkan_only
def test_onnx_cnn_matches_onnxruntime(device, tmp_path):
    """A convolution, max pooling and global average pooling (the TorchScript exporter folds
    an inference-mode batch norm into the convolution)."""
    torch.manual_seed(0)
    module = _with_running_stats(SmallCNN()).eval()
    x = torch.randn(2, 3, 8, 8)
    path = export_onnx(module, (x,), tmp_path / "cnn.onnx", ["x"],
                       dynamic_axes={"x": {0: "batch"}})
    with pytest.raises(vkml.ModelImportError, match="'x' .* axis 0 'batch'.*shapes="):
        vkml.import_onnx(path)
    imp = vkml.import_onnx(path, shapes={"x": (2, 3, 8, 8)})
    s = vkml.compile(imp.graph, outputs=imp.outputs, device=device)
    s.set_input("x", x.numpy())
    s.forward()
    (ref,) = onnxruntime_run(path, {"x": x.numpy()})
    assert rel_l2(s.read("logits"), ref) < FORWARD_TOL


class TinyBlock(torch.nn.Module):
    """A pre-norm transformer block: LayerNorm, causal multi-head attention, GELU MLP."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        # no bias on qkv: the key bias has a zero gradient in exact arithmetic, which AdamW
        # would turn into steps of lr from rounding noise on either side
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim)
        self.fc1, self.fc2 = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)
        self.head = torch.nn.Linear(dim, 5)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))
        return self.head(x[:, -1])


@vulkan_only
def test_torch_transformer_block_trains_as_pytorch(device):
    torch.manual_seed(0)
    module = TinyBlock()
    x, labels = torch.randn(2, 6, 16), torch.tensor([1, 4])
    imp = vkml.import_torch(module, (x,))
    check_training(imp, module, x, labels, device)


class Bounded(torch.nn.Module):
    """ReLU6 and Hardtanh on values that sit exactly on their bounds (x w, w = 1)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):
        return torch.nn.functional.relu6(x * self.w) + torch.nn.Hardtanh(-1.0, 2.0)(x * self.w)


@vulkan_only
def test_torch_hardtanh_and_relu6_import_with_torchs_gradient(device):
    # torch's hardtanh passes no gradient at its bounds, where clamp's does: imported as
    # clamp, an exported ReLU6 trained differently wherever its input was exactly 0 or 6
    module = Bounded()
    x = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 6.0, 7.0])
    imp = vkml.import_torch(module, (x,))
    g = imp.graph
    (y,) = imp.outputs.values()
    session = vkml.compile(g, loss=g.sum(y), outputs=imp.outputs, device=device)
    session.set_input(next(iter(imp.inputs)), x.numpy())
    session.step()
    module(x).sum().backward()
    np.testing.assert_array_equal(session.grad("w"), module.w.grad.numpy())
    session.close()


@vulkan_only
def test_onnx_transformer_block_matches_onnxruntime(device, tmp_path):
    torch.manual_seed(0)
    module = TinyBlock().eval()
    x = torch.randn(2, 6, 16)
    path = export_onnx(module, (x,), tmp_path / "block.onnx", ["x"])
    assert onnxruntime_error(path, x, device) < FORWARD_TOL


def _refused_model():
    """x -> Relu -> [Det, two vendor ops, NonZero] -> Add: ops vkml lacks, and a node whose
    output's shape depends on the data."""
    from onnx import TensorProto, helper
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Det", ["r"], ["d"], name="det"),
             helper.make_node("FusedGemm", ["r", "r"], ["f1"], name="fused1",
                              domain="com.example"),
             helper.make_node("FusedGemm", ["f1", "r"], ["f2"], name="fused2",
                              domain="com.example"),
             helper.make_node("NonZero", ["r"], ["nz"], name="nonzero"),
             helper.make_node("Add", ["f2", "r"], ["y"], name="add")]
    graph = helper.make_graph(
        nodes, "refused", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (3, 3))],
        [helper.make_tensor_value_info(n, t, shape) for n, t, shape in
         (("y", TensorProto.FLOAT, (3, 3)), ("d", TensorProto.FLOAT, ()),
          ("nz", TensorProto.INT64, (2, "nonzeros")))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.example", 1)])


def test_onnx_refusal_lists_everything_at_once():
    with pytest.raises(vkml.ModelImportError) as info:
        vkml.import_onnx(_refused_model())
    error = info.value
    assert isinstance(error, ImportError) and isinstance(error, vkml.VkmlError)
    assert error.unsupported == {"Det": 1, "com.example::FusedGemm": 2}
    assert error.refused_nodes == ["nonzero"]
    message = str(error)
    assert "com.example::FusedGemm x2: fused1, fused2" in message
    assert "nonzero (NonZero): data-dependent" in message


class RoundedDivision(torch.nn.Module):
    """torch.div with rounding modes: of integers computed on the device (a router's expert
    ids // experts per group), and of floats; histc of those ids and of floats."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)

    def forward(self, x):
        h = self.fc(x)
        ids = torch.argmax(h, -1, keepdim=True) - 3
        groups = (ids // 2).float() + torch.div(ids, 4, rounding_mode="trunc").float()
        counts = torch.histc(ids.float(), 6, -3, 2) + torch.histc(h.detach(), 6, -0.5, 0.5)
        return h + groups + torch.div(h.detach(), 0.3, rounding_mode="floor") + counts


class StraightThrough(torch.nn.Module):
    """x.detach() stops the gradient: a straight-through estimator (VQ-VAE's), whose forward
    is the rounded value and whose gradient is the identity's."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)

    def forward(self, x):
        h = self.fc(x) * 3
        return h + (torch.round(h) - h).detach() + h.detach() ** 2


@vulkan_only
@pytest.mark.parametrize("module_class", [RoundedDivision, StraightThrough],
                         ids=["rounded_division", "detach_stops_the_gradient"])
def test_torch_six_feature_classifier_trains_as_pytorch(device, module_class):
    torch.manual_seed(0)
    module = module_class()
    x, labels = torch.randn(5, 6), torch.tensor([1, 2, 0, 5, 3])
    check_training(vkml.import_torch(module, (x,)), module, x, labels, device)


def test_torch_refusal_names_the_op_and_why():
    """An op whose output's shape depends on the data: named, with the reason."""
    class NonZero(torch.nn.Module):
        def forward(self, x):
            return torch.nonzero(x > 0).float().sum(0)

    with pytest.raises(vkml.ModelImportError, match=r"aten\.nonzero x1: nonzero -- its "
                                                    r"output's length is the number"):
        vkml.import_torch(NonZero(), (torch.randn(3, 4),))


def test_onnx_bad_files_are_named(tmp_path):
    torch.manual_seed(0)
    path = export_onnx(MLP(), (torch.randn(2, 6),), tmp_path / "mlp.onnx", ["x"])
    data = open(path, "rb").read()
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(vkml.ModelImportError, match="truncated.onnx"):
        vkml.import_onnx(truncated)
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\xff\x00not an onnx model" * 10)
    with pytest.raises(vkml.ModelImportError, match="garbage.onnx"):
        vkml.import_onnx(garbage)
    with pytest.raises(vkml.ModelImportError, match="no such file"):
        vkml.import_onnx(tmp_path / "absent.onnx")

    model = onnx.load(path)
    model.opset_import[0].version = 999
    with pytest.raises(vkml.ModelImportError, match="opset 999"):
        vkml.import_onnx(model)

    external = tmp_path / "external.onnx"
    onnx.save_model(onnx.load(path), str(external), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    assert set(vkml.import_onnx(external).graph.params) == set(dict(MLP().named_parameters()))
    (tmp_path / "weights.bin").unlink()
    with pytest.raises(vkml.ModelImportError, match="weights.bin"):
        vkml.import_onnx(external)


class RMSNorm(torch.nn.Module):
    """As Hugging Face's LlamaRMSNorm writes it."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.rand(dim) + 0.5), eps

    def forward(self, x):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class LlamaBlock(torch.nn.Module):
    """A LLaMA decoder layer as Hugging Face spells it: RMSNorm, RoPE through rotate_half
    with its tables computed in forward from a non-persistent inv_freq buffer, grouped-query
    attention through repeat_kv (unsqueeze, expand, reshape) with a boolean causal mask, a
    SiLU-gated MLP."""

    def __init__(self, dim=16, heads=4, kv_heads=2, hidden=24, theta=10000.0):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        hd = dim // heads
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd),
                             persistent=False)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(dim), RMSNorm(dim)
        for name, (i, o) in LLAMA_LINEARS(dim, hidden, kv_heads * hd).items():
            setattr(self, name, torch.nn.Linear(i, o, bias=False))

    def forward(self, x):
        b, t, d = x.shape
        hd, rep = d // self.heads, self.heads // self.kv_heads
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, t, self.heads, hd).transpose(1, 2)
        k, v = (p(h).view(b, t, self.kv_heads, hd).transpose(1, 2)
                for p in (self.k_proj, self.v_proj))
        freqs = (self.inv_freq[:, None] @ torch.arange(t, dtype=torch.float32)[None, :]).T
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q, k = (z * cos + rotate_half(z) * sin for z in (q, k))
        k, v = (z[:, :, None].expand(b, self.kv_heads, rep, t, hd).reshape(b, self.heads, t, hd)
                for z in (k, v))
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, d))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(torch.nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


def LLAMA_LINEARS(dim, hidden, kv_dim):
    return {"q_proj": (dim, dim), "k_proj": (dim, kv_dim), "v_proj": (dim, kv_dim),
            "o_proj": (dim, dim), "gate_proj": (dim, hidden), "up_proj": (dim, hidden),
            "down_proj": (hidden, dim)}


def hand_built_llama(shape, dim=16, heads=4, kv_heads=2, hidden=24, theta=10000.0):
    """The same layer written with vkml's own ops."""
    from vkml import nn
    g = vkml.Graph()
    x = g.input("x", shape)
    b, t, _ = shape
    hd = dim // heads
    lin = {name: nn.Linear(g, name, i, o, bias=False)
           for name, (i, o) in LLAMA_LINEARS(dim, hidden, kv_heads * hd).items()}
    h = g.rms_norm(x, g.param("input_layernorm.weight", (dim,)), 1e-5)
    q, k, v = (g.transpose(g.reshape(lin[p](h), (b, t, n, hd)), (0, 2, 1, 3))
               for p, n in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)))
    a = g.scaled_dot_product_attention(g.rope(q, theta), g.rope(k, theta), v, causal=True)
    x = x + lin["o_proj"](g.reshape(g.transpose(a, (0, 2, 1, 3)), (b, t, dim)))
    h = g.rms_norm(x, g.param("post_attention_layernorm.weight", (dim,)), 1e-5)
    out = x + lin["down_proj"](g.swiglu(lin["gate_proj"](h), lin["up_proj"](h)))
    return g, g.output("output", out)


@vulkan_only
def test_llama_block_imports_to_the_hand_built_plan(device):
    """RMSNorm, RoPE's rotate_half, grouped-query SDPA with a causal mask and the gated MLP as
    PyTorch spells them import to vkml's rms_norm, rotate_half, scaled_dot_product_attention
    (grouping the heads itself, causal) and swiglu, the rotary tables computed at import: the
    same dispatches and kernels as the layer written with vkml's ops, in inference and in
    training; and the same numbers as PyTorch."""
    from collections import Counter

    from vkml.compiler.stages import compile_plan
    torch.manual_seed(0)
    module = LlamaBlock()
    x = torch.randn(1, 6, 16)
    imp = vkml.import_torch(module, (x,))
    assert "inv_freq" not in imp.graph.params  # a non-persistent buffer: a constant
    hand, out = hand_built_llama(tuple(x.shape))
    plans = []
    for g, y in ((imp.graph, imp.outputs["output"]), (hand, out)):
        loss = g.mean(g.square(y))
        plans.append([compile_plan(g, device.caps, loss=loss, optimizer=vkml.AdamW(),
                                   outputs={"output": y}),
                      compile_plan(g, device.caps, outputs={"output": y})])
    for imported, built in zip(*plans):
        assert (Counter(d.kernel.name for d in imported.dispatches)
                == Counter(d.kernel.name for d in built.dispatches))
    s = vkml.compile(imp.graph, outputs=imp.outputs, device=device)
    s.set_input("x", x.numpy())
    s.forward()
    assert rel_l2(s.read("output"), module(x).detach().numpy()) < FORWARD_TOL


def test_readme_bring_your_own_model_runs(tmp_path, capsys):
    """README's "Bring your own model" example, as printed (files in a temporary folder)."""
    import re
    from pathlib import Path
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Bring your own model", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    code = code.replace("/tmp/", f"{tmp_path}/")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "onnxruntime agrees: True" in out
    first, = re.findall(r"loss ([0-9.]+)", out)
    assert float(first) < np.log(10)


def _ops_model():
    """One ONNX graph over the newer ops' conversions: comparisons and Where, Min/Max, casts
    of masks, reflect padding, nearest, linear and cubic Resize, Tile, Expand, GatherND with indices
    known at import, Einsum, ReduceL2, CumSum, a strided Slice."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)

    def const(name, value):
        return numpy_helper.from_array(np.asarray(value), name)
    inits = [const("tenth", np.float32(0.1)), const("fifth", np.float32(0.2)),
             const("pads", np.array([0, 0, 1, 2, 0, 0, 2, 1], np.int64)),
             const("scales", np.array([1, 1, 2, 2], np.float32)),
             const("repeats", np.array([1, 2, 1, 1], np.int64)),
             const("bias", rng.standard_normal((3, 1, 1)).astype(np.float32)),
             const("shape", np.array([2, 3, 4, 4], np.int64)),
             const("points", np.array([[0, 1, 2], [1, 2, 0]], np.int64)),
             const("axis", np.array(1, np.int64)), const("l2axes", np.array([1], np.int64)),
             const("starts", np.array([1, -3], np.int64)),
             const("ends", np.array([4, 99], np.int64)),
             const("axes", np.array([3, 2], np.int64)), const("steps", np.array([2, 1], np.int64))]
    n = helper.make_node
    nodes = [n("Less", ["x", "tenth"], ["low"]), n("Neg", ["x"], ["negx"]),
             n("Where", ["low", "x", "negx"], ["w"]),
             n("Max", ["w", "fifth"], ["hi"]), n("Min", ["hi", "x"], ["mm"]),
             n("Cast", ["low"], ["lowf"], to=TensorProto.FLOAT), n("Add", ["mm", "lowf"], ["a"]),
             n("Pad", ["a", "pads"], ["padded"], mode="reflect"),
             n("Resize", ["x", "", "scales"], ["near"], mode="nearest",
               coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
             n("Resize", ["x", "", "scales"], ["lin"], mode="linear"),
             n("Resize", ["x", "", "scales"], ["cub"], mode="cubic", cubic_coeff_a=-0.5),
             n("Tile", ["x", "repeats"], ["tiled"]),
             n("Expand", ["bias", "shape"], ["wide"]), n("Mul", ["wide", "x"], ["scaled"]),
             n("GatherND", ["x", "points"], ["picked"]),
             n("Einsum", ["x", "x"], ["gram"], equation="bchw,bdhw->bcd"),
             n("ReduceL2", ["x", "l2axes"], ["norm"], keepdims=0),
             n("CumSum", ["x", "axis"], ["cum"], reverse=1),
             n("Slice", ["x", "starts", "ends", "axes", "steps"], ["strided"])]
    outputs = {"padded": (2, 3, 7, 7), "near": (2, 3, 8, 8), "lin": (2, 3, 8, 8),
               "cub": (2, 3, 8, 8),
               "tiled": (2, 6, 4, 4), "scaled": (2, 3, 4, 4), "picked": (2, 4),
               "gram": (2, 3, 3), "norm": (2, 4, 4), "cum": (2, 3, 4, 4),
               "strided": (2, 3, 3, 2)}
    graph = helper.make_graph(
        nodes, "ops", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (2, 3, 4, 4))],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, shape)
         for o, shape in outputs.items()], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), list(outputs)


@vulkan_only
def test_onnx_newer_ops_match_onnxruntime(device, tmp_path):
    model, outputs = _ops_model()
    path = tmp_path / "ops.onnx"
    onnx.save(model, str(path))
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 4)).astype(np.float32)
    imp = vkml.import_onnx(path)
    assert set(imp.graph.params) == {"bias"}  # one-element initializers and shapes: constants
    s = vkml.compile(imp.graph, outputs=imp.outputs, device=device)
    s.set_input("x", x)
    s.forward()
    for name, ref in zip(outputs, onnxruntime_run(path, {"x": x})):
        assert rel_l2(s.read(name), ref) < FORWARD_TOL, name


@vulkan_only
def test_llama_block_onnx_imports_to_the_hand_built_plan(device, tmp_path):
    """The same layer through ONNX, where attention is products, a softmax and a transposed
    key, rotate_half slices, a negation and a concat, and rsqrt a reciprocal square root: the
    hand-built plan's dispatches, its kernels but for the products' operand layout (ONNX keeps
    each weight transposed, (in, out), and vkml reads it as it lies)."""
    import re
    from collections import Counter

    from vkml.compiler.stages import compile_plan
    torch.manual_seed(0)
    module = LlamaBlock()
    x = torch.randn(1, 6, 16)
    path = export_onnx(module, (x,), tmp_path / "llama.onnx", ["x"], outputs=("output",))
    imp = vkml.import_onnx(path)
    hand, out = hand_built_llama(tuple(x.shape))
    imported = compile_plan(imp.graph, device.caps, outputs=imp.outputs)
    built = compile_plan(hand, device.caps, outputs={"output": out})
    def kernels(plan):
        return Counter(re.sub("^matmul_n[nt]_", "matmul_", d.kernel.name)
                       for d in plan.dispatches)
    assert kernels(imported) == kernels(built)
    s = vkml.compile(imp.graph, outputs=imp.outputs, device=device)
    s.set_input("x", x.numpy())
    s.forward()
    assert rel_l2(s.read("output"), module(x).detach().numpy()) < FORWARD_TOL


class Dropping(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.drop = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), \
            torch.nn.Dropout(0.25)

    def forward(self, x):
        return self.drop(self.bn(self.fc(x)))


def _ops(imp):
    return {n.op for n in imp.graph.reachable(imp.outputs.values())}


@pytest.mark.parametrize("front", ["torch", "onnx"])
def test_training_flag_keeps_or_drops_the_training_forms(front, tmp_path):
    """training=True keeps what a train-mode export recorded (live dropout, batch norm over
    the batch), training=False the inference forms; a module exported in eval mode has no
    training forms either way."""
    module, x = Dropping(), torch.randn(3, 4)

    def imported(mode, training):
        module.train(mode)
        if front == "torch":
            return vkml.import_torch(module, (x,), training=training)
        path = export_onnx(module, (x,), tmp_path / f"{mode}.onnx", ["x"], training=(
            torch.onnx.TrainingMode.TRAINING if mode else torch.onnx.TrainingMode.EVAL),
            do_constant_folding=False)
        return vkml.import_onnx(path, training=training)

    live = _ops(imported(True, True))
    assert "dropout" in live and "normalized" in live  # normalized: batch norm's train form
    for mode, training in ((True, False), (False, True)):
        ops = _ops(imported(mode, training))
        assert "dropout" not in ops and "normalized" not in ops, (mode, training)


class InPlace(torch.nn.Module):
    """A ReLU(inplace=True) whose input nothing else reads (its functional form computes the
    same), then an add_ into a value that another op reads too (the program is made
    functional first)."""

    def __init__(self):
        super().__init__()
        self.fc, self.act = torch.nn.Linear(4, 4), torch.nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.act(self.fc(x))
        z = y * 2
        y.add_(1)
        return y * z


@vulkan_only
def test_torch_in_place_ops_compute_what_pytorch_does(device):
    from vkml.importers import torch_export
    torch.manual_seed(0)
    module, x = InPlace(), torch.randn(3, 4)
    program = torch.export.export(module, (x,))
    assert torch_export._needs_decompositions(program, torch._ops)  # y is read by y * 2, y.add_
    assert not torch_export._needs_decompositions(
        torch.export.export(torch.nn.Sequential(module.fc, module.act), (x,)), torch._ops)
    imp = vkml.import_torch(module, (x,))
    s = vkml.compile(imp.graph, outputs=imp.outputs, device=device)
    s.set_input("x", x.numpy())
    s.forward()
    assert rel_l2(s.read("output"), module(x).detach().numpy()) < FORWARD_TOL


@vulkan_only
@pytest.mark.parametrize("opset, model, shape", [(13, SmallCNN, (2, 3, 8, 8)),
                                                 (14, TinyBlock, (2, 6, 16)),
                                                 (20, TinyBlock, (2, 6, 16))])
def test_onnx_opsets_match_onnxruntime(device, tmp_path, opset, model, shape):
    """The oldest opset imported (13; the exporter needs 14 for attention) to the newest the
    exporter writes: their spellings differ (LayerNormalization from 17, Gelu from 20)."""
    torch.manual_seed(0)
    module, x = model().eval(), torch.randn(*shape)
    path = export_onnx(module, (x,), tmp_path / "model.onnx", ["x"], opset=opset)
    assert onnx.load(path).opset_import[0].version == opset
    assert onnxruntime_error(path, x, device) < FORWARD_TOL


class GradFreeBlock(torch.nn.Module):
    """A `torch.no_grad()` block over a non-persistent buffer, as Hugging Face's rotary
    embeddings have: torch.export keeps it as a higher-order op holding a subgraph."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("freq", torch.arange(4.0), persistent=False)

    def forward(self, x):
        with torch.no_grad():
            scale = torch.cos(self.freq * 2)
        return self.fc(x) * scale + torch.sin(x)


@vulkan_only
def test_torch_grad_free_blocks_are_inlined(device):
    torch.manual_seed(0)
    module, x = GradFreeBlock(), torch.randn(3, 4)
    imp = vkml.import_torch(module, (x,))
    s = vkml.compile(imp.graph, outputs=imp.outputs, device=device)
    s.set_input("x", x.numpy())
    s.forward()
    assert rel_l2(s.read("output"), module(x).detach().numpy()) < FORWARD_TOL


class NormsAndSliceWrites(torch.nn.Module):
    """Vector norms (F.normalize's, a weight-normalized layer's, orders 1, 3 and inf) and
    writes into slices of a parameter's copy (Swin V2 zeroes a third of its qkv bias so), one
    of them strided: torch.export's linalg_vector_norm and slice_scatter."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 12)
        self.wn = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(12, 12))
        self.bias = torch.nn.Parameter(torch.randn(12))
        self.scale = torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        h = torch.nn.functional.normalize(self.fc(x), dim=-1)
        bias = self.bias.clone()
        bias[4:8].zero_()
        bias[1::3] = self.scale * 2
        h = self.wn(h) + bias
        norms = [torch.linalg.vector_norm(h, order, dim=-1, keepdim=True)
                 for order in (1, 3, float("inf"))]
        return h[:, :5] * norms[0] + norms[1] - norms[2]


@vulkan_only
def test_torch_vector_norms_and_slice_writes_train_as_pytorch(device):
    torch.manual_seed(0)
    module = NormsAndSliceWrites()
    x, labels = torch.randn(3, 6), torch.tensor([1, 4, 0])
    imp = vkml.import_torch(module, (x,))
    check_training(imp, module, x, labels, device)


class WrittenIndex(torch.nn.Module):
    """BEiT's relative position bias: an index made at run time from aranges, written into a
    zeros tensor slice by slice in place (no later op reads those writes' results), then a
    parameter table gathered at it."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(7, 5))

    def forward(self, x):
        index = torch.zeros(4, 4, dtype=torch.long)
        steps = torch.arange(3)
        index[1:, 1:] = steps[:, None] - steps[None, :] + 2
        index[0, :] = 5
        index[:, 0].fill_(6)
        return x @ self.table[index.view(-1)].view(4, 4, 5).sum(1)


@vulkan_only
def test_torch_in_place_writes_into_a_computed_index_are_kept(device):
    torch.manual_seed(0)
    module = WrittenIndex()
    x, labels = torch.randn(3, 4), torch.tensor([1, 4, 0])
    check_training(vkml.import_torch(module, (x,)), module, x, labels, device)


def _sequence_model():
    """ONNX sequences as torch.onnx's unoptimized dynamo export writes a split (GPT-J's
    rotary sin/cos): h = x w split into a sequence, items picked, erased, inserted, counted
    and concatenated or stacked back."""
    from onnx import TensorProto, helper, numpy_helper
    i64 = lambda name, v: numpy_helper.from_array(np.asarray(v, np.int64), name)  # noqa: E731
    w = np.random.default_rng(0).standard_normal((2, 5, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["h"]),
        helper.make_node("SplitToSequence", ["h", "sizes"], ["parts"], axis=1),
        helper.make_node("SequenceAt", ["parts", "last"], ["tail"]),
        helper.make_node("SplitToSequence", ["h"], ["columns"], axis=2, keepdims=0),
        helper.make_node("SequenceErase", ["columns", "first"], ["rest"]),
        helper.make_node("SequenceInsert", ["rest", "head"], ["again"]),
        helper.make_node("SequenceLength", ["again"], ["count"]),
        helper.make_node("Cast", ["count"], ["scale"], to=TensorProto.FLOAT),
        helper.make_node("ConcatFromSequence", ["again"], ["stacked"], axis=1, new_axis=1),
        helper.make_node("Mul", ["stacked", "scale"], ["y2"]),
        helper.make_node("SequenceConstruct", ["tail", "tail"], ["pair"]),
        helper.make_node("ConcatFromSequence", ["pair"], ["y1"], axis=-1),
        helper.make_node("SequenceAt", ["columns", "first"], ["head"]),
    ]
    nodes = nodes[:5] + nodes[-1:] + nodes[5:-1]  # head before SequenceInsert reads it
    graph = helper.make_graph(
        nodes, "sequences", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (2, 5, 3))],
        [helper.make_tensor_value_info("y1", TensorProto.FLOAT, (2, 3, 6)),
         helper.make_tensor_value_info("y2", TensorProto.FLOAT, (2, 3, 5))],
        [numpy_helper.from_array(w, "w"), i64("sizes", [2, 3]), i64("last", -1),
         i64("first", 0)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w


@vulkan_only
def test_onnx_sequences_match_onnxruntime_and_torch(device, tmp_path):
    model, w = _sequence_model()
    path = str(tmp_path / "sequences.onnx")
    onnx.save(model, path)
    x = np.random.default_rng(1).standard_normal((2, 5, 3)).astype(np.float32)
    imp = vkml.import_onnx(path)
    g = imp.graph
    loss = g.add(g.sum(g.square(imp.outputs["y1"])), g.sum(g.square(imp.outputs["y2"])))
    s = vkml.compile(g, loss=loss, outputs=imp.outputs, device=device)
    s.set_input("x", x)
    s.step()
    for name, ref in zip(("y1", "y2"), onnxruntime_run(path, {"x": x})):
        assert rel_l2(s.read(name), ref) < FORWARD_TOL, name
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    h = torch.tensor(x, dtype=torch.float64) * wt
    y1 = torch.cat([h[:, 2:], h[:, 2:]], -1)
    y2 = torch.stack([h[..., 1], h[..., 2], h[..., 0]], 1) * 3
    (y1.square().sum() + y2.square().sum()).backward()
    assert rel_l2(s.grad("w"), wt.grad.numpy()) < GRAD_TOL


class SpectralAndStrided(torch.nn.Module):
    """torch.fft as models use it (FNet's fftn(...).real over two axes, an orthonormal rfft
    viewed as real, an inverse FFT's imaginary part) and as_strided windows that overlap
    (unfold's, read from a contiguous value)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)

    def forward(self, x):
        h = self.fc(x)  # (3, 4, 6)
        mixed = torch.fft.fftn(h.to(torch.complex64), dim=(1, 2)).real
        half = torch.view_as_real(torch.fft.rfft(h, dim=-1, norm="ortho"))  # (3, 4, 4, 2)
        back = torch.fft.ifft(h, dim=1).imag
        windows = h.reshape(3, 24).as_strided((3, 5, 4), (24, 4, 1))  # overlapping by 2
        return (mixed.mean(1) + back.sum(1) + half.flatten(2).sum(1)[:, :6]
                + windows.sum(-1)[:, :6].repeat(1, 2)[:, :6])


@vulkan_only
def test_torch_fft_and_as_strided_train_as_pytorch(device):
    torch.manual_seed(0)
    module = SpectralAndStrided()
    x, labels = torch.randn(3, 4, 6), torch.tensor([1, 4, 0])
    check_training(vkml.import_torch(module, (x,)), module, x, labels, device)


class ViewsAndStacks(torch.nn.Module):
    """Ops torch.export keeps as they are when no decomposition runs (MaxViT's chunk and
    swapaxes, GPT-J's stack, Falcon's .T, Swin V2's clamp_min and expand_as, wav2vec2's
    weight-normalized convolution)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.wn = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(6, 6), dim=1)
        self.bias = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):  # (3, 4, 6)
        a, b = self.fc(x).chunk(2, dim=-1)
        stacked = torch.stack([a, b.clamp_min(-0.5).clamp_max(0.7)], dim=1).swapaxes(1, 2)
        flipped = self.wn(x.reshape(12, 6).T.T).reshape(3, 4, 6)
        return (stacked.sum((1, 2)) + self.bias.expand_as(a).sum(1)
                + flipped.mean(1)[:, :3])


@vulkan_only
def test_torch_ops_kept_whole_train_as_pytorch(device):
    from vkml.importers import torch_export
    torch.manual_seed(0)
    module = ViewsAndStacks()
    x, labels = torch.randn(3, 4, 6), torch.tensor([1, 2, 0])
    assert not torch_export._needs_decompositions(torch.export.export(module, (x,)), torch._ops)
    check_training(vkml.import_torch(module, (x,)), module, x, labels, device)


class FoldAndPut(torch.nn.Module):
    """F.fold (MobileViT-v2 folds its patches back: aten col2im, ONNX Col2Im) with padding
    that drops part of the blocks, then index_put at indices known at import: added with
    one position repeated, and assigned."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 8)
        self.gain = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):  # (2, 4, 6)
        cols = self.fc(x).transpose(1, 2)  # (2, 2 channels x 2 x 2, 4 blocks)
        image = torch.nn.functional.fold(cols, (3, 3), 2, padding=1, stride=2).flatten(1)
        image = torch.index_put(image, (torch.tensor([1, 0, 1]), torch.tensor([0, 5, 0])),
                                self.gain, accumulate=True)
        image = torch.index_put(image, (torch.tensor([0]), torch.tensor([3])),
                                torch.tensor(0.5))
        return image[:, :5] * image[:, 5:10]


@vulkan_only
def test_fold_and_index_put_import_both_ways(device, tmp_path):
    torch.manual_seed(0)
    module = FoldAndPut()
    x, labels = torch.randn(2, 4, 6), torch.tensor([1, 4])
    check_training(vkml.import_torch(module, (x,)), module, x, labels, device)
    path = export_onnx(module, (x,), tmp_path / "fold.onnx", ["x"], opset=18)
    assert "Col2Im" in {n.op_type for n in onnx.load(path).graph.node}
    assert onnxruntime_error(path, x, device) < FORWARD_TOL


class Ranked(torch.nn.Module):
    """topk and sort through torch.export (a router's first steps, its expert ids sorted as
    integers), their values trained."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 8)

    def forward(self, x):
        h = self.fc(x)
        best, _ = torch.topk(h, 3, dim=-1)
        ordered, order = torch.sort(h, dim=0, descending=True)
        ids, _ = torch.sort(order, dim=-1)  # integers, as a router sorts its expert ids
        return best + ordered[:, :3] + order[:, 3:6].float() + ids[:, :3].float()


@vulkan_only
def test_torch_topk_and_sort_train_as_pytorch(device):
    torch.manual_seed(0)
    module = Ranked()
    x, labels = torch.randn(4, 6), torch.tensor([1, 2, 0, 1])
    check_training(vkml.import_torch(module, (x,)), module, x, labels, device)


class Video(torch.nn.Module):
    """A video classifier's layers: 3-D convolutions (one strided and grouped, one over time
    alone), 3-D batch norm, 3-D max pooling, adaptive 3-D average pooling (an AveragePool in
    ONNX)."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv3d(3, 4, (3, 3, 3), (1, 2, 2), (1, 1, 1))
        self.bn = torch.nn.BatchNorm3d(4)
        self.conv2 = torch.nn.Conv3d(4, 4, (3, 1, 1), padding=(1, 0, 0), groups=2)
        self.fc = torch.nn.Linear(4 * 2, 5)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv1(x)))
        y = self.conv2(torch.nn.functional.max_pool3d(y, (1, 3, 3), (1, 2, 2), (0, 1, 1)))
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool3d(y, (2, 1, 1)), 1))


@vulkan_only
def test_video_convolutions_import_both_ways(device, tmp_path):
    torch.manual_seed(0)
    module = _with_running_stats(Video()).eval()
    x, labels = torch.randn(2, 3, 4, 6, 6), torch.tensor([1, 4])
    check_training(vkml.import_torch(module, (x,)), module, x, labels, device)
    path = export_onnx(module, (x,), tmp_path / "video.onnx", ["x"])
    assert onnxruntime_error(path, x, device) < FORWARD_TOL


# ---- single ONNX ops against onnxruntime, and their gradients against PyTorch ----------------
def _f(*shape, low=-2.0, high=2.0, seed=0):
    return np.random.default_rng(seed + len(shape)).uniform(low, high, shape).astype(np.float32)


def _i(values):
    return np.asarray(values, np.int64)


class Known(np.ndarray):
    """An input stored as an initializer even where it is an integer (axes, k, a shape): known
    at import, as exporters write them."""


def _known(values, dtype=np.int64):
    return np.asarray(values, dtype).view(Known)


def _lp(x, p, axis):
    return x / x.abs().pow(p).sum(axis, keepdim=True).pow(1 / p)


def _space_to_depth(x, k):
    n, c, h, w = x.shape
    return x.reshape(n, c, h // k, k, w // k, k).permute(0, 3, 5, 1, 2, 4).reshape(
        n, c * k * k, h // k, w // k)


def _depth_to_space_dcr(x, k):
    n, c, h, w = x.shape
    return x.reshape(n, k, k, c // k // k, h, w).permute(0, 3, 4, 1, 5, 2).reshape(
        n, c // k // k, h * k, w * k)


def _index_put(x, indices, updates):
    return x.index_put(tuple(torch.tensor(indices).reshape(-1, indices.shape[-1]).T),
                       updates.reshape(-1, *x.shape[indices.shape[-1]:]))


ZERO_AMONG = _f(2, 3, 5, low=0.5)
ZERO_AMONG[1, 2, 3] = 0.0  # where a product's gradient needs the other elements
SCATTER_ND = np.array([[[1, 0]], [[0, 2]], [[1, -1]]], np.int64)  # (3, 1, 2): rows of (2, 4, 3)
SCATTER_ELEMENTS = np.array([[2, 0, -1], [0, 1, 2]], np.int64)  # along axis 1 of (2, 4)
SCATTER_ND_ADD = np.array([[0], [2], [-3], [0]], np.int64)  # rows of (3, 4), row 0 thrice
SCATTER_ELEMENTS_ADD = np.array([[2, 0, 2], [1, 1, -1]], np.int64)  # along axis 1 of (2, 5)


def _window_sums(x, pads, kernel, stride):
    return torch.nn.functional.avg_pool2d(torch.nn.functional.pad(x, pads), kernel, stride,
                                          divisor_override=1)


def _mean_of_input(x, pads, kernel, stride):
    """Average pooling over each window's elements of the input alone."""
    return _window_sums(x, pads, kernel, stride) / _window_sums(torch.ones_like(x), pads,
                                                                kernel, stride)


# ONNX's gate blocks in torch's order: LSTM iofc -> ifgo, GRU zrh -> rzn
TORCH_GATES = {"LSTM": [0, 2, 3, 1], "GRU": [1, 0, 2], "RNN": [0]}


def _torch_recurrent(op, x, w, r, bias, state=(), reverse=False, batch_first=False):
    """torch's own recurrent kernels (torch.lstm, torch.gru, torch.rnn_tanh; GRU's is ONNX's
    linear_before_reset=1) on ONNX's weights reordered, as ONNX's Y (steps, directions, batch,
    hidden) or, batch first, (batch, steps, directions, hidden)."""
    order = TORCH_GATES[op]
    directions, hidden = w.shape[0], r.shape[-1]

    def blocks(v):
        return torch.cat([v.reshape(len(order), -1, *v.shape[1:])[k].reshape(-1, *v.shape[1:])
                          for k in order])
    params = []
    for d in range(directions):
        params += [blocks(w[d]), blocks(r[d]), blocks(bias[d][:len(order) * hidden]),
                   blocks(bias[d][len(order) * hidden:])]
    time = 1 if batch_first else 0
    if reverse:
        x = x.flip(time)
    batch = x.shape[1 - time]
    zeros = torch.zeros(directions, batch, hidden, dtype=x.dtype)
    state = list(state) + [zeros] * (2 - len(state))
    fn = {"LSTM": torch.lstm, "GRU": torch.gru, "RNN": torch.rnn_tanh}[op]
    args = (state[:2] if op == "LSTM" else state[0], params, True, 1, 0.0, False,
            directions == 2, batch_first)
    out = fn(x, *args)[0]
    if reverse:
        out = out.flip(time)
    out = out.unflatten(-1, (directions, hidden))
    return out.transpose(1, 2) if not batch_first else out


ATTENTION_MASK = np.array([[[[1, 0, 1, 1, 0], [0, 1, 0, 0, 0], [1, 1, 1, 1, 1]]]], bool)
# the second query sees no key: zeros from onnxruntime, onnx's reference and torch
ATTENTION_MASK_BLIND = np.array([[[[1, 0, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]]], bool)


def _sdpa(q, k, v, **kw):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)


def _packed_sdpa(q, k, v, mask, heads, scale):
    """ONNX Attention's 3-D form: (batch, length, heads x size) in and out."""
    def split(x):
        return x.unflatten(-1, (heads, -1)).transpose(1, 2)
    y = _sdpa(split(q), split(k), split(v), attn_mask=mask, scale=scale)
    return y.transpose(1, 2).flatten(2)


def _grid_sample(mode, padding, corners):
    return lambda x, grid: torch.nn.functional.grid_sample(x, grid, mode, padding, corners)


def _rope(x, cos, sin, interleaved=False, width=None, heads=None):
    """ONNX RotaryEmbedding's definition in torch: cos and sin (batch, length, width / 2)."""
    shape = x.shape
    if heads:
        x = x.unflatten(-1, (heads, -1))
        cos, sin = cos[:, :, None], sin[:, :, None]
    else:
        cos, sin = cos[:, None], sin[:, None]
    width = width or x.shape[-1]
    rotated, rest = x[..., :width], x[..., width:]
    if interleaved:
        first, second = rotated[..., 0::2], rotated[..., 1::2]
    else:
        first, second = rotated.chunk(2, -1)
    real, imaginary = cos * first - sin * second, sin * first + cos * second
    out = (torch.stack([real, imaginary], -1).flatten(-2) if interleaved
           else torch.cat([real, imaginary], -1))
    return torch.cat([out, rest], -1).reshape(shape)


ROPE_IDS = np.array([[4, 0, 2]], np.int64)
ROPE_COS, ROPE_SIN = _f(5, 4, seed=7), _f(5, 4, seed=8)
ROPE_COS_ROWS, ROPE_SIN_ROWS = _f(2, 3, 2, seed=7), _f(2, 3, 2, seed=8)


def _dft(x, length=None, inverse=False, onesided=False, axis=-2):
    """ONNX DFT in torch: x (..., 1 or 2) real or complex, the transform along `axis`."""
    z = x[..., 0] if x.shape[-1] == 1 else torch.view_as_complex(x.contiguous())
    fn = torch.fft.ifft if inverse else (torch.fft.rfft if onesided else torch.fft.fft)
    return torch.view_as_real(fn(z, length, axis % x.dim()))


STFT_WINDOW = np.hanning(6).astype(np.float32)


def _mvn(x, axes):
    centred = x - x.mean(axes, keepdim=True)
    return centred / (centred.square().mean(axes, keepdim=True).sqrt() + 1e-9)


# (id, op type, inputs in order (None for an omitted one), attributes, PyTorch's function of the
# float inputs or None where the op is not differentiable, opset). Float inputs of more than one
# element become initializers (vkml's parameters, so their gradients are checked); integer ones
# and scalars are fed at run time, so the node is built on the device rather than folded.
ONNX_OP_CASES = [
    ("prelu_channels", "PRelu", [_f(2, 3, 4), _f(3, 1, seed=1)], {},
     lambda x, s: torch.where(x > 0, x, x * s), 17),
    ("celu", "Celu", [_f(3, 5)], {"alpha": 0.7},
     lambda x: torch.nn.functional.celu(x, 0.7), 17),
    ("thresholded_relu", "ThresholdedRelu", [_f(3, 5)], {"alpha": 0.4},
     lambda x: torch.where(x > 0.4, x, 0.0), 17),
    ("shrink_hard", "Shrink", [_f(3, 5)], {"lambd": 0.6},
     lambda x: torch.nn.functional.hardshrink(x, 0.6), 17),
    ("shrink_soft", "Shrink", [_f(3, 5)], {"lambd": 0.6, "bias": 0.6},
     lambda x: torch.nn.functional.softshrink(x, 0.6), 17),
    ("softsign", "Softsign", [_f(3, 5)], {}, torch.nn.functional.softsign, 17),
    ("swish_alpha", "Swish", [_f(3, 5)], {"alpha": 1.5},
     lambda x: x * torch.sigmoid(1.5 * x), 24),
    ("tan", "Tan", [_f(3, 5, low=-1.2, high=1.2)], {}, torch.tan, 17),
    ("sinh", "Sinh", [_f(3, 5)], {}, torch.sinh, 17),
    ("cosh", "Cosh", [_f(3, 5)], {}, torch.cosh, 17),
    ("asinh", "Asinh", [_f(3, 5, low=-30, high=30)], {}, torch.asinh, 17),
    ("asinh_small", "Asinh", [_f(3, 5, low=-1e-3, high=1e-3)], {}, torch.asinh, 17),
    ("acosh", "Acosh", [_f(3, 5, low=1.001, high=20)], {}, torch.acosh, 17),
    # past 1.8e19 the formulas' squares overflowed: NaN and inf where the result is near 45
    ("asinh_huge", "Asinh", [_f(2, 3, low=-1e30, high=1e30)], {}, torch.asinh, 17),
    ("acosh_huge", "Acosh", [_f(2, 3, low=4000.0, high=1e30)], {}, torch.acosh, 17),
    ("atanh", "Atanh", [_f(3, 5, low=-0.95, high=0.95)], {}, torch.atanh, 17),
    ("swiglu", "SwiGLU", [_f(3, 4), _f(3, 4, seed=1)], {},
     lambda a, v: torch.nn.functional.silu(a) * v, 28),
    ("swiglu_alpha", "SwiGLU", [_f(3, 4), _f(3, 4, seed=1)], {"alpha": 1.7},
     lambda a, v: a * torch.sigmoid(1.7 * a) * v, 28),
    ("sum_broadcast", "Sum", [_f(2, 3), _f(3, seed=1), _f(2, 1, seed=2)], {},
     lambda a, b, c: a + b + c, 17),
    ("mean_broadcast", "Mean", [_f(2, 3), _f(3, seed=1)], {}, lambda a, b: (a + b) / 2, 17),
    ("mod_float_fmod", "Mod", [_f(3, 5, low=-5, high=5), _f(3, 5, low=0.5, high=2, seed=1)],
     {"fmod": 1}, torch.fmod, 17),
    ("mod_int", "Mod", [_i([[7, -7, 5], [-5, 0, 9]]), _i([3, 3, -2])], {}, None, 17),
    ("mod_int_fmod", "Mod", [_i([[7, -7, 5], [-5, 0, 9]]), _i([3, 3, -2])], {"fmod": 1}, None,
     17),
    ("reduce_l1_axes_input", "ReduceL1", [_f(2, 3, 4), _known([1])], {"keepdims": 0},
     lambda x: x.abs().sum(1), 18),
    ("reduce_sum_square_axes_attribute", "ReduceSumSquare", [_f(2, 3, 4)], {"axes": [0, 2]},
     lambda x: x.square().sum((0, 2), keepdim=True), 13),
    ("reduce_log_sum", "ReduceLogSum", [_f(2, 3, 4, low=0.1), _known([-1])], {},
     lambda x: x.sum(-1, keepdim=True).log(), 18),
    ("reduce_log_sum_all_axes", "ReduceLogSum", [_f(2, 3, low=0.1)], {"keepdims": 0},
     lambda x: x.sum().log(), 18),
    ("reduce_prod_with_zero", "ReduceProd", [ZERO_AMONG, _known([0, 2])], {},
     lambda x: x.prod(2, keepdim=True).prod(0, keepdim=True), 18),
    ("reduce_prod_all", "ReduceProd", [_f(2, 3, low=0.5)], {"keepdims": 0},
     lambda x: x.prod(), 18),
    ("cumprod", "CumProd", [ZERO_AMONG, _known(2)], {}, lambda x: x.cumprod(2), 26),
    ("cumprod_exclusive_reverse", "CumProd", [_f(7, 2), _known(0)],
     {"exclusive": 1, "reverse": 1},
     lambda x: torch.cat([x.flip(0).cumprod(0).flip(0)[1:], torch.ones(1, 2)]), 26),
    ("argmax_last_index", "ArgMax", [np.round(_f(3, 6, low=-1.5, high=1.5))],
     {"axis": 1, "keepdims": 0, "select_last_index": 1}, None, 13),
    ("argmin_last_index", "ArgMin", [np.round(_f(4, 3, 5, low=-1.5, high=1.5))],
     {"axis": -2, "select_last_index": 1}, None, 13),
    ("cumsum_exclusive", "CumSum", [_f(3, 5), _known(1)], {"exclusive": 1},
     lambda x: x.cumsum(1) - x, 14),
    ("cumsum_exclusive_reverse", "CumSum", [_f(3, 5), _known(0)], {"exclusive": 1, "reverse": 1},
     lambda x: x.flip(0).cumsum(0).flip(0) - x, 14),
    ("lp_normalization_l2", "LpNormalization", [_f(2, 3, 4)], {"axis": 1},
     lambda x: _lp(x, 2, 1), 13),
    ("lp_normalization_l1", "LpNormalization", [_f(2, 3, 4)], {"p": 1},
     lambda x: _lp(x, 1, -1), 13),
    ("mean_variance_normalization", "MeanVarianceNormalization", [_f(2, 3, 4, 5)], {},
     lambda x: _mvn(x, (0, 2, 3)), 13),
    ("mean_variance_normalization_axes", "MeanVarianceNormalization", [_f(2, 3, 4)],
     {"axes": [1, 2]}, lambda x: _mvn(x, (1, 2)), 13),
    ("lrn_odd", "LRN", [_f(2, 5, 3, 2)], {"size": 3, "alpha": 0.5, "beta": 0.6, "bias": 2.0},
     lambda x: torch.nn.functional.local_response_norm(x, 3, 0.5, 0.6, 2.0), 13),
    ("group_norm_per_channel_scale", "GroupNormalization",
     [_f(2, 4, 3, 3), _f(4, seed=1), _f(4, seed=2)], {"num_groups": 2},
     lambda x, w, b: torch.nn.functional.group_norm(x, 2, w, b), 21),
    ("rms_normalization", "RMSNormalization", [_f(2, 3, 4), _f(4, seed=1)], {"epsilon": 1e-3},
     lambda x, w: torch.nn.functional.rms_norm(x, (4,), w, 1e-3), 23),
    ("rms_normalization_two_axes", "RMSNormalization", [_f(2, 3, 4), _f(3, 4, seed=1)],
     {"axis": 1}, lambda x, w: torch.nn.functional.rms_norm(x, (3, 4), w, 1e-5), 23),
    ("topk_largest", "TopK", [_f(3, 6), _known([2])], {},
     lambda x: torch.topk(x, 2, -1).values, 13),
    ("topk_smallest_axis0", "TopK", [_f(5, 3), _known([3])], {"axis": 0, "largest": 0},
     lambda x: torch.topk(x, 3, 0, largest=False).values, 13),
    ("trilu_upper", "Trilu", [_f(2, 3, 4)], {}, torch.triu, 14),
    ("trilu_lower_k", "Trilu", [_f(2, 4, 3), _known(-1)], {"upper": 0},
     lambda x: torch.tril(x, -1), 14),
    ("one_hot", "OneHot", [_i([[1, -1], [0, 3]]), _known(3), np.array([0, 1], np.float32)], {},
     None, 13),
    ("one_hot_axis_values", "OneHot", [_i([2, -3, 1]), _known(3),
                                       np.array([-0.5, 2], np.float32)], {"axis": 0}, None, 13),
    ("hardmax", "Hardmax", [np.round(_f(3, 4, 2))], {"axis": 1}, None, 13),
    ("eye_like", "EyeLike", [_f(3, 5)], {"k": 1}, None, 13),
    ("depth_to_space_dcr", "DepthToSpace", [_f(1, 8, 2, 3)], {"blocksize": 2},
     lambda x: _depth_to_space_dcr(x, 2), 13),
    ("depth_to_space_crd", "DepthToSpace", [_f(2, 8, 2, 3)], {"blocksize": 2, "mode": "CRD"},
     lambda x: torch.nn.functional.pixel_shuffle(x, 2), 13),
    ("space_to_depth", "SpaceToDepth", [_f(1, 2, 4, 6)], {"blocksize": 2},
     lambda x: _space_to_depth(x, 2), 13),
    ("scatter_nd_rows", "ScatterND",
     [_f(2, 4, 3), SCATTER_ND.view(Known), _f(3, 1, 3, seed=1)], {},
     lambda x, u: _index_put(x, SCATTER_ND % [[[2, 4]]], u), 16),
    ("scatter_elements", "ScatterElements",
     [_f(2, 4), SCATTER_ELEMENTS.view(Known), _f(2, 3, seed=1)], {"axis": 1},
     lambda x, u: x.scatter(1, torch.tensor(SCATTER_ELEMENTS % 4), u), 16),
    ("scatter_nd_add_repeated_rows", "ScatterND",
     [_f(3, 4), SCATTER_ND_ADD.view(Known), _f(4, 4, seed=1)], {"reduction": "add"},
     lambda x, u: x.index_put((torch.tensor(SCATTER_ND_ADD[:, 0] % 3),), u, accumulate=True),
     16),
    ("scatter_elements_add_repeated", "ScatterElements",
     [_f(2, 5), SCATTER_ELEMENTS_ADD.view(Known), _f(2, 3, seed=1)],
     {"axis": 1, "reduction": "add"},
     lambda x, u: x.scatter_add(1, torch.tensor(SCATTER_ELEMENTS_ADD % 5), u), 16),
    ("max_pool_1d", "MaxPool", [_f(2, 3, 9)], {"kernel_shape": [3], "strides": [2],
                                               "pads": [1, 1]},
     lambda x: torch.nn.functional.max_pool1d(x, 3, 2, 1), 13),
    ("max_pool_same_upper_negative", "MaxPool", [_f(1, 2, 6, 6, low=-3, high=-1)],
     {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"},
     lambda x: torch.nn.functional.max_pool2d(
         torch.nn.functional.pad(x, (0, 1, 0, 1), value=-np.inf), 3, 2), 13),
    ("max_pool_dilated", "MaxPool", [_f(1, 2, 7, 8)],
     {"kernel_shape": [2, 3], "strides": [1, 2], "pads": [1, 0, 1, 0], "dilations": [2, 1]},
     lambda x: torch.nn.functional.max_pool2d(x, (2, 3), (1, 2), (1, 0), (2, 1)), 13),
    ("max_pool_dilated_ceil", "MaxPool", [_f(1, 1, 7, 6)],
     {"kernel_shape": [2, 2], "strides": [2, 2], "dilations": [2, 2], "ceil_mode": 1},
     lambda x: torch.nn.functional.max_pool2d(x, 2, 2, 0, 2, ceil_mode=True), 13),
    ("lp_pool", "LpPool", [_f(1, 2, 5, 6, low=0.1)],
     {"kernel_shape": [2, 3], "strides": [1, 2], "p": 3},
     lambda x: torch.nn.functional.lp_pool2d(x, 3, (2, 3), (1, 2)), 18),
    ("lp_pool_1d", "LpPool", [_f(2, 3, 7)], {"kernel_shape": [2], "strides": [2]},
     lambda x: torch.nn.functional.lp_pool1d(x, 2, 2, 2), 18),
    # torch scales a partial window's sum by kernel / count: ONNX's is the sum (forward only)
    ("lp_pool_1d_ceil", "LpPool", [_f(2, 3, 7)],
     {"kernel_shape": [2], "strides": [2], "ceil_mode": 1}, None, 18),
    ("global_lp_pool", "GlobalLpPool", [_f(2, 3, 4, 5)], {},
     lambda x: x.square().sum((2, 3), keepdim=True).sqrt(), 13),
    ("avg_pool_1d_counted", "AveragePool", [_f(2, 3, 8)],
     {"kernel_shape": [3], "strides": [2], "pads": [1, 1], "count_include_pad": 1},
     lambda x: torch.nn.functional.avg_pool1d(x, 3, 2, 1, count_include_pad=True), 13),
    ("avg_pool_same_upper_uncounted", "AveragePool", [_f(1, 2, 6, 5)],
     {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"},
     lambda x: _mean_of_input(x, (1, 1, 0, 1), 3, 2), 13),
    ("conv_transpose_1d", "ConvTranspose", [_f(2, 4, 5), _f(4, 3, 3, seed=1)],
     {"strides": [2], "pads": [1, 1], "output_padding": [1]},
     lambda x, w: torch.nn.functional.conv_transpose1d(x, w, stride=2, padding=1,
                                                       output_padding=1), 13),
    ("conv_transpose_asymmetric_pads", "ConvTranspose", [_f(1, 2, 3, 4), _f(2, 3, 3, 3, seed=1)],
     {"strides": [2, 2], "pads": [0, 1, 1, 2]},
     lambda x, w: torch.nn.functional.conv_transpose2d(x, w, stride=2)[..., :-1, 1:-2], 13),
    ("conv_transpose_output_shape", "ConvTranspose", [_f(1, 2, 3, 3), _f(2, 2, 3, 3, seed=1)],
     {"strides": [2, 2], "output_shape": [6, 6]},
     lambda x, w: torch.nn.functional.conv_transpose2d(x, w, stride=2)[..., 1:, 1:], 13),
    ("conv_transpose_same_upper", "ConvTranspose", [_f(1, 2, 3, 3), _f(2, 2, 3, 3, seed=1)],
     {"strides": [2, 2], "auto_pad": "SAME_UPPER"},
     lambda x, w: torch.nn.functional.conv_transpose2d(x, w, stride=2)[..., :-1, :-1], 13),
    ("softmax_cross_entropy_weighted_ignored", "SoftmaxCrossEntropyLoss",
     [_f(5, 4), _i([1, 3, -1, 0, 3]), _f(4, low=0.5, seed=1)], {"ignore_index": -1},
     lambda x, w: torch.nn.functional.cross_entropy(x, torch.tensor([1, 3, -1, 0, 3]),
                                                    w.detach(), ignore_index=-1), 13),
    ("softmax_cross_entropy_spatial_none", "SoftmaxCrossEntropyLoss",
     [_f(2, 3, 4), _i([[0, 2, 1, 2], [1, 1, 0, 2]])], {"reduction": "none"},
     lambda x: torch.nn.functional.cross_entropy(
         x, torch.tensor([[0, 2, 1, 2], [1, 1, 0, 2]]), reduction="none"), 13),
    ("negative_log_likelihood_sum", "NegativeLogLikelihoodLoss",
     [_f(4, 3), _i([2, 0, 1, 2])], {"reduction": "sum"},
     lambda x: torch.nn.functional.nll_loss(x, torch.tensor([2, 0, 1, 2]), reduction="sum"), 13),
    ("negative_log_likelihood_mean", "NegativeLogLikelihoodLoss",
     [_f(4, 3), _i([2, 0, 1, 2])], {},
     lambda x: torch.nn.functional.nll_loss(x, torch.tensor([2, 0, 1, 2])), 13),
    ("lstm_bidirectional", "LSTM",
     [_f(4, 2, 3), _f(2, 16, 3, seed=1), _f(2, 16, 4, seed=2), _f(2, 32, seed=3)],
     {"hidden_size": 4, "direction": "bidirectional"},
     lambda *a: _torch_recurrent("LSTM", *a), 14),
    ("lstm_reverse_initial_state", "LSTM",
     [_f(3, 2, 3), _f(1, 16, 3, seed=1), _f(1, 16, 4, seed=2), _f(1, 32, seed=3), None,
      _f(1, 2, 4, seed=4), _f(1, 2, 4, seed=5)], {"hidden_size": 4, "direction": "reverse"},
     lambda x, w, r, b, h, c: _torch_recurrent("LSTM", x, w, r, b, (h, c), reverse=True), 14),
    ("gru_linear_before_reset", "GRU",
     [_f(4, 2, 3), _f(1, 12, 3, seed=1), _f(1, 12, 4, seed=2), _f(1, 24, seed=3), None,
      _f(1, 2, 4, seed=4)], {"hidden_size": 4, "linear_before_reset": 1},
     lambda x, w, r, b, h: _torch_recurrent("GRU", x, w, r, b, (h,)), 14),
    # the reset before the product: no torch kernel computes it (forward only)
    ("gru_bidirectional_reset_first", "GRU",
     [_f(3, 2, 3), _f(2, 12, 3, seed=1), _f(2, 12, 4, seed=2), _f(2, 24, seed=3)],
     {"hidden_size": 4, "direction": "bidirectional"}, None, 14),
    ("rnn", "RNN", [_f(4, 2, 3), _f(1, 4, 3, seed=1), _f(1, 4, 4, seed=2), _f(1, 8, seed=3)],
     {"hidden_size": 4}, lambda *a: _torch_recurrent("RNN", *a), 14),
    ("rotary_embedding_position_ids", "RotaryEmbedding",
     [_f(1, 2, 3, 8), ROPE_COS.view(Known), ROPE_SIN.view(Known), ROPE_IDS], {},
     lambda x: _rope(x, torch.tensor(ROPE_COS[ROPE_IDS]), torch.tensor(ROPE_SIN[ROPE_IDS])),
     23),
    ("rotary_embedding_packed_interleaved_partial", "RotaryEmbedding",
     [_f(2, 3, 16), ROPE_COS_ROWS.view(Known), ROPE_SIN_ROWS.view(Known)],
     {"num_heads": 2, "rotary_embedding_dim": 4, "interleaved": 1},
     lambda x: _rope(x, torch.tensor(ROPE_COS_ROWS), torch.tensor(ROPE_SIN_ROWS), True, 4, 2),
     23),
    ("attention_causal_grouped_heads", "Attention",
     [_f(1, 4, 4, 8), _f(1, 2, 4, 8, seed=1), _f(1, 2, 4, 8, seed=2)], {"is_causal": 1},
     lambda q, k, v: _sdpa(q, k, v, is_causal=True), 23),
    ("attention_packed_additive_mask", "Attention",
     [_f(2, 3, 12), _f(2, 5, 12, seed=1), _f(2, 5, 12, seed=2), _f(3, 5, seed=3)],
     {"q_num_heads": 3, "kv_num_heads": 3, "scale": 0.3},
     lambda q, k, v, m: _packed_sdpa(q, k, v, m, 3, 0.3), 23),
    ("attention_boolean_mask", "Attention",
     [_f(1, 2, 3, 4), _f(1, 2, 5, 4, seed=1), _f(1, 2, 5, 4, seed=2), ATTENTION_MASK], {},
     lambda q, k, v: _sdpa(q, k, v, attn_mask=torch.tensor(ATTENTION_MASK)), 23),
    ("attention_boolean_mask_blind_query", "Attention",
     [_f(1, 2, 3, 4), _f(1, 2, 5, 4, seed=1), _f(1, 2, 5, 4, seed=2), ATTENTION_MASK_BLIND], {},
     lambda q, k, v: _sdpa(q, k, v, attn_mask=torch.tensor(ATTENTION_MASK_BLIND)), 23),
    ("attention_known_boolean_mask_blind_query", "Attention",
     [_f(1, 2, 3, 4), _f(1, 2, 5, 4, seed=1), _f(1, 2, 5, 4, seed=2),
      ATTENTION_MASK_BLIND.view(Known)], {},
     lambda q, k, v: _sdpa(q, k, v, attn_mask=torch.tensor(ATTENTION_MASK_BLIND)), 23),
    ("attention_cache", "Attention",
     [_f(1, 2, 2, 4), _f(1, 2, 2, 4, seed=1), _f(1, 2, 2, 4, seed=2), None,
      _f(1, 2, 3, 4, seed=3), _f(1, 2, 3, 4, seed=4)], {},
     lambda q, k, v, pk, pv: _sdpa(q, torch.cat([pk, k], 2), torch.cat([pv, v], 2)), 23),
    # grids reaching past the image (zeros / border padding)
    ("grid_sample_bilinear_zeros", "GridSample", [_f(2, 3, 4, 5), _f(2, 3, 2, 2, low=-1.2,
                                                                      high=1.2, seed=1)],
     {"mode": "linear"}, _grid_sample("bilinear", "zeros", False), 20),
    ("grid_sample_bilinear_border_corners", "GridSample",
     [_f(1, 2, 3, 4), _f(1, 2, 3, 2, low=-1.3, high=1.3, seed=1)],
     {"mode": "bilinear", "padding_mode": "border", "align_corners": 1},
     _grid_sample("bilinear", "border", True), 16),
    # Resize's other forms: no torch function computes them (torch's antialias filter is
    # another, 17% away from onnxruntime's here): forward only
    ("resize_linear_antialias", "Resize",
     [_f(1, 2, 8, 6), None, _known([1, 1, 0.5, 0.5], np.float32)],
     {"mode": "linear", "antialias": 1}, None, 18),
    ("resize_cubic_antialias_sizes", "Resize",
     [_f(1, 2, 7, 9), None, None, _known([1, 2, 3, 4])],
     {"mode": "cubic", "antialias": 1, "cubic_coeff_a": -0.5}, None, 18),
    ("resize_half_pixel_symmetric", "Resize",
     [_f(1, 2, 4, 5), None, _known([1, 1, 1.5, 0.6], np.float32)],
     {"mode": "linear", "coordinate_transformation_mode": "half_pixel_symmetric"}, None, 19),
    ("resize_cubic_exclude_outside", "Resize",
     [_f(1, 2, 4, 5), None, _known([1, 1, 1.75, 1.5], np.float32)],
     {"mode": "cubic", "exclude_outside": 1}, None, 13),
    ("resize_tf_crop_and_resize", "Resize",
     [_f(1, 2, 5, 6), _known([0, 0, 0.2, -0.1, 1, 1, 0.9, 1.2], np.float32), None,
      _known([1, 2, 4, 5])],
     {"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize",
      "extrapolation_value": 0.5}, None, 13),
    ("quantize_uint8", "QuantizeLinear", [_f(3, 5, low=-1, high=3), _known(0.02, np.float32)],
     {}, None, 13),
    ("quantize_int8_per_axis", "QuantizeLinear",
     [_f(2, 3, 4, low=-4, high=4), _known([0.02, 0.05, 0.1], np.float32),
      _known([3, -2, 0], np.int8)], {"axis": 1}, None, 13),
    ("dequantize_per_axis", "DequantizeLinear",
     [np.array([[-128, 5, 127], [0, -7, 64]], np.int8), _known([0.5, 0.25, 0.125], np.float32),
      _known([1, 0, -3], np.int8)], {"axis": 1}, None, 13),
    ("affine_grid", "AffineGrid", [_f(2, 2, 3), _known([2, 3, 4, 5])], {},
     lambda t: torch.nn.functional.affine_grid(t, [2, 3, 4, 5], align_corners=False), 20),
    ("affine_grid_3d_corners", "AffineGrid", [_f(1, 3, 4), _known([1, 1, 2, 3, 4])],
     {"align_corners": 1},
     lambda t: torch.nn.functional.affine_grid(t, [1, 1, 2, 3, 4], align_corners=True), 20),
    ("center_crop_pad", "CenterCropPad", [_f(2, 5, 4), _known([3, 7])], {"axes": [1, 2]},
     lambda x: torch.nn.functional.pad(x[:, 1:4], (1, 2)), 18),
    ("dft_real_onesided_padded", "DFT", [_f(2, 5, 1), _known(8), _known(1)],
     {"onesided": 1}, lambda x: _dft(x, 8, onesided=True, axis=1), 20),
    ("dft_complex_inverse_axis0", "DFT", [_f(6, 3, 2), None, _known(0)], {"inverse": 1},
     lambda x: _dft(x, inverse=True, axis=0), 20),
    ("dft_opset17_attribute_axis", "DFT", [_f(2, 7, 2)], {"axis": 1},
     lambda x: _dft(x, axis=1), 17),
    ("stft_windowed", "STFT",
     [_f(2, 20, 1), _known(4), STFT_WINDOW.view(Known), _known(6)], {},
     lambda x: torch.view_as_real(torch.stft(x[..., 0], 6, 4, window=torch.tensor(
         STFT_WINDOW, dtype=torch.float64), center=False, return_complex=True)).transpose(1, 2),
     17),
    ("grid_sample_nearest", "GridSample", [_f(1, 2, 4, 4), _f(1, 3, 3, 2, low=-1.1, high=1.1,
                                                               seed=1)],
     {"mode": "nearest"}, None, 20),  # the grid's gradient is zero, none to check
]


def _single_op_model(op, inputs, attrs, outputs, opset):
    from onnx import helper, numpy_helper
    from onnx.reference import ReferenceEvaluator
    names = [f"in{k}" if v is not None else "" for k, v in enumerate(inputs)]
    feeds, inits, graph_inputs = {}, [], []
    for name, value in zip(names, inputs):
        if value is None:
            continue
        if isinstance(value, Known) or value.dtype.kind == "f" and value.size > 1:
            inits.append(numpy_helper.from_array(np.asarray(value), name))
        else:
            feeds[name] = value
            graph_inputs.append(helper.make_tensor_value_info(
                name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape))
    node = helper.make_node(op, names, list(outputs), **attrs)
    graph = helper.make_graph([node], op, graph_inputs,
                              [onnx.ValueInfoProto(name=o) for o in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    # the outputs' types and shapes: onnx's shape inference, or where it gives none (a function
    # op such as MeanVarianceNormalization), onnx's reference implementation
    inferred = onnx.shape_inference.infer_shapes(model)
    if all(o.type.tensor_type.HasField("shape") for o in inferred.graph.output):
        return inferred, feeds
    values = ReferenceEvaluator(model).run(None, feeds)
    model.graph.ClearField("output")
    model.graph.output.extend(helper.make_tensor_value_info(
        o, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for o, v in zip(outputs, values))
    return model, feeds


# ops newer than this onnxruntime computes: onnx's reference implementation instead
ORT_LACKS = {"SwiGLU"}


def check_single_op(device, op, inputs, attrs, reference, opset):
    """One ONNX node through onnxruntime (or onnx's reference) and through vkml (forward); where
    `reference` is given, the gradient of sum(y * w) for each float initializer against PyTorch
    in float64."""
    outputs = {"TopK": ("y", "indices"), "LSTM": ("y", "y_h", "y_c"), "GRU": ("y", "y_h"),
               "RNN": ("y", "y_h")}.get(op, ("y",))
    if op == "Attention" and len(inputs) > 4:  # the cache: its outputs too
        outputs = ("y", "present_key", "present_value")
    model, feeds = _single_op_model(op, inputs, attrs, outputs, opset)
    if op in ORT_LACKS:
        from onnx.reference import ReferenceEvaluator
        wants = ReferenceEvaluator(model).run(None, feeds)
    else:
        wants = ort.InferenceSession(model.SerializeToString(),
                                     providers=["CPUExecutionProvider"]).run(None, feeds)
    imp = vkml.import_onnx(model)
    g = imp.graph
    y = imp.outputs[outputs[0]]
    weights = np.random.default_rng(7).standard_normal(y.shape).astype(np.float32)
    loss = g.sum(g.mul(y, g.constant(weights))) if reference is not None else None
    s = vkml.compile(g, loss=loss, outputs=imp.outputs, device=device)
    for name, value in feeds.items():  # vkml's boolean inputs are i32
        s.set_input(name, value.astype(np.int32) if value.dtype == bool else value)
    s.step() if loss is not None else s.forward()
    for name, want in zip(outputs, wants):
        got = s.read(name)
        if want.dtype.kind in "iub":
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            assert rel_l2(got, want) < FORWARD_TOL, name
    if reference is None:
        return
    params = [f"in{k}" for k, v in enumerate(inputs) if v is not None and v.dtype.kind == "f"
              and v.size > 1 and not isinstance(v, Known)]
    tensors = [torch.tensor(v, dtype=torch.float64, requires_grad=True) if f"in{k}" in params
               else None for k, v in enumerate(inputs)]
    out = reference(*[t for t in tensors if t is not None])
    (out * torch.tensor(weights, dtype=torch.float64)).sum().backward()
    for name in params:
        if tensors[int(name[2:])].grad is None:  # a constant to torch (a loss's class weights)
            assert name in imp.frozen, name
            continue
        want = tensors[int(name[2:])].grad.numpy()
        assert rel_l2(s.grad(name), want) < GRAD_TOL, name


@vulkan_only
@pytest.mark.parametrize("name, op, inputs, attrs, reference, opset", ONNX_OP_CASES,
                         ids=[c[0] for c in ONNX_OP_CASES])
def test_onnx_op_matches_onnxruntime_and_torch(device, name, op, inputs, attrs, reference,
                                               opset):
    check_single_op(device, op, inputs, attrs, reference, opset)


class Recurrent(torch.nn.Module):
    """A two-layer bidirectional batch-first LSTM, then a GRU, as torch.onnx writes them (a node
    per layer, the states between them from shape arithmetic)."""

    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True)
        self.gru = torch.nn.GRU(8, 5, batch_first=True)
        self.head = torch.nn.Linear(5, 5)

    def forward(self, x):
        y, _ = self.lstm(x)
        y, h = self.gru(y)
        return self.head(y[:, -1]) + h[0]


@vulkan_only
def test_onnx_recurrent_export_trains_as_pytorch(device, tmp_path):
    torch.manual_seed(0)
    module, x = Recurrent(), torch.randn(2, 4, 3)
    path = export_onnx(module, (x,), tmp_path / "recurrent.onnx", ["x"])
    imp = vkml.import_onnx(path)
    assert onnxruntime_error(path, x, device) < FORWARD_TOL
    g = imp.graph
    loss = g.sum(g.square(imp.outputs["logits"]))
    s = vkml.compile(g, loss=loss, outputs=imp.outputs, device=device)
    s.set_input("x", x.numpy())
    s.step()
    module(x).square().sum().backward()
    # the exporter reorders the gates into new initializers: their norms together
    ours = np.sqrt(sum(np.sum(s.grad(n).astype(np.float64) ** 2) for n in g.params))
    ref = np.sqrt(sum(float(p.grad.double().square().sum()) for p in module.parameters()))
    assert abs(ours - ref) / ref < GRAD_TOL
    assert rel_l2(s.grad("head.weight"), module.head.weight.grad.numpy()) < GRAD_TOL


class AttentionBlock(torch.nn.Module):
    """scaled_dot_product_attention under a boolean mask computed in the model, and RMSNorm:
    torch.onnx's dynamo exporter writes them as Attention and RMSNormalization at opset 23."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(8)

    def forward(self, q, k, v, lengths):
        mask = torch.arange(k.shape[2])[None, None, None, :] < lengths[:, None, None, None]
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.norm(y + torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True))


class BlindQueryAttention(torch.nn.Module):
    """Boolean masks under which a query sees no key (torch's SDPA gives it zeros): one known at
    export (a buffer), one computed in the model."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.from_numpy(ATTENTION_MASK_BLIND))

    def forward(self, q, k, v):
        computed = torch.arange(k.shape[2])[None, :] < torch.tensor([[2], [0], [5]])
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        return a + torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=computed)


@vulkan_only
def test_torch_attention_of_a_query_that_sees_no_key_is_zero(device):
    q, k, v = (torch.from_numpy(_f(1, 2, n, 4, seed=s)) for n, s in ((3, 0), (5, 1), (5, 2)))
    module = BlindQueryAttention()
    imp = vkml.import_torch(module, (q, k, v))
    s = vkml.compile(imp.graph, outputs=imp.outputs, device=device)
    for name, value in zip(imp.inputs, (q, k, v)):
        s.set_input(name, value.numpy())
    s.forward()
    (got,) = (s.read(name) for name in imp.outputs)
    want = module(*(t.double() for t in (q, k, v))).numpy()
    assert not want[0, :, 1].any()
    assert rel_l2(got, want) < FORWARD_TOL and not got[0, :, 1].any()


@vulkan_only
def test_onnx_opset_23_attention_export_matches_torch(device, tmp_path):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 8) for _ in range(3))
    lengths = torch.tensor([3, 5])
    module = AttentionBlock()
    path = str(tmp_path / "attention.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (q, k, v, lengths), path, dynamo=True, opset_version=23,
                          input_names=["q", "k", "v", "lengths"], output_names=["y"])
    assert {"Attention", "RMSNormalization"} <= {n.op_type for n in onnx.load(path).graph.node}
    imp = vkml.import_onnx(path)
    s = vkml.compile(imp.graph, outputs=imp.outputs, device=device)
    for name, value in zip(("q", "k", "v"), (q, k, v)):
        s.set_input(name, value.numpy())
    s.set_input("lengths", lengths.numpy().astype(np.int32))
    s.forward()
    assert rel_l2(s.read("y"), module(q, k, v, lengths).detach().numpy()) < FORWARD_TOL
