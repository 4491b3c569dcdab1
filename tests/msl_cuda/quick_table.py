"""The figures a QUICK=1 probe of run_on_gpu.sh needs, from its bench.json: wall-clock ms of ours
(old, reduced, reduced with smoothing) against Liger, the copy floor, and the device time of each
kernel of ours' old path (forward, then gradient).

    python3 quick_table.py RESULTS_DIR/bench.json
"""

import json
import sys


def main(path: str) -> None:
    data = json.load(open(path))
    print("N x C dtype | floor | old | reduced | x floor | red eps.1 | liger | liger eps.1 | "
          "old kernels (ms)")
    for r in data["rows"]:
        kernels = r.get("ours_kernel", {}).get("kernels", {})
        names = " ".join(f"{k.split('custom_loss_')[-1].split('<')[0]}={v:.3f}"
                         for k, v in kernels.items() if "custom_loss_" in k)
        print(f"{r['n']} x {r['c']} {r['dtype']} | {r['floor_ms']:.3f} | {r['ours_ms']:.3f} | "
              f"{r['ours_reduced_ms']:.3f} | {r['ours_reduced_ms'] / r['floor_ms']:.2f} | "
              f"{r['ours_smooth_reduced_ms']:.3f} | {r.get('liger_ms', float('nan')):.3f} | "
              f"{r.get('liger_smooth_ms', float('nan')):.3f} | {names}")


if __name__ == "__main__":
    main(sys.argv[1])
