"""RESULTS.md from what run_on_gpu.sh left in its results directory (stdout; stdlib only).

    python summarize.py RESULTS_DIR > RESULTS_DIR/RESULTS.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PEERS = ("torch", "torch_smooth", "liger", "liger_smooth")


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _ms(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def timing_table(bench: dict) -> list:
    bw = bench["copy_bandwidth_bytes_per_s"]
    lines = [
        f"Device {bench['device']}, torch {bench['torch']}, triton {bench['triton']}, "
        f"liger-kernel {bench.get('liger', 'missing: ' + str(bench.get('liger_error')))}; "
        f"device-to-device copy {bw / 1e12:.2f} TB/s (read + write). One training step "
        "(loss + d logits), int64 labels, medians of `triton.testing.do_bench` with the L2 "
        "flushed, in ms; GB/s = the floor's bytes / time; x floor = time / floor time.",
        "",
        "| N x C | dtype | floor | ours | GB/s | x floor | ours eps=.1 | torch | torch eps=.1 "
        "| liger | liger eps=.1 | ours / torch | ours / liger | plan (gradient kernel) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in bench["rows"]:
        plan = r["ours_plan"][1]
        ours = r["ours_ms"]
        gbs = r["floor_bytes"] / (ours * 1e-3) / 1e9
        def ratio(peer, r=r, ours=ours):
            return "-" if r.get(peer + "_ms") is None else f"{ours / r[peer + '_ms']:.2f}"
        lines.append(
            f"| {r['n']} x {r['c']} | {r['dtype']} | {r['floor_ms']:.3f} | {ours:.3f} | "
            f"{gbs:.0f} | {ours / r['floor_ms']:.2f} | {_ms(r.get('ours_smooth_ms'))} | "
            f"{_ms(r.get('torch_ms'))} | {_ms(r.get('torch_smooth_ms'))} | "
            f"{_ms(r.get('liger_ms'))} | {_ms(r.get('liger_smooth_ms'))} | {ratio('torch')} | "
            f"{ratio('liger')} | {plan['kernel'].replace('tfmo_custom_loss_', '')} "
            f"{plan['grid'][0]}x{plan['grid'][1]} x {plan['threads']} threads, "
            f"{plan['threads_per_row']}/row |")
    lines += ["", "Device time alone (the summed durations of each step's kernels, launch gaps "
              "left out; mean of 20 steps, L2 flushed before each), ms; ours split into its "
              "forward and gradient kernels:", "",
              "| N x C | dtype | floor | ours | = forward + gradient | x floor | ours eps=.1 | "
              "torch | torch eps=.1 | liger | liger eps=.1 | ours / torch | ours / liger |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in bench["rows"]:
        k = lambda key: (r.get(key + "_kernel") or {}).get("total_ms")  # noqa: E731
        ours_k = r.get("ours_kernel") or {}
        if not ours_k.get("total_ms"):
            lines.append(f"| {r['n']} x {r['c']} | {r['dtype']} | no profile: "
                         f"{ours_k.get('error', 'not measured')} |")
            continue
        fwd = sum(v for name, v in ours_k["kernels"].items() if "forward" in name)
        grad = sum(v for name, v in ours_k["kernels"].items() if "gradient" in name)
        def ratio(peer, k=k, total=ours_k["total_ms"]):
            return "-" if not k(peer) else f"{total / k(peer):.2f}"
        lines.append(
            f"| {r['n']} x {r['c']} | {r['dtype']} | {r['floor_ms']:.3f} | "
            f"{ours_k['total_ms']:.3f} | {fwd:.3f} + {grad:.3f} | "
            f"{ours_k['total_ms'] / r['floor_ms']:.2f} | {_ms(k('ours_smooth'))} | "
            f"{_ms(k('torch'))} | {_ms(k('torch_smooth'))} | {_ms(k('liger'))} | "
            f"{_ms(k('liger_smooth'))} | {ratio('torch')} | {ratio('liger')} |")
    lines += ["", "Ours three ways (gpu_bench.py): old = forward + gradient without row "
              "statistics (the kernels before them); stats = the forward writes row_stats, the "
              "gradient reads them (per-example losses); reduced = the forward alone writes "
              "the mean's gradient (reduced losses, Keras). Wall-clock ms, then device time "
              "(kernels alone) ms; x floor and / torch, / liger for the faster new one; "
              "reduced / eps 0: the reduced step against the same step without smoothing:", "",
              "| N x C | dtype | eps | old | stats | reduced | old (kernels) | stats (kernels) "
              "| reduced (kernels) | best x floor | best / torch | best / liger "
              "| reduced / eps 0 |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in bench["rows"]:
        plain_reduced = r.get("ours_reduced_ms")
        for eps, base, peer in (("0", "ours", ""), (".1", "ours_smooth", "_smooth")):
            wall = [r.get(base + m + "_ms") for m in ("", "_stats", "_reduced")]
            kern = [(r.get(base + m + "_kernel") or {}).get("total_ms")
                    for m in ("", "_stats", "_reduced")]
            new = [v for v in wall[1:] if v is not None]
            best = min(new) if new else None
            def rel(peer_key, best=best, r=r):
                other = r.get(peer_key + "_ms")
                return "-" if best is None or other is None else f"{best / other:.2f}"
            lines.append(
                f"| {r['n']} x {r['c']} | {r['dtype']} | {eps} | "
                + " | ".join(_ms(v) for v in wall + kern) + " | "
                + ("-" if best is None else f"{best / r['floor_ms']:.2f}") + " | "
                + f"{rel('torch' + peer)} | {rel('liger' + peer)} | "
                + ("-" if wall[2] is None or plain_reduced is None
                   else f"{wall[2] / plain_reduced:.2f}") + " |")
    lines += ["", "Peers relative to the floor (wall-clock time / floor time):", "",
              "| N x C | dtype | torch | torch eps=.1 | liger | liger eps=.1 |",
              "|---|---|---|---|---|---|"]
    for r in bench["rows"]:
        cells = [("-" if r.get(p + "_ms") is None else f"{r[p + '_ms'] / r['floor_ms']:.2f}")
                 for p in PEERS]
        lines.append(f"| {r['n']} x {r['c']} | {r['dtype']} | " + " | ".join(cells) + " |")
    lines += ["", "Ours against float64 torch on the timed inputs (max relative loss error; max "
              "gradient error relative to the largest gradient element):", "",
              "| N x C | dtype | path | loss | grad | loss eps=.1 | grad eps=.1 |",
              "|---|---|---|---|---|---|---|"]
    for r in bench["rows"]:
        for path, m in (("old", ""), ("stats", "_stats"), ("reduced", "_reduced")):
            cells = [r.get(f"ours{s}{m}_{e}") for s in ("", "_smooth")
                     for e in ("loss_max_rel_err", "grad_max_err_rel_to_max")]
            lines.append(f"| {r['n']} x {r['c']} | {r['dtype']} | {path} | "
                         + " | ".join("-" if v is None else f"{v:.1e}" for v in cells) + " |")
    errors = [f"{r['n']}x{r['c']} {r['dtype']} {k}: {v}" for r in bench["rows"]
              for k, v in r.items() if k.endswith("_error")]
    if errors:
        lines += ["", "Errors:"] + [f"- {e}" for e in errors]
    if bench.get("sweep"):
        lines += ["", "Threadgroup size on this GPU (float32, eps=0; PlanLaunch under a lowered "
                  "maxTotalThreadsPerThreadgroup, or the other variant forced), ms:", "",
                  "| N x C | gradient kernel's plan | stats ms (wall) | stats ms (kernels) | "
                  "reduced ms (wall) | reduced ms (kernels) |",
                  "|---|---|---|---|---|---|"]
        nan = float("nan")
        for s in bench["sweep"]:
            p = s["plan"]
            lines.append(f"| {s['n']} x {s['c']} | {p['kernel'].split('_')[4]} "
                         f"{p['threads']} threads, {p['threads_per_row']}/row, "
                         f"{p['rows_per_threadgroup']} rows/threadgroup | {s['ms']:.3f} | "
                         f"{s.get('kernel_ms', nan):.3f} | {s.get('reduced_ms', nan):.3f} | "
                         f"{s.get('reduced_kernel_ms', nan):.3f} |")
    return lines


def main(root: Path) -> int:
    lines = ["# The Metal kernels on an NVIDIA GPU (tests/msl_cuda/run_on_gpu.sh)", ""]
    env = _read(root / "env.txt").strip()
    lines += ["```", env, "```", ""]
    kernels = _read(root / "kernels.txt").strip().splitlines()
    # Less run_on_gpu.sh's own closing line, which says "warnings: N" itself.
    nvrtc = "\n".join(line for line in _read(root / "nvrtc_log.txt").splitlines()
                      if not line.startswith("== NVRTC compiled"))
    lines += [f"NVRTC: {kernels[-1] if kernels else 'no kernels'} compiled from the unchanged "
              f"kernels/custom_loss.metal; {nvrtc.count('warning')} warnings; "
              f"{nvrtc.count('bytes spill stores') - nvrtc.count(' 0 bytes spill stores')} "
              "kernels with spills. Registers per kernel:", "", "```"]
    lines += kernels[:-1] + ["```", "", "## Correctness", "", "```"]
    lines += _read(root / "correctness.txt").strip().splitlines()[-12:] + ["```", ""]
    lines += ["## compute-sanitizer (the same matrix; outputs re-checked after each tool)", "",
              "```"] + _read(root / "sanitizers.txt").strip().splitlines() + ["```", ""]
    lines += ["## Nsight Compute (forward, then gradient kernel, as planned; clocks left alone)",
              "", "```"] + _read(root / "profile.txt").strip().splitlines() + ["```", ""]
    bench_path = root / "bench.json"
    lines += ["## Timing", ""]
    if bench_path.exists():
        lines += timing_table(json.loads(bench_path.read_text()))
    else:
        lines.append("no bench.json: the timing step did not finish")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
