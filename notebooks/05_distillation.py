# %% [markdown]
# # 5. Distillation from logits: checked against float64, timed against the peers
#
# `kldiv_inline.generalized_jsd` computes the divergence between a student's and a teacher's
# softmax(logits / T) token by token: forward KL (`beta = 0`), reverse KL (`beta = 1`) and the generalized
# Jensen-Shannon divergence in between (TRL's convention), with label masks and served top-k teachers, in one
# kernel that reads each logit once and writes the student's gradient in the forward pass. This notebook:
#
# 1. computes it beside TRL's PyTorch loss and the float64 reference;
# 2. shows why it sums every divergence in a non-negative form (where student and teacher nearly agree);
# 3. checks gradients and a top-k teacher;
# 4. times it against the peers with the kit's harness (`kldiv_inline.bench_distill`, what
#    `python -m kldiv_inline bench` runs), and reads the committed results of this device;
# 5. shows the LM head fused in (`fused_linear_generalized_jsd`), where logits never exist whole;
# 6. splits the vocabulary across processes (`group=`): the phases in one process, then two under torchrun.
#
# Without a GPU everything runs on the CPU twin at small sizes: the same code path, not a performance claim.

# %% tags=["parameters"]
# Parameters: the only cell to edit. FULL: the sizes of a GPU study; without a GPU a quick CPU run.
# KLDIV_NB_FULL=1 or 0 in the environment overrides the default either way.
import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FULL = os.environ.get("KLDIV_NB_FULL", "1" if DEVICE == "cuda" else "0") == "1"
REPS = 10 if FULL else 3  # timed calls per provider and case

# %%
import sys
from pathlib import Path

ROOT = Path.cwd().resolve().parent  # this notebook runs in <repo>/notebooks
if (ROOT / "kldiv_inline").is_dir() and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the kit straight from the checkout

import matplotlib.pyplot as plt
import pandas as pd

import kldiv_inline as K
from kldiv_inline import bench_distill, floors, plots
from kldiv_inline.peers import trl_generalized_jsd
from kldiv_inline.reference import generalized_jsd_reference, relative_error

# %matplotlib inline

print(f"device {DEVICE}, FULL={FULL}, torch {torch.__version__}")

# %% [markdown]
# ## 1. One call, three ways
#
# Student and teacher logits of 6 x 3 tokens over a vocabulary of 5000, temperature 2, a quarter of the tokens
# masked (label -100). The kit's loss, TRL's PyTorch loss (float32 log_softmax, `kl_div` with
# `log_target=True`) and the float64 reference, for each beta.

# %%
torch.manual_seed(0)
student = (torch.randn(6, 3, 5000) * 2).to(DEVICE)
teacher = (torch.randn(6, 3, 5000) * 2).to(DEVICE)
labels = torch.randint(0, 5000, (6, 3), device=DEVICE)
labels[torch.rand(6, 3, device=DEVICE) < 0.25] = -100
rows = []
for beta in (0.0, 0.3, 0.5, 1.0):
    ours = K.generalized_jsd(student, teacher, beta=beta, temperature=2.0, labels=labels)
    trl = trl_generalized_jsd(student, teacher, labels, beta=beta, temperature=2.0)
    ref = generalized_jsd_reference(student, teacher, beta=beta, temperature=2.0, labels=labels)
    rows.append({"beta": beta, "ours": float(ours), "trl": float(trl), "float64": float(ref),
                 "ours rel err": relative_error(ours, ref), "trl rel err": relative_error(trl, ref)})
pd.DataFrame(rows)

# %% [markdown]
# ## 2. Never negative where the distributions agree
#
# A divergence is never negative, but its plain sum `p (log p - log q)` cancels when student and teacher
# nearly agree: in float32 the rounding of terms of size `|u|` swamps a total of size `u^2 / 2`. The kit sums
# `q f(u)`, `f(u) = u e^u - expm1(u) >= 0`, term by term (a series where `|u|` is small), so every token's
# loss is `>= 0` and close to float64. Below: per-token forward KL of bf16 logits that nearly agree (float64
# logits 1e-4 apart, each rounded to bf16: most entries round alike). The cell prints how far each sum is
# from float64 and how many of the plain sum's tokens come out negative (a fixed seed: the same count on every
# run on one device); the further apart the logits, the less the plain sum cancels.

# %%
torch.manual_seed(1)
t = torch.randn(256, 32000, dtype=torch.float64, device=DEVICE) * 2
s = (t + torch.randn_like(t) * 1e-4).to(torch.bfloat16)
t = t.to(torch.bfloat16)
ref = generalized_jsd_reference(s, t, reduction="none")
ours = K.generalized_jsd(s, t, reduction="none")
sf, tf = torch.log_softmax(s.float(), -1), torch.log_softmax(t.float(), -1)
plain = (tf.exp() * (tf - sf)).sum(-1)  # the plain float32 sum, as the peers compute it
print(f"float64 per-token KL: {ref.min():.2e} .. {ref.max():.2e}")
print(f"ours:  min {ours.min():.2e}, relative error {relative_error(ours, ref):.1e}")
print(f"plain: min {plain.min():.2e}, relative error {relative_error(plain, ref):.1e}, "
      f"{int((plain < 0).sum())} of 256 tokens negative")
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.scatter(ref.cpu(), (plain.double() - ref).cpu(), s=6, label="plain float32 sum")
ax.scatter(ref.cpu(), (ours.double() - ref).cpu(), s=6, label="kldiv_inline")
ax.axhline(0, color="k", lw=0.8)
ax.set_xlabel("per-token KL (float64)")
ax.set_ylabel("error against float64")
ax.legend()
plt.show()

# %% [markdown]
# ## 3. Gradients, and a served top-k teacher
#
# The forward pass writes d loss / d logits when they require grad; backward only rescales. Against float64
# autograd of the reference, for the student and (self-distillation) the teacher. Then a teacher given as its
# top-100 log-probabilities (what vLLM or SGLang return): the divergence over the 100 tokens and one tail
# bucket, with the student's gradient over its whole vocabulary.

# %%
s = student.clone().requires_grad_()
t = teacher.clone().requires_grad_()
loss = K.generalized_jsd(s, t, beta=0.5, temperature=2.0, labels=labels)
loss.backward()
s64, t64 = student.double().requires_grad_(), teacher.double().requires_grad_()
generalized_jsd_reference(s64, t64, beta=0.5, temperature=2.0, labels=labels).backward()
print(f"student grad rel err {relative_error(s.grad, s64.grad):.1e}, "
      f"teacher grad {relative_error(t.grad, t64.grad):.1e}")

lp, idx = torch.log_softmax(teacher.double() / 2.0, -1).topk(100, dim=-1)
s = student.clone().requires_grad_()
loss = K.generalized_jsd(s, teacher_topk=(idx, lp.float()), temperature=2.0, labels=labels)
loss.backward()
s64 = student.double().requires_grad_()
ref = generalized_jsd_reference(s64, teacher_topk=(idx, lp), temperature=2.0, labels=labels)
ref.backward()
print(f"top-k: loss {loss.item():.6f} (float64 {ref.item():.6f}), grad rel err {relative_error(s.grad, s64.grad):.1e}")

# %% [markdown]
# Gradient accumulation over n micro-batches scales each loss by 1 / n. Divided after the call, `loss / n` reaches
# backward as a grad_output of 1 / n and backward rescales the whole gradient the forward wrote (one more read and
# write of it); given as `loss_scale=1 / n`, the constant is folded into the forward's own scale and backward has
# nothing left to do. The same loss and, up to the gradient's rounding, the same gradient:

# %%
grads = {}
for how in ("divided", "loss_scale"):
    s = student.clone().requires_grad_()
    if how == "divided":
        loss = K.generalized_jsd(s, teacher, temperature=2.0, labels=labels) / 4
    else:
        loss = K.generalized_jsd(s, teacher, temperature=2.0, labels=labels, loss_scale=1 / 4)
    loss.backward()
    grads[how] = s.grad
    print(f"{how:10s} loss {loss.item():.7f}")
print(f"gradients apart by {relative_error(grads['loss_scale'], grads['divided']):.1e} (relative)")

# %% [markdown]
# ## 4. Timed against the peers
#
# `bench_distill.run` is the suite behind the distillation rows of `results/<device>/bench.csv`: bf16 logits
# (4096 x 128256 on a GPU; 64 x 4096 on the CPU), T = 2, 10% masked; forward + backward per beta, forward
# only, and a top-k teacher. Each provider is checked against float64 on the first rows before it is timed.
# Peers: TRL's PyTorch loss eager and under torch.compile, and Liger-Kernel's JSD after `log_softmax`
# (GPU, when installed).

# %%
floor = floors.measure_floor(DEVICE)
rows = bench_distill.run(DEVICE, floor, reps=REPS, betas=(0.0, 0.5) if FULL else (0.0,))
timed = pd.DataFrame(rows)
timed[["impl", "pass", "form", "beta", "median_ms", "x_floor", "peak_mib", "status"]]

# %%
fig = plots.plot_speedups(timed, bench_distill.OURS)
plt.show()

# %% [markdown]
# The committed results for this card: each distillation goal (D1-D6) as the latest committed run measured it,
# from `results/status.md` (which `python -m kldiv_inline plot` writes from every bench.csv under `results/`; the
# run column names the folder, the commit and the date):

# %%
status = ROOT / "results" / "status.md"
card = torch.cuda.get_device_name() if DEVICE == "cuda" else None
lines = status.read_text().splitlines() if status.exists() else []
header = [line for line in lines if line.startswith("| goal |") or line.startswith("| --- |")]
mine = [line for line in lines if line.startswith("| D") and card is not None and f"| {card} |" in line]
if mine:
    print("\n".join(header + mine))
else:
    print(f"no committed distillation goals (D1-D6) for {card or DEVICE}: they are judged on a GPU's cases "
          "(4096 x 128256 bfloat16); `make results` on a GPU writes them, and on the CPU the suite's small rows only")

# %% [markdown]
# ## 5. The LM head fused in
#
# `fused_linear_generalized_jsd(hidden, weight, teacher_hidden, teacher_weight, ...)` makes the logits a chunk
# of tokens at a time (a matrix product into a reused buffer), turns them into d logits in place with the same
# kernel, and accumulates the gradients of the hidden states and the weight: the logits never exist whole.
# Checked here against the divergence of materialised float64 logits.

# %%
torch.manual_seed(2)
h = torch.randn(48, 64, device=DEVICE, requires_grad=True)
w = (torch.randn(3000, 64, device=DEVICE) * 0.2).requires_grad_()
th, tw = torch.randn(48, 64, device=DEVICE), torch.randn(3000, 64, device=DEVICE) * 0.2
loss = K.fused_linear_generalized_jsd(h, w, th, tw, beta=0.5, temperature=2.0, chunk_size=16)
loss.backward()
h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
ref = generalized_jsd_reference(h64 @ w64.T, th.double() @ tw.double().T, beta=0.5, temperature=2.0)
ref.backward()
print(f"loss {loss.item():.6f} (float64 {ref.item():.6f}); grad hidden rel err {relative_error(h.grad, h64.grad):.1e}, "
      f"grad weight {relative_error(w.grad, w64.grad):.1e}")

# %% [markdown]
# Tokens whose label is `ignore_index` (a prompt, padding) add nothing to the loss. With `skip_masked=True` the
# chunks hold only the other tokens, so the matrix products skip the masked ones: the same loss for fewer FLOP,
# at the price of one host synchronisation a call (the count of unmasked tokens sizes the chunks).

# %%
labels = torch.randint(0, 3000, (48,), device=DEVICE)
labels[:24] = -100  # a masked prompt: half the tokens
kw = dict(beta=0.5, temperature=2.0, labels=labels, chunk_size=16)
skipped = K.fused_linear_generalized_jsd(h, w, th, tw, skip_masked=True, **kw)
every = K.fused_linear_generalized_jsd(h, w, th, tw, **kw)
print(f"skip_masked: loss {skipped.item():.6f}, without {every.item():.6f}: products over 24 tokens instead of 48")

# %% [markdown]
# The committed results for this card: each fused-head goal (L1-L4; bf16, 4096 tokens, hidden 4096, vocabulary
# 128256) from `results/status.md`, and, where a sweep ran on such a card (`python -m kldiv_inline bench --suites
# linear --linear-sweep --results results/linear-sweep`), its time and memory of a training step against tokens.

# %%
from IPython.display import Image, display

from kldiv_inline.envinfo import device_slug

mine = [line for line in lines if line.startswith("| L") and card is not None and f"| {card} |" in line]
print("\n".join(header + mine) if mine else f"no committed fused-head results for {card or DEVICE}")
sweep = ROOT / "results" / "linear-sweep" / device_slug(DEVICE) / "linear_time_memory.png"
if sweep.exists():
    display(Image(filename=str(sweep)))


# %% [markdown]
# ## 6. The vocabulary split across processes
#
# With `group=` (a `torch.distributed` process group) each rank holds a contiguous slice of every token's
# logits, as Megatron-LM's column-parallel head leaves them. Only a few floats per token cross the group: each
# rank finds its slice's normalisers (phase 0), the ranks gather and combine them, each rank sums its slice's
# terms (phase 1), the ranks gather those sums, and where the gradient needs the row sums, each rank writes its
# slice's gradient (phase 2). Here the same kernels run in one process over three slices of each row, combined
# as the ranks combine them, against the one-device call:

# %%
torch.manual_seed(3)
s = torch.randn(6, 1000, device=DEVICE) * 2
t = torch.randn(6, 1000, device=DEVICE) * 2
labels = torch.tensor([1, 2, -100, 4, 5, 6], device=DEVICE)
beta, T = 0.5, 2.0
mod = K.load(DEVICE, extension="distill")
common = (labels, -100, beta, T)
slices = [(s[:, a:b], t[:, a:b]) for a, b in ((0, 400), (400, 750), (750, 1000))]
# each slice's normalisers, gathered ([ranks, rows, 4]) and combined in slice order as every rank combines them
norms = mod.distill_combine(torch.stack([mod.distill_phase(0, a, b, *common, None, None, None, False, False)[0]
                                         for a, b in slices]), 0)[0]
scale = torch.ones((), dtype=torch.float64, device=DEVICE)  # reduction "sum": the gradient of the rows' sum
parts = [mod.distill_phase(1, a, b, *common, norms, None, scale, True, False) for a, b in slices]
# each slice's (loss, ks, kt) per row, gathered and added in slice order: the rows' K sums and the summed loss
# (float32 on a GPU; float64 on the CPU, whose rows' sums are double: phase 2 then rounds the K sums once, as one
# process rounds its own, so the split's K sums are the one-device call's)
ksums, loss = mod.distill_combine(torch.stack([p[0] for p in parts]), 1, scale)
grad = torch.cat([mod.distill_phase(2, a, b, *common, norms, ksums, scale, True, False)[1] for a, b in slices], dim=1)
leaf = s.clone().requires_grad_()
whole = K.generalized_jsd(leaf, t, beta=beta, temperature=T, labels=labels, reduction="sum")
whole.backward()
print(f"split over 3 slices: loss {loss.item():.6f}, one device {whole.item():.6f}; "
      f"gradient rel err {relative_error(grad, leaf.grad):.1e}")
assert relative_error(loss, whole.detach()) < 1e-5 and relative_error(grad, leaf.grad) < 1e-4

# %% [markdown]
# Over real processes: `tools/bench_vocab_parallel.py` under `torchrun` checks each provider (the kit on one
# device, the kit split over the ranks, a Megatron-style PyTorch peer) against float64 and times it; on the CPU
# at a toy size with gloo (a smoke run, no performance claim), on a machine with two GPUs at the goals' size
# (`NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --standalone --nproc-per-node 2
# tools/bench_vocab_parallel.py`, minutes after the build, results in `results/<device>-x2/`).

# %%
import subprocess  # noqa: E402
import tempfile  # noqa: E402

two_gpus = DEVICE == "cuda" and torch.cuda.device_count() >= 2 and FULL
size = [] if two_gpus else ["--device", "cpu", "--tokens", "24", "--vocab", "301", "--hidden", "8", "--reps", "2",
                            "--warmup", "1"]
out = Path(tempfile.mkdtemp()) / "bench.csv"
env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo", "NCCL_NVLS_ENABLE": "0",
       "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       str(ROOT / "tools" / "bench_vocab_parallel.py"), *size, "--out", str(out)],
                      env=env, capture_output=True, text=True)
if proc.returncode:
    raise RuntimeError(f"bench_vocab_parallel failed:\n{proc.stdout[-2500:]}{proc.stderr[-2500:]}")
print(proc.stdout[-2500:])

# %% [markdown]
# The committed two-GPU results of this kind of device, with their goals (V1-V2), if there are any:

# %%
from kldiv_inline.envinfo import device_slug  # noqa: E402

folder_x2 = ROOT / "results" / f"{device_slug(DEVICE)}-x2"
print((folder_x2 / "goals.md").read_text() if (folder_x2 / "goals.md").exists()
      else f"no committed two-GPU results for {DEVICE} ({folder_x2.name})")

