"""The SM clock and power of the current GPU while a function runs, sampled by nvidia-smi every 50 ms: a card at
its power limit lowers its clock under back-to-back work, which a timing taken in a short burst does not see.
Shared by tools/matmul_clocks.py and tools/profile_fused_head.py."""
import subprocess
import time

import torch


def sampled(fn):
    """fn() while nvidia-smi samples: (fn's result, sorted SM clocks in MHz, sorted power draws in W). The lists
    are empty where nvidia-smi is missing or gives no readings."""
    try:
        smi = subprocess.Popen(["nvidia-smi", f"--id={torch.cuda.current_device()}",
                                "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"],
                               stdout=subprocess.PIPE, text=True)
    except OSError:
        smi = None
    time.sleep(0.2)  # nvidia-smi's first sample lands before fn starts
    try:
        out = fn()
        torch.cuda.synchronize()
    finally:
        if smi is not None:
            smi.terminate()
    if smi is None:
        return out, [], []
    rows = [line.split(",") for line in smi.communicate()[0].splitlines() if line.count(",") == 1]
    rows = [(float(c), float(w)) for c, w in rows if "N/A" not in c + w]
    return out, sorted(c for c, _ in rows), sorted(w for _, w in rows)


def median(xs):
    return xs[len(xs) // 2] if xs else float("nan")
