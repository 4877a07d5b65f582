"""`python -m vkml dump` prints every stage of what a script compiles, and explain() summarises."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import vkml
from vkml import dump, session
from vkml.__main__ import main

SCRIPT = """
import vkml
g = vkml.Graph()
x = g.input("x", (4, 6))
y = g.input("y", (4,), "i32")
loss = g.cross_entropy(vkml.nn.Linear(g, "fc", 6, 3)(x).relu(), y)
model = vkml.compile(g, loss=loss, optimizer=vkml.SGD())
raise SystemExit("dump must stop the script at vkml.compile")
"""

EXPECTED = {
    "graph": ["= param()  # fc.weight", "= log_softmax(", "grad of"],
    "rewritten": ["fused_matmul(", "fused_sum(", "epilogue={"],
    "split": ["fused_matmul(", "# train.py:"],
    "plan": ["-- barrier --", "[update  ] sgd_update_24", "# update fc.bias .. fc.weight (2)",
             "arena 0",
             # the loss gradient's seed, of constants alone: computed once, not every step
             "(and 1 in the prologue)", "prologue: 1 dispatches", "step:", " hoisted "],
    "memory": ["pinned", "levels", "bytes allocated"],
    "wgsl": ["// ---- kernel fused_matmul", "@compute @workgroup_size"],
    "spirv": ["bytes of SPIR-V"],
}


def test_every_stage_is_checked_and_in_the_readme():
    assert set(EXPECTED) == set(dump.STAGES)
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    listed = re.search(r"python -m vkml dump --stage ([\w|]+)", readme)
    assert listed and listed.group(1).split("|") == list(dump.STAGES)


@pytest.mark.parametrize("stage", EXPECTED)
def test_dump_prints_each_stage(stage, tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    assert main(["dump", "--stage", stage, "--out", str(tmp_path / "out"), str(script)]) == 0
    text = capsys.readouterr().out
    for marker in EXPECTED[stage]:
        assert marker in text, (stage, marker)
    written = list((tmp_path / "out").iterdir())
    if stage == "spirv":
        assert written and all(p.read_bytes()[:4] == b"\x03\x02\x23\x07" for p in written)
    else:
        assert written


def test_capture_stops_at_compile_and_leaves_vkml_compile_alone(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("vkml.SGD()", "vkml.SGD(), rewrite='none'"))
    call = dump.capture(str(script), [])
    assert call.options.rewrite == "none" and isinstance(call.options.optimizer, vkml.SGD)
    assert vkml.compile is session.compile  # nothing was replaced, nothing left behind
    assert not session._stopping_at_compile.get()


def test_sources_name_the_demos_code_not_runpy(capsys):
    # vkml's own demo, run as a module: every caller is vkml's, so the ops' sources name the
    # model's lines rather than the interpreter's runpy.
    assert main(["dump", "--stage", "graph", "vkml", "demo", "--train", "64", "--test", "64"]) == 0
    text = capsys.readouterr().out
    assert "runpy" not in text and "# mlp.py:" in text, text


def test_dump_of_a_script_that_never_compiles(tmp_path):
    script = tmp_path / "nothing.py"
    script.write_text("x = 1\n")
    with pytest.raises(Exception, match="without calling vkml.compile"):
        main(["dump", str(script)])
