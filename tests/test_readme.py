"""The README's example is part of the contract: it must run as printed."""

from __future__ import annotations

import re
from pathlib import Path

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
