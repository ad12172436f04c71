"""Whether the kit's compiled modules can raise their errors on this machine: each case calls the distill module
with bad arguments in a process of its own and reports whether a RuntimeError came back or the process died.

    python tools/check_module_errors.py            # the CPU module, and the CUDA module where a GPU is visible

On a machine whose compiler builds extensions that cannot raise (the lent GPU machines' CC/CXX did, before the
loader left such compilers out: kernels/NOTES.md, "Reliability"), a formatted message kills the process
(return code -11) while a plain one raises. Every line should read "raised".
"""
import subprocess
import sys

import torch

CASES = {
    "cpu": {
        "formatted message (the statistics' shape)": "m.distill_combine(torch.zeros(1, 1, 2), 0)",
        "plain message (the loss's scale)": "m.distill_combine(torch.zeros(1, 1, 3), 2, None)",
    },
    "cuda": {
        "formatted message, CPU tensors (check_device)": "m.distill_combine(torch.zeros(1, 1, 4), 0)",
        "formatted message (the statistics' shape)": "m.distill_combine(torch.zeros(1, 1, 2, device='cuda'), 0)",
        "plain message (the loss's scale)": "m.distill_combine(torch.zeros(1, 1, 3, device='cuda'), 2, None)",
    },
}


def main() -> int:
    backends = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    failures = 0
    for backend in backends:
        # built once here (a build's own output is not mixed into the cases' lines)
        subprocess.run([sys.executable, "-c", f"import kldiv_inline as K; K.load('{backend}', extension='distill')"],
                       check=True)
        for name, stmt in CASES[backend].items():
            code = (f"import torch, kldiv_inline as K\nm = K.load('{backend}', extension='distill')\ntry:\n    {stmt}\n"
                    "except RuntimeError as e:\n    print('raised:', str(e).splitlines()[0][:70])")
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            ok = r.returncode == 0 and r.stdout.startswith("raised:")
            failures += not ok
            print(f"{backend:4}  {name}: " + (r.stdout.strip() if ok else f"DIED (return code {r.returncode})"),
                  flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
