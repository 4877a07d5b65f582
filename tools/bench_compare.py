"""Compare runs of tools/bench.py: every row's vkml median in each result file and its change
against the first file, beside two yardsticks of noise: how far that run's median sat above its
fastest step ("spread"), and how far PyTorch in CUDA graphs moved in the same row, whose code did
not change between the runs (it shows what the machine alone did). In the H200 runs of
tools/KERNELS.md v7 graphs moved under 2% while vkml's spread reached 15% on the U-Net.

    python tools/bench_compare.py tools/results/bench-A.json tools/results/bench-B.json [...]
    python tools/bench_compare.py A.json B.json --out compare.md   # also written there

The one n^3 matmul rows follow, as TFLOP/s per run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

GRAPHS = "torch-graphs"


def load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"{path}: not a bench result ({exc}); give the .json files that "
                         "tools/bench.py writes") from None
    if not {"meta", "rows"} <= data.keys():
        raise SystemExit(f"{path}: not a bench result (no 'meta' and 'rows'); give the .json "
                         "files that tools/bench.py writes")
    return data


def medians(data: dict[str, Any]) -> dict[tuple[str, str, str, str], tuple[float, float]]:
    """(workload, phase, mode, engine) -> (median, min) ms of the rows that ran."""
    return {(r["workload"], r["phase"], r["mode"], r["engine"]): (r["median_ms"], r["min_ms"])
            for r in data["rows"] if r.get("status") == "ok"}


def change(new: tuple[float, float] | None, old: tuple[float, float] | None) -> float | None:
    return None if new is None or old is None else new[0] / old[0] - 1


def compare(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Markdown lines: the runs, the rows' table, the matmul table."""
    times = [medians(data) for _, data in runs]
    rows = sorted({key[:3] for t in times for key in t if key[3] == "vkml"})
    lines = ["| run | file | date | GPU | vkml | note |", "| --- " * 6 + "|"]
    for i, (name, data) in enumerate(runs):
        m = data["meta"]
        lines.append(f"| {i} | {name} | {m.get('date', '')[:19]} | {m.get('gpu', '')} | "
                     f"{str(m.get('vkml_commit', ''))[:12]} | {m.get('note', '')} |")
    head = ["workload", "phase", "mode", *[f"run {i}: vkml ms (change; spread; graphs change)"
                                          for i in range(len(runs))]]
    lines += ["", "| " + " | ".join(head) + " |", "| --- " * len(head) + "|"]
    for row in rows:
        first = times[0].get((*row, "vkml"))
        cells = list(row)
        for t in times:
            now = t.get((*row, "vkml"))
            if now is None:
                cells.append("-")
                continue
            c = change(now, first)
            g = change(t.get((*row, GRAPHS)), times[0].get((*row, GRAPHS)))
            parts = [f"{c:+.1%}" if c is not None and t is not times[0] else "",
                     f"{now[0] / now[1] - 1:.0%}",
                     f"{g:+.1%}" if g is not None and t is not times[0] else ""]
            cells.append(f"{now[0]:.3g} ({'; '.join(p for p in parts if p)})")
        lines.append("| " + " | ".join(cells) + " |")
    mm = [{(r["size"], r["engine"], r["precision"]): r.get("tflops")
           for r in data.get("matmul", []) if r.get("status") == "ok"} for _, data in runs]
    keys = sorted({k for m in mm for k in m}, key=lambda k: (k[0], k[1] != "vkml", k[1], k[2]))
    if keys:
        lines += ["", "| n | engine | precision | " + " | ".join(f"run {i} TFLOP/s"
                                                          for i in range(len(runs))) + " |",
                  "| --- " * (3 + len(runs)) + "|"]
        lines += [f"| {n} | {engine} | {precision} | " + " | ".join(
            f"{m[n, engine, precision]:.3g}" if (n, engine, precision) in m else "-"
            for m in mm) + " |" for n, engine, precision in keys]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="bench .json files, oldest first")
    parser.add_argument("--out", type=Path, help="also write the markdown here")
    opts = parser.parse_args(argv)
    if len(opts.results) < 2:
        parser.error("give two result files or more: the first is what the others are "
                     "compared with")
    runs = [(path.name, load(path)) for path in opts.results]
    text = "\n".join(compare(runs)) + "\n"
    sys.stdout.write(text)
    if opts.out:
        opts.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
