"""The README's example is part of the contract: it must run as printed."""

from __future__ import annotations

import re
from pathlib import Path

import vkml
import vkml.runtime.device

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no python example"
    code = blocks[0].replace("/tmp/mlp.safetensors", str(tmp_path / "mlp.safetensors"))
    exec(compile(code, str(README), "exec"), {})
    out = capsys.readouterr().out
    assert "loss" in out
    device = vkml.runtime.device.default_device()
    assert device.backend.validation_messages == []


def test_readme_lists_every_public_graph_method():
    """Each op registers its Graph method beside it (vkml/ops/); the README's API table must
    name every one, so a new op cannot stay undocumented."""
    api = README.read_text().split("## The API", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", api))
    missing = sorted(n for n in dir(vkml.Graph) if not n.startswith("_") and n not in named)
    assert not missing, f"README's API table does not mention Graph methods {missing}"
