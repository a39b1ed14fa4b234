"""Benchmark: the sandbox's start-up cost, what every tool call and code reward pays.

    python -m benchmarks.sandbox_latency [--runs 100] [--concurrency 1,8,32]

Runs ``print(1)`` (and a trivial ``python -c pass`` outside the sandbox for reference) many
times: the difference is the price of bubblewrap's namespaces, the tmpfs mounts, the cgroups,
setpriv and prlimit. Writes results/sandbox_latency.json and .png.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.common import figure, machine_info, save_figure, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--concurrency", default="1,8,32")
    args = ap.parse_args()
    from hybrid_rl.rewards.sandbox import Sandbox, SandboxLimits

    sb = Sandbox(SandboxLimits())
    bare = []
    for _ in range(20):
        t = time.perf_counter()
        subprocess.run(["/usr/bin/python3", "-c", "print(1)"], capture_output=True, check=True)
        bare.append(time.perf_counter() - t)
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):

        def one(_):
            t = time.perf_counter()
            r = sb.run("print(1)")
            assert r.stdout.strip() == "1", r
            return time.perf_counter() - t

        sb.run("print(1)")  # warm-up
        start = time.perf_counter()
        with ThreadPoolExecutor(c) as ex:
            lat = list(ex.map(one, range(args.runs)))
        wall = time.perf_counter() - start
        lat.sort()
        rows.append(
            {
                "concurrency": c,
                "median_s": statistics.median(lat),
                "p90_s": lat[int(0.9 * len(lat))],
                "runs_per_s": args.runs / wall,
            }
        )
        print(
            f"concurrency {c:3d}: median {rows[-1]['median_s'] * 1e3:.0f} ms, p90 {rows[-1]['p90_s'] * 1e3:.0f} ms, {rows[-1]['runs_per_s']:.1f} runs/s",
            flush=True,
        )
    bare_med = statistics.median(bare)
    print(f"plain python3 -c (no sandbox): median {bare_med * 1e3:.0f} ms")
    path = write_json(
        "sandbox_latency",
        {
            "benchmark": "sandbox_latency",
            "machine": machine_info(),
            "settings": vars(args),
            "rows": rows,
            "bare_python_median_s": bare_med,
            "executable": sys.executable,
        },
    )

    fig, ax = figure((5, 3.2))
    ax.bar([str(r["concurrency"]) for r in rows], [r["median_s"] * 1e3 for r in rows], label="sandboxed print(1), median")
    ax.axhline(bare_med * 1e3, color="k", ls="--", lw=1, label="python3 -c, no sandbox")
    ax.set_xlabel("concurrent calls")
    ax.set_ylabel("ms per call")
    ax.legend(fontsize=8)
    print(f"wrote {path} and {save_figure(fig, 'sandbox_latency')}")


if __name__ == "__main__":
    main()
