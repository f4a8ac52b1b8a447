#!/usr/bin/env python3
"""Python reference loop for `opd-trainer sft`, built from transformers + torch.optim.AdamW.

Replays the micro-batches a run dumped (debug.dump_batches: <run>/debug/batches.jsonl) with the
run's resolved config (<run>/config.yaml): the same data order, the same learning-rate schedule,
the same clipping and the same loss normalisation, in fp32 on the CPU:

  per step:  loss = sum over micro-batches of [ CE_sum(micro) / N_step + coef * aux(micro) / M ]
             N_step = trained tokens of the whole step, M = micro-batches per step,
             aux = transformers' router load-balancing loss of the micro-batch's forward
  then       clip_grad_norm_(max_norm); AdamW(fused=True) step with two groups (no weight decay
             on 1-D parameters and biases); lr from the warm-up + cosine formula of trainer/common/optim.h

Each micro-batch's documents are run as one padded batch with an attention mask (attention never
crosses documents in the packed C++ layout either). Then our final checkpoint is loaded with
transformers' from_pretrained (which proves it loads) and compared with the reference weights.
Prints one JSON line: per-step losses of both, the largest differences.
"""
import argparse
import json
import math
import os

import torch
import torch.nn.functional as F
import yaml
from transformers import AutoModelForCausalLM


def lr_at(step, o, total):
    """trainer/common/optim.h CosineSchedule::LrAt (step is the 0-based update index)."""
    w = o["warmup_steps"]
    if step < w:
        return o["lr"] * (step + 1) / w
    progress = min(1.0, (step - w) / max(1, total - w))
    return o["min_lr"] + (o["lr"] - o["min_lr"]) * 0.5 * (1.0 + math.cos(math.pi * progress))


def padded(docs):
    L = max(len(d["ids"]) for d in docs)
    ids = torch.zeros(len(docs), L, dtype=torch.long)
    mask = torch.zeros(len(docs), L, dtype=torch.long)
    labels = torch.full((len(docs), L), -100, dtype=torch.long)
    for i, d in enumerate(docs):
        n = len(d["ids"])
        ids[i, :n] = torch.tensor(d["ids"])
        mask[i, :n] = 1
        labels[i, :n] = torch.tensor(d["labels"])
    return ids, mask, labels


def micro_loss(model, docs, n_step, n_micro, coef):
    ids, mask, labels = padded(docs)
    out = model(input_ids=ids, attention_mask=mask, output_router_logits=coef > 0)
    logits = out.logits.float()
    # label[t] is predicted by the logits at t - 1 of the same document.
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                         ignore_index=-100, reduction="sum")
    loss = ce / max(n_step, 1)
    if coef > 0:
        loss = loss + coef * out.aux_loss / n_micro
    return loss, ce.item()


def read_batches(path):
    steps = {}
    with open(path) as f:
        for line in f:
            b = json.loads(line)
            steps.setdefault(b["step"], []).append(b)
    return {s: sorted(v, key=lambda b: b["micro"]) for s, v in steps.items()}


def train_reference(model, cfg, steps, total_steps, coef):
    o = cfg["optim"]
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.dim() >= 2 and not n.endswith(".bias")]
    no_decay = [p for n, p in named if not (p.dim() >= 2 and not n.endswith(".bias"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"], fused=True)
    losses, norms = [], []
    for s in sorted(steps):
        micro = steps[s]
        n_step = micro[0]["step_trained_tokens"]
        ce_total = 0.0
        for mb in micro:
            loss, ce = micro_loss(model, mb["docs"], n_step, len(micro), coef)
            loss.backward()
            ce_total += ce
        max_norm = o["max_grad_norm"]
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
        for g in opt.param_groups:
            g["lr"] = lr_at(s - 1, o, total_steps)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(ce_total / max(n_step, 1))
        norms.append(norm.item())
    return losses, norms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True, help="our run directory")
    ap.add_argument("--model", required=True, help="the initial student (HF directory)")
    ap.add_argument("--ours", required=True, help="our final checkpoint's model directory")
    ap.add_argument("--save", help="save the reference model here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = yaml.safe_load(open(os.path.join(args.run, "config.yaml")))
    steps = read_batches(os.path.join(args.run, "debug", "batches.jsonl"))
    metrics = [json.loads(l) for l in open(os.path.join(args.run, "metrics.jsonl"))]
    ours_loss = [m["train/loss"] for m in metrics if "train/loss" in m]
    ours_norm = [m["train/grad_norm"] for m in metrics if "train/grad_norm" in m]
    total_steps = cfg["train"]["max_steps"]

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.train()
    coef = cfg["train"]["aux_loss_coef"]
    if coef < 0:
        coef = model.config.router_aux_loss_coef
    ref_loss, ref_norm = train_reference(model, cfg, steps, total_steps, coef)
    if args.save:
        model.save_pretrained(args.save)

    ours = AutoModelForCausalLM.from_pretrained(args.ours, dtype=torch.float32)
    ref_params = dict(model.named_parameters())
    max_diff, max_rel, worst = 0.0, 0.0, ""
    for name, p in ours.named_parameters():
        r = ref_params[name].detach()
        d = (p.detach() - r).abs().max().item()
        if d > max_diff:
            max_diff, worst = d, name
        max_rel = max(max_rel, d / max(r.abs().max().item(), 1e-12))
    print(json.dumps({
        "steps": len(ref_loss),
        "loss_ours": ours_loss, "loss_ref": ref_loss,
        "grad_norm_ours": ours_norm, "grad_norm_ref": ref_norm,
        "max_loss_diff": max(abs(a - b) for a, b in zip(ours_loss, ref_loss)),
        "max_grad_norm_rel_diff": max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours_norm, ref_norm)),
        "max_weight_diff": max_diff, "max_weight_rel_diff": max_rel, "worst_param": worst,
    }))


if __name__ == "__main__":
    main()
