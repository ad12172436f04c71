"""The README's API snippets run as written on the CPU twin, given inputs of the names they use, and give the
losses their comments promise (against float64 PyTorch). The README's other code has tests of its own: "Your own
kernel" in test_harness.py, the torchrun example in test_vocab_parallel.py. A README edit that renames a call or an
argument fails here rather than in a user's session."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

import kldiv_inline as K
from kldiv_inline.reference import generalized_jsd_reference

ROOT = Path(__file__).resolve().parent.parent


def python_block(first_code_line: str) -> str:
    """The README's python block whose text contains ``first_code_line`` (exactly one such block)."""
    text = (ROOT / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    found = [b for b in blocks if first_code_line in b]
    assert len(found) == 1, (first_code_line, len(found))
    return found[0]


def run(snippet: str, **inputs) -> dict:
    scope = {"K": K, "torch": torch, **inputs}
    exec(compile(snippet, "README.md", "exec"), scope)
    return scope


def close(got, want, rtol=1e-5):
    assert abs(float(got) - float(want)) <= rtol * abs(float(want)), (float(got), float(want))


def test_kl_div_snippet():
    snippet = python_block("loss = K.kl_div(log_probs, target")
    log_probs = torch.log_softmax(torch.randn(16, 300), -1)
    target, probs = torch.softmax(torch.randn(16, 300), -1), torch.softmax(torch.randn(16, 300), -1)
    scope = run(snippet, log_probs=log_probs, target=target, probs=probs)
    close(scope["loss"], F.kl_div(probs.double().log(), target.double(), reduction="batchmean"))
    close(K.kl_div(log_probs, target, reduction="batchmean"),
          F.kl_div(log_probs.double(), target.double(), reduction="batchmean"))
    lt = target.log()
    close(scope["crit"](log_probs, lt),
          F.kl_div(log_probs.double(), lt.double(), reduction="batchmean", log_target=True))


def test_generalized_jsd_snippet():
    snippet = python_block("loss = K.generalized_jsd(student_logits, teacher_logits, beta=0.0")
    s, t = torch.randn(12, 500) * 3, torch.randn(12, 500) * 3
    labels = torch.randint(0, 500, (12,))
    labels[[2, 7]] = -100
    logprobs, indices = torch.log_softmax(t, -1).topk(20, dim=-1)
    scope = run(snippet, student_logits=s, teacher_logits=t, labels=labels, indices=indices, logprobs=logprobs)
    close(scope["loss"], generalized_jsd_reference(s, teacher_topk=(indices, logprobs), labels=labels))
    close(scope["crit"](s, t, labels), generalized_jsd_reference(s, t, beta=0.5, temperature=2.0, labels=labels))
    for beta in (0.0, 0.5):  # the snippet's first two lines, as they read
        line = f"K.generalized_jsd(student_logits, teacher_logits, beta={beta}, temperature=2.0, labels=labels)"
        assert line in snippet
        close(eval(line, {"K": K, "student_logits": s, "teacher_logits": t, "labels": labels}),
              generalized_jsd_reference(s, t, beta=beta, temperature=2.0, labels=labels))
    line = "K.generalized_jsd(student_logits, teacher_logits, labels=labels, loss_scale=1 / 4)"  # accumulation
    assert line in snippet
    close(eval(line, {"K": K, "student_logits": s, "teacher_logits": t, "labels": labels}),
          generalized_jsd_reference(s, t, labels=labels) / 4)


def test_fused_linear_snippet():
    snippet = python_block("loss = K.fused_linear_generalized_jsd(")
    n, hidden, vocab = 10, 16, 300
    student_hidden = torch.randn(n, hidden, requires_grad=True)
    teacher_hidden = torch.randn(n, hidden)
    student_head = torch.nn.Linear(hidden, vocab, bias=False)
    teacher_head = torch.nn.Linear(hidden, vocab, bias=False).requires_grad_(False)  # (a frozen teacher)
    labels = torch.randint(0, vocab, (n,))
    labels[3] = -100
    scope = run(snippet, student_hidden=student_hidden, teacher_hidden=teacher_hidden, student_head=student_head,
                teacher_head=teacher_head, labels=labels)
    sh = student_hidden.detach().double().requires_grad_()
    want = generalized_jsd_reference(sh @ student_head.weight.double().T,
                                     teacher_hidden.double() @ teacher_head.weight.double().T,
                                     beta=0.5, temperature=2.0, labels=labels)
    want.backward()
    close(scope["loss"].detach(), want.detach())
    # loss.backward() ran in the snippet: the student's hidden states and head weight have their gradients
    assert student_head.weight.grad is not None and teacher_head.weight.grad is None
    torch.testing.assert_close(student_hidden.grad.double(), sh.grad, rtol=1e-4, atol=1e-7)
