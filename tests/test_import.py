"""The front ends (vkml/importers/): small models exported by PyTorch to ONNX and through
torch.export, imported, and checked against onnxruntime and PyTorch: the forward pass,
every parameter's gradient, three AdamW steps against torch.optim, the trained model written
back (save_onnx -> onnxruntime, state_dict -> load_state_dict), and the refusals."""

from __future__ import annotations

import copy
import warnings

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
def test_onnx_mlp_trains_as_pytorch_and_saves_back(device, tmp_path):
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
