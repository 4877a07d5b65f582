"""The host application (xr_demo/): its scheduler's decisions, a short headless run (outputs
written, depth error falls, results bit-identical across chunkings), a window under Xvfb, and
an OpenXR session against Monado in a Debian 13 chroot (tools/monado_chroot.sh).

Every GPU test runs the demo with the Khronos validation layer on when `make test` sets it, and
fails on any message the layer reports through the host's debug messenger."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import subprocess_env

from xr_demo.schedule import SLACK_PIECE, Policy, plan_pieces

REPO = Path(__file__).resolve().parent.parent
VALIDATING = "VK_LAYER_KHRONOS_validation" in os.environ.get("VK_INSTANCE_LAYERS", "")


# ---- pure parts ---------------------------------------------------------------------------

def test_slack_plan_takes_as_many_pieces_as_fit():
    costs = [2.0, 3.0, 4.0, 2.0]
    assert plan_pieces(costs, 10.0, 0.0, False, False) == 3  # 2 + 3 + 4 fit, + 2 would not
    assert plan_pieces([2.0, 3.0, 5.0], 10.0, 0.0, False, False) == 3  # exactly the slack
    assert plan_pieces(costs, 10.0, 6.0, False, True) == 1  # an earlier job took 6 ms
    assert plan_pieces(costs, 1.0, 0.0, False, True) == 0  # nothing fits beside other work
    # a piece longer than the whole slack goes alone, in a frame with no other model work
    assert plan_pieces([30.0, 1.0], 10.0, 0.0, False, False) == 1
    assert plan_pieces([30.0, 1.0], 10.0, 0.0, False, True) == 0
    assert plan_pieces(costs, 0.5, 0.0, True, True) == 1  # one-per-frame policies: always one
    assert plan_pieces([], 10.0, 0.0, False, False) == 0


class FakeJob:
    """What the Scheduler sees of a Job: a step in progress whose pieces cost `costs` ms."""

    def __init__(self, costs, name="train"):
        self.name, self.policy, self.costs = name, Policy("slack"), list(costs)
        self._in_step, self._next, self.started, self.calls = True, 0, True, []

    @property
    def pieces_left(self):
        return len(self.costs) - self._next

    def submit(self, frame, max_ms, at_least_one=False):
        n, total = 0, 0.0
        for c in self.costs[self._next:]:  # what session.step_chunk(max_ms=...) packs
            if total + c > max_ms:
                break
            total, n = total + c, n + 1
        if n == 0 and at_least_one:
            n, total = 1, self.costs[self._next]
        self.calls.append((frame, n))
        self._next += n
        return n, total


def test_scheduler_keeps_pieces_longer_than_the_slack_after_the_render():
    from xr_demo.schedule import Scheduler

    job = FakeJob([30.0, 2.0, 3.0])
    scheduler = Scheduler([job])
    scheduler.new_frame()
    use = scheduler.fill(0, 10.0, "before")  # would make this frame late as well
    assert use.pieces == 0 and job._next == 0
    use = scheduler.fill(0, 10.0, "after")  # alone, after the render
    assert use.pieces == 1 and use.oversized and job._next == 1
    scheduler.new_frame()
    assert scheduler.fill(1, 10.0, "before").pieces == 2  # the rest fits before the render


def test_a_long_piece_is_not_kept_waiting_by_another_jobs_small_ones():
    from xr_demo.schedule import Scheduler

    infer, train = FakeJob([1.0] * 50, "infer"), FakeJob([30.0, 1.0])
    scheduler = Scheduler([infer, train])
    for frame in range(3):
        scheduler.new_frame()
        scheduler.fill(frame, 10.0, "before")
        scheduler.fill(frame, 10.0, "after")
    # frame 0: the small pieces fill it; frame 1 belongs to the long piece, alone
    assert train.calls == [(1, 1)] and infer.calls == [(0, 10), (2, 10)]


def test_policies_parse():
    assert Policy.parse("slack") == Policy("slack")
    assert Policy.parse("chunks:4") == Policy("chunks", 4)
    assert str(Policy.parse("budget:2.5")) == "budget=2.5ms"
    assert Policy.parse("chunks:2").one_per_frame and not Policy.parse("slack").one_per_frame
    with pytest.raises(ValueError, match="unknown schedule"):
        Policy.parse("fastest")
    # the slack policy's pieces are sized to the slack; with none to size them by, a level
    assert Policy("slack").within(12.0) == Policy("slack", 12.0 * SLACK_PIECE)
    assert Policy("slack").within(float("inf")) == Policy("slack")
    assert Policy("slack").within(0.0) == Policy("slack")
    assert Policy("chunks", 2).within(12.0) == Policy("chunks", 2)


def test_network_freezes_the_encoder_for_decoder_only_live_training():
    from xr_demo import model as net

    cfg = net.config_for(32)
    assert cfg.patch == 4 and cfg.grid == 8
    decoder_only = net.build(cfg, live="decoder")
    frozen = {n for n, t in decoder_only.graph.params.items() if not t.attrs["trainable"]}
    assert frozen and all(n.startswith("encoder.") for n in frozen)
    assert all(t.attrs["trainable"] for n, t in decoder_only.graph.params.items()
               if n.startswith("decoder."))
    whole = net.build(cfg, live="all")
    assert all(t.attrs["trainable"] for t in whole.graph.params.values())
    assert decoder_only.depth.shape == (1, 1, 32, 32)
    with pytest.raises(ValueError):
        net.config_for(36)


def test_vits14_network_freezes_its_dinov2_encoder_and_predicts_at_the_input_size():
    from xr_demo import model as net

    cfg = net.config("vits14", 28)  # DINOv2-small's encoder at 2 x 2 patches
    assert cfg.grid == 2 and cfg.taps == (3, 6, 9, 12)
    built = net.build(cfg, live="decoder")
    params = built.graph.params
    frozen = {n for n, t in params.items() if not t.attrs["trainable"]}
    assert frozen == {n for n in params if n.startswith("encoder.")}
    assert "encoder.encoder.layer.11.attention.q_proj.weight" in frozen  # Dinov2Model's names
    assert sum(params[n].size for n in frozen) == 22_056_576  # DINOv2-small's 22.1 M
    assert built.depth.shape == (1, 1, 28, 28)
    with pytest.raises(ValueError, match="multiple of its patch 14"):
        net.config("vits14", 32)


def test_command_line_picks_each_models_size_and_keeps_the_load_headless():
    from xr_demo.__main__ import parse

    assert parse([]).model == "small" and parse([]).resolution == 64  # make demo's
    vits14 = parse(["--model", "vits14", "--load-ms", "3"])
    assert (vits14.resolution, vits14.load_ms) == (224, 3.0)
    assert parse(["--model", "vits14", "--size", "28"]).resolution == 28
    for wrong in (["--window", "--load-ms", "3"], ["--model", "vits14", "--size", "32"],
                  ["--encoder-weights", "x.safetensors"],  # the small model has no DINOv2
                  ["--model", "vits14", "--encoder-weights", "/nonexistent.safetensors"],
                  ["--predict-in-training", "--train-every", "2"]):
        with pytest.raises(SystemExit):
            parse(wrong)


def test_encoder_weights_of_another_architecture_end_in_one_line(tmp_path, capsys):
    from safetensors.numpy import save_file

    from xr_demo.__main__ import main

    path = tmp_path / "other.safetensors"  # a ViT 32 wide, not ViT-S/14's 384
    save_file({"embeddings.cls_token": np.zeros((1, 1, 32), np.float32),
               "embeddings.position_embeddings": np.zeros((1, 5, 32), np.float32),
               "embeddings.patch_embeddings.projection.weight":
                   np.zeros((32, 3, 14, 14), np.float32),
               "encoder.layer.0.mlp.fc1.weight": np.zeros((128, 32), np.float32)}, str(path))
    assert main(["--model", "vits14", "--size", "28", "--encoder-weights", str(path),
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not ViT-S/14's weights" in err[0] and "width 32" in err[0], err


# ---- headless runs (in this process, on the host's own device) ----------------------------

def _headless(tmp_path, name: str, **kw):
    from xr_demo import headless
    from xr_demo.app import Options

    opts = Options(resolution=32, frames=24, hz=72.0, train_every=2, infer_every=3,
                   live="all", lr=3e-3, seed=3, out=str(tmp_path / name),
                   save=str(tmp_path / f"{name}.safetensors"), max_pending=100)
    for k, v in kw.items():
        setattr(opts, k, v)
    lines: list[str] = []
    metrics = headless.run(opts, lines.append)
    return metrics, lines


def test_animation_is_an_animated_png(tmp_path):
    from xr_demo.app import Prediction
    from xr_demo.outputs import write_animation

    rng = np.random.default_rng(0)
    predictions = [Prediction(f, f / 72, f, rng.integers(0, 256, (8, 8, 3), dtype=np.uint8),
                              rng.random((8, 8)) + 1, rng.random((8, 8)) + 1, 0.5)
                   for f in range(3)]
    write_animation(str(tmp_path / "a.gif"), str(tmp_path / "a.apng"), predictions)
    assert b"acTL" in (tmp_path / "a.apng").read_bytes()[:200]
    assert (tmp_path / "a.gif").read_bytes()[:6] == b"GIF89a"


def test_headless_run_writes_its_outputs_and_learns(tmp_path):
    metrics, lines = _headless(tmp_path, "run")
    out = tmp_path / "run"
    assert (out / "strip.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "learning.gif").read_bytes()[:6] == b"GIF89a"
    saved = json.loads((out / "metrics.json").read_text())
    apng = (out / "learning.apng").read_bytes()
    assert apng[:8] == b"\x89PNG\r\n\x1a\n"
    # Pillow writes one prediction as a still PNG (this short run may make only one), more
    # as an animation (test_animation_is_an_animated_png)
    assert (b"acTL" in apng[:200]) == (len(saved["depth_error"]["live_abs_rel"]) > 1)
    assert saved["outputs"]["strip"].endswith("strip.png")
    assert any(str(out / "strip.png") in line for line in lines)  # it says where they are
    run = metrics["run"]
    for key in ("frame_ms_p50", "frame_ms_p99", "missed_frames_72hz", "missed_frames_90hz",
                "train_latency_ms_p50", "infer_latency_ms_p50"):
        assert run[key] is not None, key
    assert run["train_steps"] == 12 and run["dropped_samples"] == 0
    err = metrics["depth_error"]
    assert len(err["train_loss"]) == 12 and err["live_abs_rel"]
    # The depth error on held-out views after 12 training steps is lower than at the start.
    assert err["eval_abs_rel_end"] < 0.8 * err["eval_abs_rel_start"], err
    assert metrics["validating"] == VALIDATING  # the layer watched when asked to
    assert metrics["validation_messages"] == []


def _tiny_dinov2(tmp_path, kind: str):
    """A seeded tiny transformers DINOv2 (xr_demo's VITS14 narrowed to dinov2.tiny() by the
    caller) and its file: a Dinov2Model state dict in safetensors (name -> value of every
    tensor) or Dinov2Backbone with four stages exported to ONNX (initializer -> value)."""
    transformers = pytest.importorskip("transformers")
    import torch
    from safetensors.torch import save_file

    from vkml.models import dinov2

    tiny = dinov2.tiny()
    torch.manual_seed(0)
    config = transformers.Dinov2Config(
        hidden_size=tiny.hidden_size, num_hidden_layers=4 if kind == "onnx" else 2,
        num_attention_heads=tiny.num_attention_heads, image_size=tiny.image_size,
        out_features=["stage1", "stage2", "stage3", "stage4"] if kind == "onnx" else None)
    if kind == "safetensors":
        model = transformers.Dinov2Model(config).eval()
        path = tmp_path / "dinov2.safetensors"
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(path))
        return model, path, {k: v.numpy() for k, v in state.items()}
    onnx = pytest.importorskip("onnx")
    model = transformers.Dinov2Backbone(config).eval()
    path = tmp_path / "dinov2_backbone.onnx"
    torch.onnx.export(model, (torch.randn(1, 3, 28, 28),), str(path), dynamo=False,
                      input_names=["pixel_values"])
    return model, path, {t.name: onnx.numpy_helper.to_array(t)
                         for t in onnx.load(str(path)).graph.initializer}


@pytest.mark.parametrize("device", ["vulkan"], indirect=True)  # the demo's backend
def test_onnx_backbone_gives_transformers_feature_maps(tmp_path, monkeypatch, device):
    """--encoder-weights x.onnx: the encoder imported from Dinov2Backbone's ONNX export, its
    four feature maps those of the float64 module."""
    import torch

    import vkml
    from vkml.models import dinov2
    from xr_demo import model as net

    monkeypatch.setattr(net, "VITS14", dinov2.tiny())
    backbone, path, _ = _tiny_dinov2(tmp_path, "onnx")
    g, _, maps = net.onnx_backbone(net.config("vits14", 28, encoder_onnx=str(path)), 1, 0)
    session = vkml.compile(g, outputs={f"map{i}": m for i, m in enumerate(maps)}, device=device)
    x = np.random.default_rng(0).standard_normal((1, 3, 28, 28)).astype(np.float32)
    session.set_input("image", x)
    session.step()
    with torch.no_grad():
        expected = backbone.double()(torch.tensor(x, dtype=torch.float64)).feature_maps
    for i, value in enumerate(expected):
        got, want = session.read(f"map{i}"), value.numpy()
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-4, i


@pytest.mark.parametrize("kind", ["safetensors", "onnx"])
def test_headless_run_of_the_vits14_model_with_encoder_weights(tmp_path, monkeypatch, kind):
    """The whole demo path with the vits14 model (its encoder narrowed to a tiny DINOv2 so
    that lavapipe runs it in seconds) and the synthetic render load: the encoder's weights
    come from a transformers Dinov2Model's safetensors file (or an ONNX export of its
    backbone) and stay as they were while the decoder learns."""
    from safetensors.numpy import load_file

    from vkml.models import dinov2
    from xr_demo import model as net

    monkeypatch.setattr(net, "VITS14", dinov2.tiny())
    _, weights, tensors = _tiny_dinov2(tmp_path, kind)
    metrics, lines = _headless(tmp_path, "vits14", model="vits14", resolution=28,
                               encoder_weights=str(weights), frames=8, train_every=1,
                               infer_every=1, live="decoder", evaluate=False, load_ms=1.0,
                               load_size=32)
    assert any(line.startswith("model vits14") and str(weights) in line for line in lines)
    network = metrics["network"]
    assert network["model"] == "vits14" and network["encoder_weights"] == str(weights)
    assert network["params_live"] == network["params_decoder"] > 0
    assert metrics["run"]["train_steps"] == 8 and metrics["run"]["infer_steps"] > 0
    assert metrics["setup"]["load"]["iterations"] >= 1  # calibrated on this device
    assert metrics["validation_messages"] == []
    saved = load_file(str(tmp_path / "vits14.safetensors"))
    prefix = "encoder." if kind == "safetensors" else ""
    frozen = {k: v for k, v in saved.items() if not k.startswith(("decoder.", "optimizer/"))}
    assert len(frozen) > 10 and set(frozen) <= {prefix + k for k in tensors}
    for name, value in frozen.items():  # frozen: exactly the file's
        np.testing.assert_array_equal(value, tensors[name.removeprefix(prefix)], err_msg=name)


def test_headless_run_predicting_in_the_training_step(tmp_path):
    """--predict-in-training: no inference job; each training step's forward pass is the
    prediction, of the frame it trained on, and its latency the frame-to-prediction one."""
    metrics, _ = _headless(tmp_path, "pit", frames=8, train_every=1, evaluate=False,
                           predict_in_training=True)
    run = metrics["run"]
    assert "infer_steps" not in run and run["train_steps"] == 8
    assert run["prediction_from"] == "train"
    assert run["prediction_latency_ms_p50"] == run["train_latency_ms_p50"] is not None
    live = metrics["depth_error"]["live_abs_rel"]
    assert [p[2] for p in live] == list(range(8))  # step k predicted before its own update
    assert metrics["validation_messages"] == []


@pytest.mark.parametrize("zero_copy", [True, False], ids=["bind_input", "set_input"])
def test_headless_results_are_bit_identical_across_chunkings(tmp_path, zero_copy):
    """Whatever the schedule, the trainer trains on the frames it was given: with set_input,
    and with the frames bound in GPU memory (xr_demo/samples.py's ring)."""
    from safetensors.numpy import load_file

    results = {}
    for schedule in ("chunks:1", "chunks:3", "slack"):
        name = schedule.replace(":", "")
        metrics, _ = _headless(tmp_path, name, frames=12, infer_every=0, schedule=schedule,
                               evaluate=False, zero_copy=zero_copy)
        assert metrics["run"]["train_steps"] == 6
        assert metrics["validating"] == VALIDATING
        assert metrics["validation_messages"] == []
        results[schedule] = (metrics, load_file(str(tmp_path / f"{name}.safetensors")))
    assert results["chunks:3"][0]["setup"]["train"]["pieces"] == 3
    assert results["slack"][0]["setup"]["train"]["pieces"] > 1  # really cut by the slack
    # A level longer than a slack piece's size runs as workgroup ranges in several pieces,
    # none of them longer than the slack.
    setup = results["slack"][0]["setup"]
    print("slack run:", setup)
    assert setup["train"]["piece_ms_max"] <= setup["slack_ms"]
    assert setup["train"]["levels_cut"] >= 1 \
        or setup["train"]["level_ms_max"] <= setup["slack_ms"] * SLACK_PIECE
    reference = results["chunks:1"][1]
    for schedule, (_, state) in results.items():
        assert state.keys() == reference.keys()
        for k in reference:
            np.testing.assert_array_equal(state[k], reference[k], err_msg=f"{schedule}: {k}")


def test_gpu_depth_panel_draws_what_session_read_gives(tmp_path):
    """The panel pass (xr_demo/panel.py) colour-maps the renderer's true depth and the bound
    prediction image on the GPU: equal, to a unit of colour rounding, to depth_picture of the
    renderer's read-back and of session.read; black before the first prediction; a newer
    frame changes the true depth and leaves the last prediction in place."""
    import vulkan as vk

    from xr_demo.app import Demo, Options
    from xr_demo.colormap import depth_picture
    from xr_demo.panel import DepthPanel
    from xr_demo.renderer import SceneRenderer
    from xr_demo.scene import Scene
    from xr_demo.vkhost import VulkanHost

    r = 32
    host = VulkanHost.create()
    renderer = SceneRenderer(host, r, r, Scene.build(3))
    demo = panel = None
    cb, fence = host.command_buffers(1)[0], host.fence()
    try:
        demo = Demo(host, Options(resolution=r, train_every=0, seed=3, out=str(tmp_path)),
                    renderer, log=lambda line: None)
        panel = DepthPanel(host, r)

        def drawn() -> np.ndarray:
            host.run_now(cb, fence, lambda c: panel.record(c, renderer.depth, demo.drawable))
            return panel.read_now(cb, fence).astype(int)

        def close_to(got: np.ndarray, metres: np.ndarray) -> None:
            np.testing.assert_allclose(got, depth_picture(metres).astype(int), atol=1, rtol=0)

        rgb, depth = demo.render_now(101)
        before = drawn()
        close_to(before[:, :r], depth)
        assert (before[:, r:] == 0).all(), "no prediction yet: the prediction half is black"
        predicted = demo.predict_now(rgb)  # session.read of the step, in metres
        shown = drawn()
        close_to(shown[:, :r], depth)
        close_to(shown[:, r:], predicted)
        assert len(np.unique(shown[:, r:].reshape(-1, 3), axis=0)) > 5
        _, later = demo.render_now(917)
        assert np.abs(later - depth).max() > 1.0
        after = drawn()
        close_to(after[:, :r], later)
        np.testing.assert_array_equal(after[:, r:], shown[:, r:])
        assert list(host.messages) == []
    finally:
        for part in (panel, demo, renderer):
            if part is not None:
                part.close()
        vk.vkDestroyFence(host.device, fence, None)
        host.close()


# ---- a window under Xvfb --------------------------------------------------------------------

def _xvfb():
    """Start Xvfb on a free display; (process, ':N')."""
    if shutil.which("Xvfb") is None:
        pytest.skip("Xvfb is not installed (make's set-up installs the apt package xvfb)")
    read, write = os.pipe()
    proc = subprocess.Popen(["Xvfb", "-displayfd", str(write), "-screen", "0", "800x300x24",
                             "-nolisten", "tcp"], pass_fds=(write,),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(write)
    with os.fdopen(read) as f:
        number = f.readline().strip()
    if not number:
        proc.kill()
        pytest.fail("Xvfb did not report a display")
    return proc, f":{number}"


@pytest.mark.parametrize("path", ["bind_input", "set_input"])
def test_window_opens_presents_and_closes_under_xvfb(tmp_path, path):
    """The window shows the scene and the depth panel: drawn on the GPU from the bound
    images (bind_input), or made on the host (--set-input); either way every panel pixel is a
    colour of the depth map. On the GPU the last prediction finished is on screen; the host's
    panel shows one a frame after it is harvested (black before), which the 16 frames of
    lavapipe may not reach."""
    pytest.importorskip("glfw", reason="the demo extra (glfw) is not installed")
    xvfb, display = _xvfb()
    try:
        shot = tmp_path / "shot.png"
        run = subprocess.run(
            [sys.executable, "-m", "xr_demo", "--window", "--resolution", "32",
             "--window-scale", "8", "--frames", "16", "--infer-every", "4", "--no-eval",
             "--out", str(tmp_path / "out"), "--screenshot", str(shot)]
            + (["--set-input"] if path == "set_input" else []),
            cwd=REPO, capture_output=True, text=True, timeout=600,
            env=subprocess_env(DISPLAY=display))
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    finally:
        xvfb.terminate()
        xvfb.wait(timeout=10)
    metrics = json.loads((tmp_path / "out" / "metrics_window.json").read_text())
    assert metrics["presented"] == 16
    assert metrics["validating"] == VALIDATING
    assert metrics["validation_messages"] == []
    from PIL import Image

    screen = np.asarray(Image.open(shot).convert("RGB"))
    window = screen[:256, :768]  # 3 panels of 32 x 8 pixels: the window at the origin
    assert window.std() > 10 and len(np.unique(window.reshape(-1, 3), axis=0)) > 50, \
        "the screenshot is blank"
    sky = window[8, 8]
    assert sky[2] > sky[0], f"expected sky blue in the scene panel's top left, got {sky}"
    from xr_demo.colormap import turbo

    scale = turbo(np.linspace(0.0, 1.0, 4097)).astype(int)
    for name, x0 in (("true depth", 256), ("prediction", 512)):
        maybe_none = name == "prediction" and path == "set_input"
        if maybe_none:
            scale = np.concatenate([scale, [[0, 0, 0]]])
        centres = window[4::8, x0 + 4:x0 + 256:8].reshape(-1, 1, 3).astype(int)
        off_scale = np.abs(centres - scale[None]).max(-1).min(-1)
        assert off_scale.max() <= 1, f"{name} panel: colours off the depth scale"
        assert maybe_none or len(np.unique(centres.reshape(-1, 3), axis=0)) > 5, \
            f"{name} panel is flat"
    if path == "bind_input":  # the drawn prediction is session.read's, colour-mapped
        from xr_demo.colormap import depth_picture

        panels = np.load(tmp_path / "out" / "panels.npz")
        assert "read_0" in panels, "the prediction drawn has no record"
        np.testing.assert_allclose(panels["drawn_0"][:, 32:].astype(int),
                                   depth_picture(panels["read_0"]).astype(int), atol=1, rtol=0)


# ---- OpenXR against Monado ------------------------------------------------------------------

def _monado_root() -> Path:
    out = subprocess.run([str(REPO / "tools" / "monado_chroot.sh"), "root"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def test_xr_session_against_monado(tmp_path):
    pytest.importorskip("xr", reason="the demo extra (pyopenxr) is not installed")
    root = _monado_root()
    if not (root / ".vkml-ready").exists():
        status = Path(str(root) + ".status")
        why = status.read_text().strip() if status.exists() else "never provisioned"
        pytest.skip(f"no Monado chroot at {root} ({why}); `make monado` provisions it")
    if os.geteuid() != 0:
        pytest.skip("running the XR session needs root (chroot and mounts)")
    out = tmp_path / "xr"
    env = subprocess_env(VKML_VENV_PYTHON=sys.executable)
    run = subprocess.run([str(REPO / "tools" / "monado_chroot.sh"), "run-xr", str(out),
                          "--resolution", "32", "--frames", "24", "--xr-size", "128",
                          "--infer-every", "4", "--no-eval"],
                         capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    metrics = json.loads((out / "metrics_xr.json").read_text())
    assert "Monado" in metrics["runtime"]
    assert metrics["reached_focused"], metrics["session_states"]
    assert metrics["frames_rendered"] == 24
    assert metrics["train_steps_done"] >= 1 and metrics["predictions"] >= 1
    assert metrics["run"]["train_steps"] >= 1
    if VALIDATING:  # the layer ran inside the chroot too, with the host's messenger on it
        assert metrics["validating"]
    assert metrics["validation_messages"] == []
    # Both eyes fed the model in turn, and each eye's panel, drawn on the GPU, shows its own
    # latest prediction as session.read gave it (to a unit of colour rounding).
    from xr_demo.colormap import depth_picture

    assert all(count >= 1 for count in metrics["eye_predictions"]), metrics["eye_predictions"]
    left, right = metrics["eye_shows_frame"]
    assert left != right
    panels = np.load(out / "panels.npz")
    for eye in range(2):
        assert f"read_{eye}" in panels, f"eye {eye}: its prediction's frame has no record"
        predicted = depth_picture(panels[f"read_{eye}"]).astype(int)
        drawn = panels[f"drawn_{eye}"][:, 32:].astype(int)
        np.testing.assert_allclose(drawn, predicted, atol=1, rtol=0, err_msg=f"eye {eye}")
    assert np.abs(panels["read_0"] - panels["read_1"]).max() > 0.1  # two predictions


def test_window_without_a_display_is_one_clear_line(monkeypatch, capsys):
    """`--window` where no display can be opened ends with one line naming the cause and exit
    status 2, not a traceback."""
    from xr_demo.__main__ import main as demo_main
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    assert demo_main(["--window", "--frames", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m xr_demo: ") and "display" in err[-1]
    assert not any(line.startswith("Traceback") for line in err)


def test_strip_has_the_depth_scale_under_its_depth_panels():
    """The strip ends in a colour bar from FAR (the depth pictures' background colour) to NEAR,
    under the two depth panels."""
    from xr_demo.colormap import NEAR, depth_picture
    from xr_demo.outputs import colour_bar
    from xr_demo.scene import FAR
    bar = np.asarray(colour_bar(120))
    far, near = depth_picture(np.array([[FAR, NEAR]], np.float32))[0]
    assert np.array_equal(bar[0, 0], far) and np.array_equal(bar[0, -1], near)
    assert (bar[-10:] < 128).any()  # the tick labels under it


def test_plot_draws_only_this_runs_losses_and_leaves_idle_frames_as_gaps(tmp_path):
    from xr_demo.app import FrameStat, RunLog
    from xr_demo.outputs import loss_points, write_plot
    frames = [FrameStat(n, n / 72, 10.0, None, 1, 0.0 if n % 3 else 2.0, None, 0)
              for n in range(1, 9)]
    run = RunLog(frames=frames, losses=[(1, 2, 0.5), (2, 5, 0.25), (3, 900, 0.01)])
    assert loss_points(run) == [(2 / 72, 0.5), (5 / 72, 0.25)]  # frame 900: the comparison's
    write_plot(str(tmp_path / "plot.png"), run, 72, "test")
    assert (tmp_path / "plot.png").stat().st_size > 0
