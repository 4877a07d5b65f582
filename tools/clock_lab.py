"""Lab: why a session's first steps run slower than its later ones, step by step beside the GPU's
SM clock.

    PYTHONPATH=. python tools/clock_lab.py [--tiny] [--seconds 0.8] [--out-dir DIR]

On one vkml.Device, SmolLM2 sessions are compiled and stepped one after another (f32 training,
f16 training, f16 inference, f32 inference: tools/bench.py's --session-order), each for
`--seconds`, every step's wall time logged (`step(); wait()`); then the same inference session
again three ways: after the GPU sat idle for `--idle` seconds, right after another session kept
it busy, and interleaved with that other session. Meanwhile `nvidia-smi` samples the SM clock
every 20 ms where there is one (read-only: nothing is set). What it showed on the H200: a
compile leaves the GPU idle long enough for its clock to drop from 1980 to 345 MHz, and every
session's first 0.15-0.4 s run 3-4x slower until the clock is back up, whichever session came
before and whatever its precision; a session stepped right after the GPU was busy is fast from
its first step. Benchmarks therefore warm up by time (tools/bench.py WARMUP_S).

Writes clock_lab-<date>-<device>.json, .md (the table) and .png (step times above, the clock
below, on one time axis).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vkml  # noqa: E402
from vkml.models import smollm2  # noqa: E402

TINY = smollm2.SmolLM2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=32, seq=16)
ORDER = (("f32", "train"), ("f16", "train"), ("f16", "infer"), ("f32", "infer"))
# A step this close to the session's steady median counts as recovered.
RECOVERED = 1.15


class ClockSampler:
    """nvidia-smi's SM clock every 20 ms on a thread, stamped with this process's clock."""

    def __init__(self, t0: float) -> None:
        self.samples: list[tuple[float, float]] = []
        self.t0 = t0
        try:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits",
                 "-lms", "20"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.samples.append((time.perf_counter() - self.t0, float(line.split()[0])))
            except (ValueError, IndexError):
                continue

    def at(self, t: float) -> float | None:
        """The latest sample at or before `t`."""
        before = [mhz for ts, mhz in self.samples if ts <= t]
        return before[-1] if before else None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()


class Lab:
    def __init__(self, tiny: bool, seconds: float) -> None:
        self.t0 = time.perf_counter()
        self.clock = ClockSampler(self.t0)
        self.device = vkml.Device()
        self.config = TINY if tiny else smollm2.SmolLM2Config()
        self.seconds = seconds
        self.phases: list[dict[str, Any]] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def compile(self, precision: str, phase: str) -> Any:
        b = smollm2.build(self.config)
        kw: dict[str, Any] = ({"loss": b.loss, "optimizer": vkml.Adam(lr=1e-4),
                               "outputs": b.outputs} if phase == "train"
                              else {"outputs": {**b.outputs, "loss": b.loss}})
        session = vkml.compile(b.graph, device=self.device, precision=precision, **kw)
        for name, value in b.sample_inputs(np.random.default_rng(0)).items():
            session.set_input(name, value)
        return session

    def steps(self, session: Any, seconds: float) -> list[tuple[float, float]]:
        """(start time, wall ms) of each `step(); wait()` for `seconds`."""
        out = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = self.now()
            session.step()
            session.wait()
            out.append((t, (self.now() - t) * 1e3))
        return out

    def record(self, label: str, steps: list[tuple[float, float]]) -> None:
        self.phases.append({"label": label, "steps": steps})
        print(f"[{self.now():6.2f} s] {label}: {summarise(steps, self.clock)['text']}",
              flush=True)

    def run(self, idle: float) -> None:
        sessions = {}
        for precision, phase in ORDER:
            s = sessions[precision, phase] = self.compile(precision, phase)
            self.record(f"{precision} {phase}, just compiled", self.steps(s, self.seconds))
        infer, other = sessions["f32", "infer"], sessions["f16", "infer"]
        time.sleep(idle)
        self.record(f"f32 infer again, after {idle:g} s idle", self.steps(infer, self.seconds))
        time.sleep(idle)
        self.steps(other, 0.5)
        self.record("f32 infer again, right after f16 infer kept the GPU busy 0.5 s",
                    self.steps(infer, self.seconds))
        for s in sessions.values():
            s.close()

    def close(self) -> None:
        self.clock.stop()
        self.device.close()


def summarise(steps: list[tuple[float, float]], clock: ClockSampler) -> dict[str, Any]:
    ms = [m for _, m in steps]
    half = ms[len(ms) // 2:]
    steady = statistics.median(half)
    start = steps[0][0]
    slow = [t - start for t, m in steps if m > RECOVERED * steady]
    first = [m for t, m in steps if t - start < 0.1]
    out = {"steps": len(ms), "first_0.1s_median_ms": statistics.median(first),
           "steady_median_ms": steady, "slow_until_s": max(slow, default=0.0),
           "sm_mhz_at_start": clock.at(start), "sm_mhz_at_end": clock.at(steps[-1][0])}
    mhz = (f", SM {out['sm_mhz_at_start']:.0f} -> {out['sm_mhz_at_end']:.0f} MHz"
           if out["sm_mhz_at_start"] is not None and out["sm_mhz_at_end"] is not None else "")
    out["text"] = (f"first 0.1 s {out['first_0.1s_median_ms']:.2f} ms, steady {steady:.2f} ms, "
                   f"slower than {RECOVERED}x steady until {out['slow_until_s']:.2f} s{mhz}")
    return out


def plot(lab: Lab, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(11, 6),
                                      height_ratios=(3, 1.4))
    for p in lab.phases:
        t, ms = zip(*p["steps"])
        top.plot(t, ms, ".", ms=3, label=p["label"])
    top.set_yscale("log")
    top.set_ylabel("step + wait, ms (log)")
    top.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    top.set_title(f"{lab.device.name}: step times of sessions one after another, "
                  "and the GPU's SM clock")
    if lab.clock.samples:
        t, mhz = zip(*lab.clock.samples)
        bottom.plot(t, mhz, "-", lw=1, color="black")
    else:
        bottom.text(0.5, 0.5, "no nvidia-smi on this machine", ha="center",
                    transform=bottom.transAxes)
    bottom.set_ylabel("SM clock, MHz")
    bottom.set_xlabel("seconds since the lab started (gaps: compiles, idle)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a one-layer SmolLM2 (CPU drivers)")
    ap.add_argument("--seconds", type=float, default=0.8, help="of steps a phase")
    ap.add_argument("--idle", type=float, default=1.0, help="seconds the GPU idles before "
                    "the idle phase")
    ap.add_argument("--out-dir", default="out/results")
    args = ap.parse_args()
    lab = Lab(args.tiny, args.seconds)
    try:
        lab.run(args.idle)
        name = lab.device.name
    finally:
        lab.close()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")[:24]
    stem = out / f"clock_lab-{time.strftime('%Y%m%d')}-{slug}{'-tiny' if args.tiny else ''}"
    rows = [{"label": p["label"], **summarise(p["steps"], lab.clock)} for p in lab.phases]
    stem.with_suffix(".json").write_text(json.dumps(
        {"device": name, "config": "tiny" if args.tiny else "full", "phases": lab.phases,
         "summary": rows, "sm_clock_samples": lab.clock.samples}, indent=1) + "\n")
    lines = [f"# Step times and the SM clock, {name} (`tools/clock_lab.py"
             f"{' --tiny' if args.tiny else ''}`)", "",
             "| phase | steps | first 0.1 s median ms | steady median ms | slow until s | "
             "SM MHz at start -> end |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        mhz = ("-" if r["sm_mhz_at_start"] is None else
               f"{r['sm_mhz_at_start']:.0f} -> {r['sm_mhz_at_end']:.0f}")
        lines.append(f"| {r['label']} | {r['steps']} | {r['first_0.1s_median_ms']:.3g} | "
                     f"{r['steady_median_ms']:.3g} | {r['slow_until_s']:.2f} | {mhz} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    drew = plot(lab, stem.with_suffix(".png"))
    print("\n".join(lines[2:]))
    print(f"wrote {stem}.json, .md{', .png' if drew else ''}")


if __name__ == "__main__":
    main()
