#!/usr/bin/env python3
"""SFT training throughput: `opd-trainer sft` vs a transformers + torch.optim.AdamW loop, same
model (forward.py's: hidden 512, 8 layers, 64 experts top-8, expert dim 256, vocab 151936), same
data, same micro-batches, same thread count, in one run.

A step is forward + backward + gradient clipping + AdamW update over --batch packed sequences of
up to --len tokens (one micro-batch). Our trainer dumps its micro-batches (debug.dump_batches) and
the reference replays exactly those, so both see the same tokens; each conversation nearly fills
a sequence, so the reference's padding is small (its tokens/s counts real tokens only). The
headline figure is the best step after the first (from our run's metrics.jsonl; timed in the
reference loop), the mean is printed too: on a shared machine the best step is the stable one.
Peak RSS of both processes is reported. The reference uses torch.optim.AdamW(fused=True), the
fastest CPU AdamW, with the same loss, aux loss and clipping.
"""
import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from forward import make_model  # noqa: E402

WORDS = ("time people way water words number day part sound work place year thing name sentence man line "
         "right boy farm end home hand picture air animal house point page letter mother answer found "
         "study still learn plant cover food sun country eye city tree cross farm hard start story saw far "
         "sea draw left late run while press close night real life few north open seem together next white "
         "children begin got walk example ease paper group always music those both mark often until").split()


def write_data(path, n, words_per_conv, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            q = " ".join(rng.choice(WORDS) for _ in range(words_per_conv // 4))
            a = " ".join(rng.choice(WORDS) for _ in range(words_per_conv - words_per_conv // 4))
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": a}]}) + "\n")


def run_ours(args, model_dir, data, run_dir):
    config = os.path.join(args.workdir, "sft_bench.yaml")
    with open(config, "w") as f:
        json.dump({  # JSON is YAML
            "model": {"path": model_dir, "tokenizer": args.tokenizer, "chat_format": "qwen2"},
            "data": {"train": [{"files": [data]}], "max_seq_len": args.len},
            "train": {"max_steps": args.steps + 1, "global_batch_size": args.batch,
                      "micro_batch_size": args.batch, "threads": args.threads},
            "optim": {"lr": 1e-5, "min_lr": 1e-6},
            "eval": {"every": 0},
            "checkpoint": {"every": 0, "at_end": False},
            "debug": {"dump_batches": True},
            "run": {"dir": run_dir, "resume": "never"},
        }, f, indent=2)
    cmd = [os.path.join(args.build, "trainer", "opd-trainer"), "sft", "--config", config]
    subprocess.run(["rm", "-rf", run_dir], check=True)
    subprocess.run(cmd, check=True, stderr=open(run_dir + ".log", "w"))
    metrics = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if "train/loss" in l]
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    steps = metrics[1:]
    return {"tokens_per_s": max(m["train/tokens"] / m["train/step_time_s"] for m in steps),
            "mean_tokens_per_s": sum(m["train/tokens"] for m in steps) / sum(m["train/step_time_s"] for m in steps),
            "peak_rss_mb": summary["peak_rss_mb"], "loss": [m["train/loss"] for m in metrics]}


def reference(args):
    """The transformers loop, in its own process (clean peak RSS). Prints one JSON line."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "python"))
    from sft_reference import padded, read_batches

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    model.train()
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.dim() >= 2 and not n.endswith(".bias")]
    no_decay = [p for n, p in named if not (p.dim() >= 2 and not n.endswith(".bias"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-5, betas=(0.9, 0.95), eps=1e-8, fused=True)
    coef = model.config.router_aux_loss_coef
    steps = read_batches(args.batches)
    times, tokens, losses = [], [], []
    for s in sorted(steps):
        t0 = time.perf_counter()
        n_step = steps[s][0]["step_trained_tokens"]
        ce_total, real = 0.0, 0
        for mb in steps[s]:
            ids, mask, labels = padded(mb["docs"])
            real += int(mask.sum())
            out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
            logits = out.logits.float()
            ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                                 ignore_index=-100, reduction="sum")
            loss = ce / n_step + coef * out.aux_loss / len(steps[s])
            loss.backward()
            ce_total += ce.item()
            del out, logits, loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        tokens.append(real)
        losses.append(ce_total / n_step)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(json.dumps({"tokens_per_s": max(n / t for n, t in zip(tokens[1:], times[1:])),
                      "mean_tokens_per_s": sum(tokens[1:]) / sum(times[1:]), "peak_rss_mb": peak, "loss": losses}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--workdir", default="build/bench")
    ap.add_argument("--tokenizer", default=os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared",
                                                        "tokenizers", "qwen2"))
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--len", type=int, default=512, help="tokens per sequence (max)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--batches", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reference:
        reference(args)
        return

    os.makedirs(args.workdir, exist_ok=True)
    model_dir = os.path.join(args.workdir, "qwen3moe_h512_l8_e64")
    make_model(model_dir)
    data = os.path.join(args.workdir, "sft_bench.jsonl")
    # ~0.8 tokens per word piece here: conversations of ~90% of a sequence, one per sequence.
    write_data(data, args.batch * (args.steps + 1) * 2, int(args.len * 0.85))
    run_dir = os.path.join(args.workdir, "sft_run")
    ours = run_ours(args, model_dir, data, run_dir)
    out = subprocess.check_output([sys.executable, __file__, "--reference", f"--threads={args.threads}",
                                   f"--model-dir={model_dir}", f"--batches={run_dir}/debug/batches.jsonl"])
    theirs = json.loads(out.decode().strip().splitlines()[-1])
    print(f"SFT training step (forward + backward + clip + AdamW), {args.batch} x <= {args.len} tokens per step, "
          f"hidden 512, 8 layers, 64 experts top-8, vocab 151936, {args.threads} threads, fp32")
    for name, r in (("ours (opd-trainer)", ours), ("transformers+torch", theirs)):
        print(f"  {name}: {r['tokens_per_s']:9.1f} tokens/s (best step; mean {r['mean_tokens_per_s']:.1f})   "
              f"peak RSS {r['peak_rss_mb']:7.0f} MiB")
    print(f"  ratio ours/theirs:  {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x   "
          f"(first-step loss {ours['loss'][0]:.5f} vs {theirs['loss'][0]:.5f})")


if __name__ == "__main__":
    main()
