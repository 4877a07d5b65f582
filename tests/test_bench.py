"""Smoke test of tools/bench.py: one tiny workload through the whole tool, in a subprocess as a
user runs it (on lavapipe here, PyTorch on the CPU): the JSON, markdown and chart are written,
vkml's strict rows pass PROTOCOL.md's gates against float64 PyTorch, and rows that cannot run
here (CUDA graphs, accelerated mode) say why instead of vanishing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import subprocess_env

REPO = Path(__file__).resolve().parent.parent


def run_bench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """tools/bench.py --tiny with `args`, writing into tmp_path, as a user runs it."""
    cmd = [sys.executable, str(REPO / "tools" / "bench.py"), "--tiny", *args,
           "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_bench_tiny_smollm2(tmp_path):
    proc = run_bench(tmp_path, "--only", "smollm2", "--reps", "2", "--warmup", "1", "--matmul",
                     "--matmul-sizes", "32", "--torch-engines", "eager,graphs",
                     "--torch-autocast", "none")
    (json_path,) = tmp_path.glob("bench-*-tiny-vulkan.json")
    assert json_path.with_suffix(".md").read_text().count("| smollm2 |") == 4
    assert json_path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(json_path.read_text())
    assert data["meta"]["config"] == "tiny" and data["meta"]["vkml_commit"]

    rows = {(r["phase"], r["mode"], r["engine"]): r for r in data["rows"]}
    assert len(rows) == 2 * 2 * 3  # phases x modes x (vkml, eager, graphs)
    for phase in ("train", "infer"):
        vk = rows[phase, "strict", "vkml"]
        assert vk["status"] == "ok", vk
        assert vk["gates"]["pass"], vk["gates"]
        assert vk["gates"]["forward_rel_l2"]["loss"] < 1e-4  # f32 against float64
        assert ("grad_total_norm_error" in vk["gates"]) == (phase == "train")
        assert vk["n"] == 2 and 0 < vk["min_ms"] <= vk["median_ms"]
        assert vk["gpu_ms"]["n"] == 2 and vk["gpu_ms"]["source"]
        assert vk["memory"]["physical_bytes"] > 0
        assert vk["compile"]["cold_s"] > 0 and vk["compile"]["warm_s"] > 0
        eager = rows[phase, "strict", "torch-eager"]
        assert eager["status"] == "ok" and eager["gates"]["pass"], eager
        graphs = rows[phase, "strict", "torch-graphs"]
        assert graphs["status"] == "skipped" and "CUDA" in graphs["reason"]
        for engine in ("vkml", "torch-eager", "torch-graphs"):
            row = rows[phase, "accelerated", engine]
            assert row["status"] == "ok" or row["reason"], row

    matmul = {(r["engine"], r["precision"]): r for r in data["matmul"]}
    assert matmul["vkml", "f32"]["status"] == "ok"
    assert matmul["vkml", "f32"]["rel_err"] < 1e-5
    assert matmul["torch (CPU)", "tf32"]["reason"]
    assert {r["workload"] for r in data["ratios"]} == {"smollm2"}
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| 32 |")  # summary printed last


def test_bench_compile_and_library_twins(tmp_path):
    # torch.compile's rows and the Hugging Face / torchvision twins (tools/bench_hf.py) beside
    # the plain references, with the same weights: their gates against float64 pass. aot_eager
    # compiles in seconds on a CPU (inductor takes minutes); the CUDA-graph capture and
    # autocast rows need CUDA and say so here.
    run_bench(tmp_path, "--only", "whisper_encoder", "--phases", "train", "--reps", "1",
              "--warmup", "0", "--compile", "none", "--torch-engines", "all",
              "--torch-compile-backend", "aot_eager")
    (json_path,) = tmp_path.glob("bench-*-tiny-vulkan.json")
    data = json.loads(json_path.read_text())
    rows = {(r["mode"], r["engine"]): r for r in data["rows"]}
    engines = ["torch-eager", "torch-graphs", "torch-compile", "hf-eager", "hf-graphs",
               "hf-compile"]
    assert {e for m, e in rows if m == "strict"} == {"vkml", *engines}
    assert {e for m, e in rows if m == "accelerated"} == {
        "vkml", *engines, *(f"{e}+bf16" for e in engines)}
    for engine in ("torch-compile", "hf-eager", "hf-compile"):
        row = rows["strict", engine]
        assert row["status"] == "ok", row
        assert row["gates"]["pass"] and "grad_total_norm_error" in row["gates"], row
    for engine in ("torch-compile", "hf-compile"):
        row = rows["strict", engine]
        assert row["compile_s"] > 0 and row["compile_backend"] == "aot_eager"
        assert row["cuda_graph"] is False  # no CUDA here: compiled, not captured
    assert rows["strict", "hf-graphs"]["status"] == "skipped"
    for (mode, engine), row in rows.items():
        if mode == "accelerated" and engine != "vkml":
            assert row["status"] == "not available" and "CUDA" in row["reason"], row
    ratios = {r["mode"]: r for r in data["ratios"]}["strict"]
    vk = rows["strict", "vkml"]["median_ms"]
    assert ratios["vkml/hf-compile"] == vk / rows["strict", "hf-compile"]["median_ms"]
    text = json_path.with_suffix(".md").read_text()
    assert "## Every PyTorch row" in text and "| whisper_encoder | train | strict | hf-compile |" \
        in text


def test_bench_compare_puts_runs_side_by_side(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "tools"))
    import bench_compare

    old, new = (REPO / "tools" / "results" / f"bench-20261201-{t}-full-vulkan.json"
                for t in ("224429", "225654"))
    out = tmp_path / "compare.md"
    assert bench_compare.main([str(old), str(new), "--out", str(out)]) == 0
    text = out.read_text()
    assert text == capsys.readouterr().out
    rows = {}
    for path in (old, new):
        for r in json.loads(path.read_text())["rows"]:
            if r["status"] == "ok":
                rows.setdefault((r["workload"], r["phase"], r["mode"], r["engine"]), []).append(r)
    (a, b), (ga, gb) = rows["smollm2", "train", "strict", "vkml"], \
        rows["smollm2", "train", "strict", "torch-graphs"]
    cell = (f"{b['median_ms']:.3g} ({b['median_ms'] / a['median_ms'] - 1:+.1%}; "
            f"{b['median_ms'] / b['min_ms'] - 1:.0%}; "
            f"{gb['median_ms'] / ga['median_ms'] - 1:+.1%})")
    assert f"| smollm2 | train | strict | {a['median_ms']:.3g} (" in text and cell in text
    assert text.count("| 4096 | vkml | f32 |") == 1
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="not a bench result"):
        bench_compare.main([str(old), str(bad)])


def test_kernel_lab_times_a_tiling_by_name():
    # tools/kernel_lab.py --tilings takes any tiling by its name, listed in gemm or not, and
    # checks its result against float64, with forced split counts and with the operands in
    # memory as f16 too; a name that is not a tiling stops it with the forms
    lab = [sys.executable, str(REPO / "tools" / "kernel_lab.py"), "--quick", "--reps", "1",
           "--cases", "wide nn"]
    proc = subprocess.run([*lab, "--tilings", "s64x32k8r8x4", "--splits", "1,2",
                           "--f16-operands"], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for row in ("s64x32k8r8x4 /1", "s64x32k8r8x4 /2", "s64x32k8r8x4:f16mem /1"):
        assert row in proc.stdout, row  # not in gemm.STAGED (its 64 x 32 is 16 deep)
    proc = subprocess.run([*lab, "--tilings", "s64x32k8r6x4"], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "s<BM>x<BN>k<BK>r<TM>x<TN>" in proc.stderr, proc.stderr


def test_redraw_makes_a_saved_runs_markdown_and_chart_again(tmp_path):
    # tools/results/ keeps a run's JSON and markdown; its chart is made again from the JSON.
    sys.path.insert(0, str(REPO / "tools"))
    import bench

    run = REPO / "tools" / "results" / "bench-20261202-190407-full-vulkan.json"
    assert bench.main(["--redraw", str(run), "--out-dir", str(tmp_path)]) == 0
    markdown = run.with_suffix(".md")
    assert (tmp_path / markdown.name).read_text() == markdown.read_text()
    assert (tmp_path / run.with_suffix(".png").name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_session_order_times_each_session_here_and_alone(tmp_path):
    # tools/bench.py --session-order: f32 train, f16 train, f16 infer, f32 infer one after
    # another on one device, each beside the same session alone in a fresh process. lavapipe
    # has no cooperative matrices: its f16 sessions say so, and the f32 ones still run.
    run_bench(tmp_path, "--only", "smollm2", "--session-order", "--reps", "1", "--warmup", "0",
              "--session-warmup-s", "0.05")
    (json_path,) = tmp_path.glob("bench-*-tiny-vulkan-sessions.json")
    data = json.loads(json_path.read_text())
    assert not data["rows"]
    order = [(e["phase"], e["precision"]) for e in data["session_order"]]
    assert order == [("train", "f32"), ("train", "f16"), ("infer", "f16"), ("infer", "f32")]
    for e in data["session_order"]:
        if e["precision"] == "f16" and e["status"] != "ok":
            assert "cooperative matri" in e["reason"], e
            continue
        assert e["status"] == "ok", e
        here, alone = e["in_process"], e["fresh_process"]
        assert alone["status"] == "ok", alone
        assert e["ratio"] == here["median_ms"] / alone["median_ms"]
        assert e["slower"] == (e["ratio"] > 1.2)
        assert np.isfinite(here["loss"]) and e["loss_rel_diff"] < 1e-5, e
        assert here["gpu_ms"]["n"] == 1 and alone["gpu_ms"]["median"] > 0
        # its first steps timed apart from the steady ones, the loss read after the first
        assert here["first_steps"]["median_ms"] > 0 and len(here["first_steps"]["wall_ms"]) == 1
        assert set(here["clocks_sm"]) == {"before_first_step", "after_steady_steps"}
        # the bench holds no other session: the close left no buffer behind
        assert here["device_after_close"]["live"]["buffers"] == 0
        assert here["device_after_close"]["live"] == here["device_before"]["live"]
    text = json_path.with_suffix(".md").read_text()
    assert "## Sessions one after another in one process" in text
    assert text.count("| smollm2 |") == 4


def test_ncnn_bench_runs_both_engines_on_one_model(tmp_path):
    # tools/ncnn_bench.py: pnnx converts a tiny zoo model to ncnn's format; ncnn (Vulkan, and
    # the CPU) and vkml's import of the same module run it, each checked against float64
    pytest.importorskip("ncnn", reason="tools/ncnn_bench.py needs `pip install vkml[bench]`")
    pytest.importorskip("pnnx", reason="tools/ncnn_bench.py needs `pip install vkml[bench]`")
    cmd = [sys.executable, str(REPO / "tools" / "ncnn_bench.py"), "--tiny", "--models",
           "squeezenet1_1", "--cpu", "--reps", "2", "--warmup", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "ncnn_bench-tiny.json").read_text())
    rows = {(r["engine"], r["variant"]): r for r in data["rows"]}
    assert rows["pnnx", "convert"]["status"] == "ok" and rows["pnnx", "convert"]["convert_s"] > 0
    for key in [("ncnn", "vulkan fp32"), ("ncnn", "cpu fp32"), ("vkml", "f32")]:
        row = rows[key]
        assert row["status"] == "ok", row
        assert row["rel_l2"] < 1e-4 and row["pass"], row  # f32 against float64
        assert row["n"] == 2 and 0 < row["min_ms"] <= row["median_ms"]
    assert rows["ncnn", "vulkan fp32"]["options"]["use_fp16_storage"] is False
    fp16 = rows["ncnn", "vulkan fp16"]
    assert fp16["status"] == "ok" and fp16["pass"], fp16
    assert rows["vkml", "f16"]["status"] == "ok" or rows["vkml", "f16"]["reason"]
    text = (tmp_path / "ncnn_bench-tiny.md").read_text()
    assert text.count("| squeezenet1_1 |") == 5


def test_kernel_lab_channels_last_checks_every_variant_against_float64(tmp_path):
    # tools/kernel_lab.py --channels-last: a convolution of the tiny ResNet in every variant the
    # device runs, each checked against float64 torch, into one table and one JSON; cooperative
    # variants say they were not measured where the device has none
    lab = [sys.executable, str(REPO / "tools" / "kernel_lab.py"), "--channels-last", "--quick",
           "--reps", "1", "--cases", "32x4x4 -> 16 1x1", "--out", str(tmp_path)]
    proc = subprocess.run(lab, cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "channels_last.json").read_text())["rows"]
    variants = {r["variant"] for r in rows}
    assert {"f32", "chlast"} <= variants and all(r["err"] < r["limit"] for r in rows), rows
    table = (tmp_path / "channels_last.txt").read_text()
    assert "chlast" in table
    chlast = next(r for r in rows if r["variant"] == "chlast")
    assert chlast["copies_ms"] > 0, chlast  # the copies ran and were timed apart
    if "coop-nchw" not in variants:
        assert "NOT MEASURED HERE: no cooperative matrices" in table
