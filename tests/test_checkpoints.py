"""Checkpoints: a bad file changes nothing, whatever is wrong with it (unreadable, malformed,
another optimizer's state, integers for weights), and real files (torchvision's ResNet, Hugging
Face's Whisper, bf16 and f16 ones) load with strict=True; what is saved gets a normal file's
permissions. Parameters a session does not compute with are carried through load and save.
Also torch.optim's spelling of the optimizers, and numpy scalars and random draws as initial
values.
"""

from __future__ import annotations

import errno
import json
import os
import stat

import numpy as np
import pytest
from conftest import live_objects
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

import vkml
from vkml.models import resnet, whisper_encoder


def mlp(device, optimizer=None, seed=0, trainable=None):
    g = vkml.Graph(seed=seed)
    x = g.input("x", (4, 6))
    labels = g.input("labels", (4,), "i32")
    logits = vkml.nn.Linear(g, "fc2", 8, 3)(vkml.nn.Linear(g, "fc1", 6, 8)(x).relu())
    g.output("logits", logits)
    session = vkml.compile(g, loss=g.cross_entropy(logits, labels), optimizer=optimizer,
                           device=device, trainable=trainable)
    session.set_input("x", np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32))
    session.set_input("labels", np.array([0, 1, 2, 1], np.int32))
    return session


def trained_file(device, tmp_path, optimizer, name="ckpt.safetensors", steps=2):
    session = mlp(device, optimizer)
    for _ in range(steps):
        session.step()
    path = tmp_path / name
    session.save(path)
    session.close()
    return path


def write_raw(path, tensors, metadata=None):
    """A safetensors file written by hand (the format: 8 bytes of header length, the JSON
    header, the data), for dtypes numpy's safetensors cannot write (BF16)."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def assert_unchanged(session, before):
    after = session.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        np.testing.assert_array_equal(after[k], v, err_msg=k)


def assert_usable(session):
    session.step()
    assert np.isfinite(session.read("loss")).all()
    assert all(np.isfinite(v).all() for v in session.params().values())


# ---- the optimizer's state ---------------------------------------------------------------------

@pytest.mark.parametrize("saved,loading,message", [
    (vkml.SGD(lr=0.1), vkml.Adam(lr=1e-2),
     "it holds SGD optimizer state, and this session's optimizer is Adam"),
    (vkml.AdamW(lr=1e-2), vkml.Adam(lr=1e-2),
     "it holds AdamW optimizer state, and this session's optimizer is Adam"),
    (vkml.Adam(lr=1e-2), vkml.AdamW(lr=1e-2),
     "it holds Adam optimizer state, and this session's optimizer is AdamW"),
    (vkml.SGD(lr=0.1, momentum=0.9), vkml.SGD(lr=0.1),
     r"its SGD optimizer has momentum=0.9 \(this session: 0\), which the compiled update "
     "depends on"),
    (vkml.SGD(lr=0.1, momentum=0.9, nesterov=True), vkml.SGD(lr=0.1, momentum=0.9),
     r"nesterov=1 \(this session: 0\)"),
])
def test_another_optimizers_state_is_refused_and_changes_nothing(device, tmp_path, saved,
                                                                  loading, message):
    path = trained_file(device, tmp_path, saved)
    session = mlp(device, loading, seed=5)
    session.step()
    before = session.state_dict()
    with pytest.raises(vkml.CheckpointError, match=message) as info:
        session.load(path)
    assert "optimizer_state=False" in str(info.value) and "nothing was changed" in str(info.value)
    assert_unchanged(session, before)
    assert_usable(session)

    # Parameters alone, when asked: this session's optimizer state and hyperparameters stay.
    session = mlp(device, loading, seed=5)
    session.step()
    own = session.state_dict()
    session.load(path, optimizer_state=False)
    loaded = load_file(str(path))
    for k, v in session.state_dict().items():
        np.testing.assert_array_equal(v, loaded[k] if k in session.plan.params else own[k],
                                      err_msg=k)
    assert_usable(session)


def test_same_optimizer_resumes_with_the_files_hyperparameters(device, tmp_path):
    """Values not compiled in (lr, momentum once compiled with some, weight decay) are the
    file's after a load, as torch.optim's load_state_dict restores its param_groups."""
    path = trained_file(device, tmp_path, vkml.SGD(lr=0.05, momentum=0.9, weight_decay=0.1))
    session = mlp(device, vkml.SGD(lr=0.2, momentum=0.5), seed=3)
    session.load(path)
    hp = dict(zip(session.plan.hyperparams, session.state_dict()["optimizer/hyperparams"]))
    assert hp["lr"] == np.float32(0.05) and hp["momentum"] == np.float32(0.9)
    assert hp["weight_decay"] == np.float32(0.1) and hp["t"] == 2


@pytest.mark.parametrize("saved", [vkml.Adam(lr=1e-2, betas=(0.8, 0.9999), weight_decay=0.1),
                                   vkml.AdamW(lr=1e-2, betas=(0.95, 0.99))])
def test_resuming_adam_continues_exactly(device, tmp_path, saved):
    """The file's betas replace the session's, and with them the bias-correction tables the
    host computes from them (in float64 from the exact values the metadata keeps): the next
    steps are bit for bit those of the run that saved it."""
    original = mlp(device, saved)
    for _ in range(3):
        original.step()
    path = tmp_path / "adam.safetensors"
    original.save(path)
    resumed = mlp(device, type(saved)(lr=1e-3), seed=9)  # default betas and decay
    resumed.load(path)
    for _ in range(3):
        original.step()
        resumed.step()
    for k, v in original.state_dict().items():
        np.testing.assert_array_equal(resumed.state_dict()[k], v, err_msg=k)
    original.close()
    resumed.close()


def test_unlabelled_or_partial_optimizer_state_is_refused(device, tmp_path):
    path = trained_file(device, tmp_path, vkml.Adam(lr=1e-2))
    tensors = load_file(str(path))
    session = mlp(device, vkml.Adam(lr=1e-2), seed=4)
    before = session.state_dict()

    unlabelled = tmp_path / "unlabelled.safetensors"
    save_file(tensors, str(unlabelled))  # no metadata: which optimizer wrote it?
    with pytest.raises(vkml.CheckpointError, match="does not say which optimizer wrote it"):
        session.load(unlabelled)
    partial = tmp_path / "partial.safetensors"
    save_file({k: v for k, v in tensors.items() if not k.endswith("fc2.bias/exp_avg")},
              str(partial), metadata={"optimizer": "Adam",
                                      "hyperparams": "lr,beta1,beta2,eps,weight_decay,t"})
    with pytest.raises(vkml.CheckpointError,
                       match=r"missing optimizer state \['optimizer/fc2.bias/exp_avg'\]"):
        session.load(partial)
    assert_unchanged(session, before)
    session.load(partial, strict=False)  # what is there
    assert_usable(session)


def test_a_file_without_optimizer_state_says_so_when_a_training_session_loads_it(device,
                                                                                  tmp_path):
    """Parameters alone (a PyTorch state dict, a vkml inference session's save) loaded into a
    training session that has stepped: its optimizer keeps its own moments, as torch.optim's
    does, and a warning says so rather than letting them run on under other parameters
    unnoticed. Into a session that has not stepped (pretrained weights to fine-tune) the
    optimizer starts afresh, as torch.optim's made after load_state_dict: no warning."""
    import warnings

    trained = mlp(device, vkml.Adam(lr=1e-2))
    trained.step()
    path = tmp_path / "params.safetensors"
    save_file(trained.params(), str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mlp(device, vkml.Adam(lr=1e-2), seed=1).load(path)
    with pytest.warns(UserWarning, match=r"keeps the state of its own 1 step\(s\) \(exp_avg, "
                                         r"exp_avg_sq and step count\)"):
        trained.load(path)
    before = trained.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trained.load(path, optimizer_state=False)  # asked for: no warning
        mlp(device, seed=2).load(path)  # no optimizer
        mlp(device, vkml.SGD(lr=0.1), seed=2).load(path)  # plain SGD: no state to lose
    assert_unchanged(trained, before)  # its moments and step count stayed


def test_state_missing_for_some_parameters_is_named_when_loaded_with_strict_false(device,
                                                                                 tmp_path):
    """A run that trained the head alone, resumed training everything: the backbone's fresh
    state would run under the file's step count (vkml has one for all parameters, torch.optim
    one per parameter), so strict=True refuses it and strict=False names those parameters."""
    import warnings

    head = mlp(device, vkml.Adam(lr=1e-2), trainable=lambda name: name.startswith("fc2"))
    head.step()
    head.step()
    path = tmp_path / "head.safetensors"
    head.save(path)
    everything = mlp(device, vkml.Adam(lr=1e-2), seed=1)
    with pytest.raises(vkml.CheckpointError, match=r"missing optimizer state \['optimizer/fc1"):
        everything.load(path)
    with pytest.warns(UserWarning, match=r"no optimizer state for \['fc1.weight', 'fc1.bias'\]"
                                         ".*step count t=2"):
        everything.load(path, strict=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mlp(device, vkml.Adam(lr=1e-2), seed=1).load(path, optimizer_state=False)


# ---- dtypes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.bool_])
def test_integer_and_boolean_tensors_are_refused_for_float_parameters(device, tmp_path, dtype):
    session = mlp(device, vkml.Adam(lr=1e-2))
    before = session.state_dict()
    tensors = dict(session.params())
    tensors["fc1.weight"] = np.ones((8, 6), dtype)
    path = tmp_path / "ints.safetensors"
    save_file(tensors, str(path))
    code = {np.int32: "I32", np.int64: "I64", np.uint8: "U8", np.bool_: "BOOL"}[dtype]
    with pytest.raises(vkml.CheckpointError,
                       match=f"'fc1.weight' is {code} in the file, but it is a floating-point "
                             "parameter here"):
        session.load(path)
    assert_unchanged(session, before)
    assert_usable(session)


def test_f16_bf16_and_f64_tensors_load_as_f32(device, tmp_path):
    session = mlp(device)
    params = session.params()
    rng = np.random.default_rng(0)
    values = {n: rng.standard_normal(v.shape).astype(np.float32) for n, v in params.items()}
    # bf16 is the upper half of an f32: these values are exact in it
    bf16 = {n: (v.view(np.uint32) & 0xFFFF0000).view(np.float32) for n, v in values.items()}
    raw = {}
    for n, v in bf16.items():
        if n.startswith("fc1"):
            raw[n] = ("BF16", v.shape, (v.view(np.uint32) >> 16).astype("<u2").tobytes())
        elif n == "fc2.weight":
            raw[n] = ("F16", v.shape, v.astype("<f2").tobytes())
        else:
            raw[n] = ("F64", v.shape, v.astype("<f8").tobytes())
    path = tmp_path / "mixed.safetensors"
    write_raw(path, raw)
    session.load(path)
    for n in params:
        want = bf16[n].astype(np.float16).astype(np.float32) if n == "fc2.weight" else bf16[n]
        np.testing.assert_array_equal(session.read(n), want, err_msg=n)


def test_bf16_file_written_by_torch(device, tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as torch_save

    session = mlp(device)
    tensors = {n: torch.randn(v.shape, dtype=torch.bfloat16) for n, v in session.params().items()}
    path = tmp_path / "bf16.safetensors"
    torch_save(tensors, str(path))
    session.load(path)
    for n, t in tensors.items():
        np.testing.assert_array_equal(session.read(n), t.float().numpy(), err_msg=n)


def test_f64_beyond_f32_is_refused(device, tmp_path):
    session = mlp(device)
    tensors = {n: v.astype(np.float64) for n, v in session.params().items()}
    tensors["fc2.bias"][1] = 1e300
    path = tmp_path / "big.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(vkml.CheckpointError, match="'fc2.bias' holds F64 values beyond"):
        session.load(path)


# ---- unreadable files --------------------------------------------------------------------------

def test_unreadable_files_raise_checkpoint_error_keeping_the_cause(device, tmp_path):
    good = trained_file(device, tmp_path, vkml.Adam(lr=1e-2))
    data = good.read_bytes()
    session = mlp(device, vkml.Adam(lr=1e-2), seed=2)
    session.step()
    before = session.state_dict()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[:len(data) // 2])
    noise = tmp_path / "noise.safetensors"
    noise.write_bytes(np.random.default_rng(0).bytes(4096))
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    cases = [(truncated, SafetensorError, "is not a valid safetensors file"),
             (noise, SafetensorError, "is not a valid safetensors file"),
             (short, SafetensorError, "is not a valid safetensors file"),
             (tmp_path, IsADirectoryError, "cannot read checkpoint"),
             (tmp_path / "absent.safetensors", FileNotFoundError, "cannot read checkpoint")]
    for path, cause, message in cases:
        with pytest.raises(vkml.CheckpointError, match=message) as info:
            session.load(path)
        assert isinstance(info.value, vkml.VkmlError) and isinstance(info.value, vkml.InputError)
        assert isinstance(info.value.__cause__, cause), (path, info.value.__cause__)
        assert str(path) in str(info.value)
    assert_unchanged(session, before)
    assert_usable(session)
    session.load(good)  # and a good file still loads


def test_unwritable_destinations_raise_checkpoint_error(device, tmp_path):
    session = mlp(device, vkml.Adam(lr=1e-2))
    for path, cause in [(tmp_path / "no" / "such" / "dir.safetensors", FileNotFoundError),
                        (tmp_path, IsADirectoryError)]:
        with pytest.raises(vkml.CheckpointError, match="cannot write ") as info:
            session.save(path)
        assert isinstance(info.value.__cause__, cause)
    leftovers = [p for p in os.listdir(tmp_path.parent) if p.endswith(".tmp")]
    assert os.listdir(tmp_path) == [] and not leftovers  # no temporary file left behind
    assert_usable(session)


def test_a_full_disk_keeps_the_old_file_and_paths_of_any_kind_are_named(device, tmp_path,
                                                                         monkeypatch):
    session = mlp(device, vkml.Adam(lr=1e-2))
    path = tmp_path / "kept.safetensors"
    session.save(path)
    old = path.read_bytes()
    session.step()
    real_fsync = os.fsync

    def full(fd):  # the data written so far reaches the disk only here
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(vkml.CheckpointError, match="No space left on device") as info:
        session.save(path)
    assert isinstance(info.value.__cause__, OSError)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert path.read_bytes() == old and os.listdir(tmp_path) == ["kept.safetensors"]
    # bytes name a file as the OS does; None was a TypeError from os.fspath
    session.save(os.fsencode(tmp_path / "bytes.safetensors"))
    session.load(os.fsencode(tmp_path / "bytes.safetensors"))
    for call in (session.save, session.load):
        with pytest.raises(vkml.CheckpointError, match="at None: give its path"):
            call(None)
    assert_usable(session)


# ---- permissions -------------------------------------------------------------------------------

@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_saved_files_get_the_umasks_permissions(device, tmp_path, umask, mode):
    session = mlp(device)
    old = os.umask(umask)
    try:
        session.save(tmp_path / "new.safetensors")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "new.safetensors").st_mode) == mode


def test_overwriting_keeps_the_files_permissions(device, tmp_path):
    session = mlp(device)
    path = tmp_path / "kept.safetensors"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    session.save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert load_file(str(path)).keys() == session.params().keys()
    assert sorted(os.listdir(tmp_path)) == ["kept.safetensors"]


# ---- real files --------------------------------------------------------------------------------

def test_torchvision_resnet_file_loads_strictly_and_round_trips(device, rng, tmp_path):
    """torchvision's ResNet state dict (here the reference module, which has its names, as
    model.eval()): running statistics and the int64 num_batches_tracked counters included."""
    torch = pytest.importorskip("torch")
    import torch_reference as ref
    from safetensors.torch import load_file as torch_load
    from safetensors.torch import save_file as torch_save

    cfg = resnet.tiny("basic")
    cfg = type(cfg)(**{**cfg.__dict__, "bn": "eval"})
    module = ref.ResNet(cfg)
    with torch.no_grad():
        for name, buf in module.named_buffers():
            if name.endswith("running_mean"):
                buf.copy_(torch.randn_like(buf) * 0.1)
            elif name.endswith("running_var"):
                buf.uniform_(0.5, 2.0)
            elif name.endswith("num_batches_tracked"):
                buf.fill_(1000 + len(name))
    module.eval()
    path = tmp_path / "resnet.safetensors"
    torch_save(module.state_dict(), str(path))
    assert "bn1.num_batches_tracked" in torch_load(str(path))

    built = resnet.build(cfg)
    session = vkml.compile(built.graph, outputs=built.outputs, device=device)
    session.load(path)  # strict
    x = built.sample_inputs(rng)["x"]
    session.set_input("x", x)
    session.forward()
    want = module(torch.tensor(x), torch.zeros(cfg.batch, dtype=torch.long))[0]["logits"]
    np.testing.assert_allclose(session.read("logits"), want.detach().numpy(), rtol=1e-3,
                               atol=1e-4)

    saved = tmp_path / "saved.safetensors"
    session.save(saved)
    back = torch_load(str(saved))
    original = module.state_dict()
    assert back.keys() == original.keys()
    assert back["bn1.num_batches_tracked"].dtype == torch.int64
    for k, v in original.items():
        assert torch.equal(back[k], v), k
    module.load_state_dict(back, strict=True)

    # A counter of the wrong kind is refused like any other misfit.
    tensors = load_file(str(saved))
    tensors["bn1.num_batches_tracked"] = np.array(3.5, np.float32)
    save_file(tensors, str(saved))
    with pytest.raises(vkml.CheckpointError, match="'bn1.num_batches_tracked' is F32 in the "
                                                   "file; this graph keeps integers"):
        session.load(saved)
    session.close()


def test_hugging_face_whisper_positions_load_from_the_file(device, rng, tmp_path):
    """embed_positions.weight is a frozen parameter loaded from the file (here not the default
    sinusoids, so a model that ignored it would differ)."""
    torch = pytest.importorskip("torch")
    import torch_reference as ref
    from safetensors.torch import save_file as torch_save

    cfg = whisper_encoder.tiny()
    module = ref.WhisperForAudioClassification(cfg)
    with torch.no_grad():
        module.encoder.embed_positions.weight.normal_()
    path = tmp_path / "whisper.safetensors"
    torch_save(module.state_dict(), str(path))

    built = whisper_encoder.build(cfg)
    session = vkml.compile(built.graph, loss=built.loss, outputs=built.outputs,
                           optimizer=vkml.Adam(lr=1e-2), device=device)
    assert "encoder.embed_positions.weight" not in session.plan.trainable
    session.load(path)  # strict
    inputs = built.sample_inputs(rng)
    for k, v in inputs.items():
        session.set_input(k, v)
    session.forward()
    want = module(torch.tensor(inputs["input_features"]), torch.tensor(inputs["labels"]))[0]
    np.testing.assert_allclose(session.read("logits"), want["logits"].detach().numpy(),
                               rtol=1e-3, atol=1e-5)
    session.step()  # frozen: training leaves the file's table alone
    np.testing.assert_array_equal(session.read("encoder.embed_positions.weight"),
                                  module.encoder.embed_positions.weight.detach().numpy())

    # use_weighted_layer_sum=True adds layer_weights: refused by name, even when not strict.
    before = session.state_dict()
    tensors = {k: v.detach().numpy() for k, v in module.state_dict().items()}
    tensors["layer_weights"] = np.full(cfg.encoder_layers + 1, 1 / (cfg.encoder_layers + 1),
                                       np.float32)
    weighted = tmp_path / "weighted.safetensors"
    save_file(tensors, str(weighted))
    for strict in (True, False):
        with pytest.raises(vkml.CheckpointError,
                           match="it holds 'layer_weights': .*use_weighted_layer_sum=True"):
            session.load(weighted, strict=strict)
    assert_unchanged(session, before)
    session.close()


# ---- torch's spelling --------------------------------------------------------------------------

def test_optimizers_take_torch_optims_keywords(device):
    assert vkml.Adam(lr=1e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1) == vkml.Adam(
        1e-3, 0.8, 0.99, 1e-6, 0.1)
    assert vkml.AdamW(betas=(0.9, 0.95), fused=True, foreach=False).hyperparams() == {
        "lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 1e-2}
    assert vkml.SGD(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-4, nesterov=False,
                    foreach=None, differentiable=False, fused=None) == vkml.SGD(
        0.1, 0.9, 0.1, 1e-4, False)
    assert vkml.SGD().lr == 1e-3 and vkml.Adam().lr == 1e-3  # torch.optim's defaults

    # The same training either way.
    a, b = mlp(device, vkml.Adam(lr=1e-2, betas=(0.8, 0.9))), mlp(
        device, vkml.Adam(lr=1e-2, beta1=0.8, beta2=0.9))
    for s in (a, b):
        s.step()
        s.step()
    for k, v in a.params().items():
        np.testing.assert_array_equal(b.read(k), v, err_msg=k)


@pytest.mark.parametrize("make,message", [
    (lambda: vkml.Adam(amsgrad=True), r"Adam\(amsgrad=True\): vkml's Adam does not implement"),
    (lambda: vkml.AdamW(maximize=True), r"AdamW\(maximize=True\)"),
    (lambda: vkml.Adam(decoupled_weight_decay=True), "use vkml.AdamW"),
    (lambda: vkml.SGD(maximize=True), r"SGD\(maximize=True\)"),
    (lambda: vkml.Adam(betas=0.9), "give two numbers"),
    (lambda: vkml.Adam(betas=(0.8, 0.9), beta1=0.7), "give betas or beta1/beta2, not both"),
    (lambda: vkml.Adam(betas=(0.9, 1.5)), "beta2=1.5 must be at least 0 and below 1"),
    # torch.optim.Adam(params, 1e-3, (0.9, 0.99), 1e-8, 0.01) with params left out
    (lambda: vkml.AdamW(1e-3, (0.9, 0.99), 1e-8, 0.01),
     r"the second positional argument is beta1 here \(torch.optim's is betas\): give "
     r"betas=\(0.9, 0.99\)"),
])
def test_torch_options_vkml_lacks_are_refused(make, message):
    with pytest.raises(vkml.InputError, match=message):
        make()


def test_numpy_scalars_initialise_parameters_like_python_numbers():
    g = vkml.Graph()
    for i, value in enumerate([np.float32(0.25), np.float64(0.25), np.int64(2), 0.25,
                               np.array(0.25, np.float32)]):
        p = g.param(f"p{i}", (2, 3), value)
        np.testing.assert_array_equal(g.initial_values[p.id], np.full((2, 3), float(value),
                                                                      np.float32))
    with pytest.raises(vkml.GraphError, match="unknown init 'ones'"):
        g.param("q", (2,), "ones")


def test_random_initial_values_are_numpys_draws_whatever_their_size():
    """"normal" and "uniform" draw into the f32 result a piece at a time (a parameter needs no
    float64 copy of itself on the host): the values are the one-shot draws' all the same."""
    g = vkml.Graph(seed=7)
    shape = (3, (1 << 20) // 3 + 5)  # more than one piece
    normal = g.param("normal", shape, "normal", 0.02)
    uniform = g.param("uniform", shape, "uniform", 0.5)
    expected = np.random.default_rng(7)
    np.testing.assert_array_equal(g.initial_values[normal.id],
                                  (expected.standard_normal(shape) * 0.02).astype(np.float32))
    np.testing.assert_array_equal(g.initial_values[uniform.id],
                                  expected.uniform(-0.5, 0.5, shape).astype(np.float32))


def test_parameters_the_outputs_do_not_use_are_carried_through_load_and_save(device,
                                                                             tmp_path):
    """An encoder-only session of an encoder-decoder graph holds the decoder's weights on the
    host: a strict load of the whole model's file takes them, and its save keeps them."""
    g = vkml.Graph(seed=2)
    x, y = g.input("x", (4, 5)), g.input("y", (4, 3))
    code = g.tanh(x @ g.param("enc.weight", (5, 6), "normal", 0.5))
    pred = code @ g.param("dec.weight", (6, 3), "normal", 0.5)
    trainer = vkml.compile(g, loss=g.mse(pred, y), optimizer=vkml.Adam(lr=0.05), device=device)
    data = np.random.default_rng(3)
    trainer.set_input("x", data.standard_normal((4, 5)).astype(np.float32))
    trainer.set_input("y", data.standard_normal((4, 3)).astype(np.float32))
    for _ in range(2):
        trainer.step()
    full = tmp_path / "full.safetensors"
    trainer.save(full)
    trained = trainer.params()

    encoder = vkml.compile(g, outputs={"code": code}, device=device)
    assert "dec.weight" not in encoder.plan.params  # no device memory for it
    assert not np.array_equal(encoder.read("dec.weight"), trained["dec.weight"])
    encoder.load(full)  # strict: optimizer state is skipped, dec.weight is no unknown tensor
    for name, value in trained.items():
        np.testing.assert_array_equal(encoder.params()[name], value)
    again = tmp_path / "again.safetensors"
    encoder.save(again)
    saved = load_file(again)
    assert set(saved) == set(trained)
    for name, value in trained.items():
        np.testing.assert_array_equal(saved[name], value)

    encoder.set_param("dec.weight", np.ones((6, 3)))
    np.testing.assert_array_equal(encoder.read("dec.weight"), np.ones((6, 3), np.float32))
    with pytest.raises(vkml.InputError, match=r"expects shape \(6, 3\)"):
        encoder.set_param("dec.weight", np.ones((3, 6), np.float32))
    save_file({"enc.weight": trained["enc.weight"]}, tmp_path / "encoder_only.safetensors")
    with pytest.raises(vkml.CheckpointError, match=r"missing parameters \['dec.weight'\]"):
        encoder.load(tmp_path / "encoder_only.safetensors")
    np.testing.assert_array_equal(encoder.read("dec.weight"), np.ones((6, 3), np.float32))
    encoder.load(again)
    np.testing.assert_array_equal(encoder.read("dec.weight"), trained["dec.weight"])


def test_save_from_gpu_memory_reads_in_batches_and_keeps_nothing(device, tmp_path):
    # a discrete GPU's memory is not host-readable: its tensors go through staging copies,
    # several tensors a submission, and nothing is kept afterwards (a read-back per tensor
    # would keep up to 256 staging buffers and programs after a checkpoint)
    if device.backend_name != "vulkan":
        pytest.skip("the staging path is the Vulkan backend's (wgpu maps each read)")
    session = mlp(device, vkml.Adam(lr=1e-2))
    session.step()
    params = session.params()
    backend = session._bound.backend
    for arena in session._bound.arenas:  # the path of memory the host cannot map
        arena.host_read = arena.host_write = False
    before = live_objects(device)
    submissions = []
    run_now = backend.run_now
    backend.run_now = lambda commands: (submissions.append(len(commands)), run_now(commands))[1]
    try:
        session.save(tmp_path / "gpu.safetensors")
    finally:
        del backend.run_now
    assert backend.live_objects() == before
    saved = load_file(tmp_path / "gpu.safetensors")
    assert submissions == [len(saved)], submissions  # every tensor in one submission
    for name, value in params.items():
        np.testing.assert_array_equal(saved[name], value)
    session.close()
