"""The demo's pieces on a small budget: the shapes dataset, the MLP builder, training to
well above chance, the figure, and the CLI's handling of a missing device."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import vkml
from vkml.__main__ import main
from vkml.demo import (
    SHAPE_CLASSES,
    build_classifier,
    make_shapes,
    predict,
    save_figure,
    train_epoch,
)
from vkml.errors import GraphError
from vkml.models import mlp


def test_shapes_are_deterministic_balanced_and_normalised():
    x, y = make_shapes(120, seed=3, size=12)
    assert x.shape == (120, 144) and x.dtype == np.float32
    assert y.shape == (120,) and y.dtype == np.int32
    assert np.bincount(y, minlength=len(SHAPE_CLASSES)).tolist() == [20] * 6
    np.testing.assert_allclose(x.mean(axis=1), 0.0, atol=1e-5)
    np.testing.assert_allclose(x.std(axis=1), 1.0, atol=1e-3)
    x2, y2 = make_shapes(120, seed=3, size=12)
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    x3, _ = make_shapes(120, seed=4, size=12)
    assert not np.allclose(x, x3)


def test_shapes_are_not_linearly_trivial():
    # A least-squares linear classifier should do much better than chance but not perfectly,
    # or the demo's MLP would prove nothing.
    x, y = make_shapes(3000, seed=0, size=12)
    xt, yt = make_shapes(600, seed=1, size=12)
    w = np.linalg.lstsq(np.c_[x, np.ones(len(x))], np.eye(6)[y], rcond=None)[0]
    accuracy = (np.c_[xt, np.ones(len(xt))] @ w).argmax(1) == yt
    assert 0.35 < accuracy.mean() < 0.9


def test_mlp_names_layers_like_pytorch():
    g = vkml.Graph()
    logits = mlp(g, g.input("x", (4, 10)), (10, 7, 5, 3))
    assert logits.shape == (4, 3)
    assert list(g.params) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
                              "fc3.weight", "fc3.bias"]
    assert g.params["fc2.weight"].shape == (5, 7)
    with pytest.raises(GraphError, match="features"):
        mlp(g, g.input("y", (4, 9)), (10, 3))
    with pytest.raises(GraphError, match="activation"):
        mlp(g, g.input("z", (4, 10)), (10, 3), activation="swish")


def test_training_beats_chance(device):
    # 8x8 images and narrow layers keep every kernel small: lavapipe compiles quickly.
    x, y = make_shapes(1600, seed=0, size=8)
    xt, yt = make_shapes(320, seed=1, size=8)
    session = build_classifier(32, (64, 32, 6), seed=0, device=device, lr=1e-2)
    rng = np.random.default_rng(0)
    losses: list[float] = []
    for _ in range(4):  # 200 steps
        losses += train_epoch(session, x, y, rng)[0]
    assert np.all(np.isfinite(losses))
    assert np.mean(losses[-20:]) < 0.7 * np.mean(losses[:20])
    accuracy = (predict(session, xt) == yt).mean()  # 320 = 10 batches: no padding
    assert accuracy > 0.6, f"test accuracy {accuracy:.2f} (chance 0.17)"
    assert (predict(session, xt[:50]) == predict(session, xt)[:50]).all()  # padded batch
    session.close()


def test_demo_figure(tmp_path):
    pytest.importorskip("matplotlib", reason="the demo's figure is drawn with matplotlib")
    x, y = make_shapes(40, seed=0, size=16)
    preds = y.copy()
    preds[:3] = (preds[:3] + 1) % 6
    losses = list(np.linspace(1.8, 0.2, 30))
    path = tmp_path / "figure.png"
    assert save_figure(str(path), losses, 10, x, y, preds, 16, "TITLE")
    from matplotlib.image import imread

    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 400 and image.shape[1] > 400
    red = (np.abs(image[..., :3] - np.array([210, 40, 40]) / 255) < 0.02).all(axis=2)
    assert red.any()  # mistakes framed red


def test_demo_without_matplotlib_writes_no_figure(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    x, y = make_shapes(8, seed=0, size=8)
    assert not save_figure(str(tmp_path / "f.png"), [1.0, 0.5], 1, x, y, y, 8, "T")
    assert not list(tmp_path.iterdir())


def test_cli_reports_missing_device_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("VKML_DEVICE", "no such device")
    assert main(["demo", "--epochs", "1", "--train", "64", "--test", "64",
                 "--device", "no such device"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m vkml demo: ") and "no Vulkan device matches" in err
    assert "Traceback" not in err
