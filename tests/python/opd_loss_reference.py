#!/usr/bin/env python3
"""Reference OPD losses in plain PyTorch (the formulas of trainer/opd/opd_loss.h, written out
independently). Reads inputs.safetensors, writes out.safetensors with each variant's loss and
its gradient w.r.t. the learner's log-probs / logits."""
import sys

import torch
from safetensors.torch import load_file, save_file

inp = load_file(sys.argv[1])
lp0, lp_old, lp_t = inp["lp"], inp["lp_old"], inp["lp_teacher"]
norm = float(inp["normaliser"][0])
out = {}


def sampled(kind, kl_coef=1.0, cap=2.0, lo=0.2, hi=0.28):
    lp = lp0.clone().requires_grad_(True)
    adv = -kl_coef * (lp.detach() - lp_t)
    ratio = torch.exp(lp - lp_old)
    if kind == "none":
        per = -adv * lp
    elif kind == "tis":
        per = -torch.clamp(ratio.detach(), max=cap) * adv * lp
    else:  # ppo (slime / verl style)
        per = torch.maximum(-ratio * adv, -torch.clamp(ratio, 1 - lo, 1 + hi) * adv)
    loss = per.sum() / norm
    loss.backward()
    out[f"{kind}.loss"] = loss.detach().reshape(1)
    out[f"{kind}.grad"] = lp.grad


for kind in ("none", "tis", "ppo"):
    sampled(kind)

# Top-k: the teacher's top-k of its full-vocabulary log-probs; k + 1 buckets (the k ids and the
# rest of the vocabulary as one), both sides at full-vocabulary probabilities; the gradient is
# w.r.t. the student's full logits.
s0, t_full = inp["student_full"], inp["teacher_full"]
k = 8
t_k, ids = t_full.topk(k, -1)
floor = k * 2.0**-24


def log_tail(lp):
    return torch.log(torch.clamp(1.0 - lp.exp().sum(-1), min=floor))


for name, alpha in (("forward", 1.0), ("reverse", 0.0), ("mixed", 0.5)):
    s = s0.clone().requires_grad_(True)
    q = torch.log_softmax(s, -1).gather(1, ids)
    p = t_k
    qt, pt = log_tail(q), log_tail(p)
    fwd = (p.exp() * (p - q)).sum(-1) + pt.exp() * (pt - qt)
    rev = (q.exp() * (q - p)).sum(-1) + qt.exp() * (qt - pt)
    loss = (alpha * fwd + (1 - alpha) * rev).sum() / norm
    loss.backward()
    out[f"topk_{name}.loss"] = loss.detach().reshape(1)
    out[f"topk_{name}.grad"] = s.grad
save_file({k: v.contiguous() for k, v in out.items()}, sys.argv[2])
