"""What every bench section shares: measuring a step in a child process of its own.

A step's peak memory is only comparable between cases when each case starts from a fresh
process, so the sections run their cases as `python -m tf_metal_ops.tools.bench FLAG ...` and
read back the one JSON line the child prints.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Dict, Optional, Sequence, Tuple


def status_kib(field: str) -> Optional[int]:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM), or None where there is none."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Linux: writing 5 to clear_refs resets the peak resident size (VmHWM) to the current."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def run_child(arguments: Sequence[str]) -> Tuple[Dict[str, Any], str]:
    """Runs `python -m tf_metal_ops.tools.bench ARGUMENTS` in a fresh process; returns the last
    JSON line it printed and "", or {} and the last line of its stderr where it failed."""
    completed = subprocess.run([sys.executable, "-m", "tf_metal_ops.tools.bench", *arguments],
                               capture_output=True, text=True, check=False)
    lines = [l for l in completed.stdout.splitlines() if l.startswith("{")]
    if completed.returncode != 0 or not lines:
        return {}, (completed.stderr.strip().splitlines() or ["no output"])[-1]
    return json.loads(lines[-1]), ""
