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


RESULTS = README.parent / "tools" / "results"
CITING = (README, README.parent / "tools" / "KERNELS.md")
RUN = r"[a-z_]+-2026\d{4}(?:-[\w*]+)*"  # a result's name: what, date, then which run
SHORTHAND = r"`(?:\.\.\.)?(-[\w-]+)(?:\.\w+)?`"  # `-010332`, `-final`, `...-plans-after`


def cited_runs() -> set[str]:
    """The result names README.md and tools/KERNELS.md cite, as written: `a-{b,c}` expanded,
    and a shorthand beside a full name (`bench-20261202-010246` against `-010332`, `...-before`
    and `-final`) completed from the full name before it (its last parts replaced)."""
    names: set[str] = set()
    for doc in CITING:
        text = re.sub(r"-\n\s*", "-", doc.read_text())  # a name cut at a hyphen by the wrap
        text = re.sub(r"\{([^{}`]*)\}", lambda m: "{" + re.sub(r"\s+", "", m[1]) + "}", text)
        last = timed = None  # the latest full name, and the latest with a time of day
        for m in re.finditer(SHORTHAND + r"|(?<![\w-])(" + RUN + r")(\{[\w,-]+\}[\w-]*)?", text):
            if m[2]:
                last = m[2]
                timed = last if re.match(r"[a-z_]+-2026\d{4}-\d{6}", last) else timed
                tails = m[3][1:].split("}") if m[3] else None
                names.update([last] if tails is None else
                             [last + alt + tails[1] for alt in tails[0].split(",")])
            elif re.fullmatch(r"-\d{6}", m[1]) and timed is not None:  # another time that day
                names.add("-".join(timed.split("-")[:2]) + m[1])
            elif last is not None:  # another end of the same name
                short = m[1].split("-")[1:]
                names.add("-".join(last.split("-")[:-len(short)] + short))
    return names


def is_cited(stem: str, names: set[str]) -> bool:
    """Cited as itself, as a run's start that names more than its date and machine
    (`bench-20261202-010246` for `bench-20261202-010246-full-vulkan`), or by a glob."""
    for name in names:
        if "*" in name:
            if re.fullmatch(re.escape(name).replace(r"\*", ".*"), stem):
                return True
        elif stem == name or (stem.startswith(name + "-")
                              and not re.fullmatch(r"[a-z_]+-2026\d{4}(-h200)?", name)):
            return True
    return False


def test_results_folder_keeps_only_what_the_docs_cite():
    """tools/results/ holds the runs README.md and tools/KERNELS.md cite, and nothing else (new
    runs go to out/results/, which git ignores)."""
    names = cited_runs()
    uncited = sorted(p.name for p in RESULTS.iterdir() if not is_cited(p.name.split(".")[0], names))
    assert not uncited, f"not cited by {[p.name for p in CITING]}: {uncited}"


def test_results_the_docs_name_exist():
    paths = re.findall(r"tools/results/([\w.{},-]+[\w}])", "\n".join(p.read_text() for p in CITING))
    assert paths
    for path in paths:
        stem, _, exts = path.partition(".")
        for ext in exts.strip("{}").split(",") if exts else [""]:
            name = f"{stem}.{ext}" if ext else stem
            assert (RESULTS / name).is_file() or list(RESULTS.glob(name + ".*")), name
