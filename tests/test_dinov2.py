"""vkml/models/dinov2.py against transformers' Dinov2Model: a tiny seeded model's safetensors
file (both spellings of its names) loads into the vkml encoder by name, and every hidden state
and the last (normed) one match the float64 module's on an image of another size than the
position table's (the bicubic resize of the table included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import rel_l2
from safetensors.numpy import load_file
from safetensors.torch import save_file

import vkml
from vkml.models import dinov2

transformers = pytest.importorskip("transformers")


def _hf_model(cfg: dinov2.Dinov2Config) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.Dinov2Model(transformers.Dinov2Config(
        hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, mlp_ratio=cfg.mlp_ratio,
        patch_size=cfg.patch_size, image_size=cfg.image_size)).eval()
    with torch.no_grad():  # every tensor away from its initial constant (zero biases, ones)
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("spelling", ["transformers5", "legacy"])
def test_safetensors_file_loads_and_matches_transformers(tmp_path, device, spelling):
    cfg = dinov2.tiny()  # position table for 56 x 56 (4 x 4 patches); the image is 28 x 28
    model = _hf_model(cfg)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if spelling == "legacy":  # the Hub's files: attention.attention.query, ...
        for old, new in dinov2.LEGACY_NAMES:
            state = {k.replace(new, old): v for k, v in state.items()}
    path = tmp_path / "dinov2.safetensors"
    save_file(state, str(path))

    tensors = dinov2.state_dict_names(load_file(str(path)))
    assert dinov2.config_of(tensors, num_heads=cfg.num_attention_heads) == cfg
    g = vkml.Graph(seed=1)
    pixels = g.input("pixel_values", (1, 3, 28, 28))
    hidden = dinov2.dinov2(g, pixels, cfg, trainable=False)
    outputs = {f"hidden_{i}": h for i, h in enumerate(hidden)}
    outputs["last_hidden_state"] = dinov2.final_norm(g, cfg, trainable=False)(hidden[-1])
    assert set(g.params) == set(tensors)  # every name of the file, nothing else
    assert not any(t.attrs["trainable"] for t in g.params.values())
    session = vkml.compile(g, outputs=outputs, device=device)
    for name, value in tensors.items():
        session.set_param(name, value)
    x = np.random.default_rng(0).standard_normal((1, 3, 28, 28)).astype(np.float32)
    session.set_input("pixel_values", x)
    session.step()

    with torch.no_grad():
        ref = model.double()(torch.tensor(x, dtype=torch.float64), output_hidden_states=True)
    expected = {f"hidden_{i}": h for i, h in enumerate(ref.hidden_states)}
    expected["last_hidden_state"] = ref.last_hidden_state
    for name, value in expected.items():
        assert rel_l2(session.read(name), value.numpy()) < 1e-4, name


def test_config_of_refuses_what_is_not_a_dinov2_state_dict():
    with pytest.raises(ValueError, match="embeddings.cls_token"):
        dinov2.config_of({"backbone.embeddings.cls_token": np.zeros((1, 1, 8), np.float32)})
