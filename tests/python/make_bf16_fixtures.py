#!/usr/bin/env python3
"""bf16 references for tests/bf16_test.cc: tiny random Qwen3-MoE and Qwen3-Next models (the
configurations and initialisations of make_fixtures.py / make_next_fixtures.py), saved by
transformers in bfloat16 across several shards, and transformers' own outputs with the model
loaded in bfloat16 (from_pretrained(dtype=torch.bfloat16), as a user would serve it on CPU).

For each configuration it writes, under --out/<name>/:
  model/            save_pretrained() in bf16, sharded (model-0000i-of-0000N + index)
  inputs.json       {"sequences": [...], "arch": ...}
  ref.safetensors   per sequence run alone (no padding), packed in order:
                      hidden     [T, H]  the last hidden state (after the final norm), bf16 run
                      logits     [T, V]  bf16 run (the LM head in bf16, as transformers returns it)
                      logprobs   [T - B] log_softmax(logits.float()) at the next tokens, bf16 run
                      logprobs_fp32 [T - B] the same bf16 weights run in fp32: how far bf16
                                 arithmetic itself moves the answer (a yardstick for the test)
Deterministic (fixed seeds).
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures  # noqa: E402
import make_next_fixtures  # noqa: E402

# (name, architecture, spec, seed)
CONFIGS = [
    ("moe_tied_topk8", "qwen3_moe", make_fixtures.CONFIGS["moe_tied_topk8"], 1000),
    ("moe_untied_top1_sparse2", "qwen3_moe", make_fixtures.CONFIGS["moe_untied_top1_sparse2"], 1001),
    ("next_interval4", "qwen3_next", make_next_fixtures.CONFIGS["next_interval4"], 3000),
]
SEQ_LENGTHS = [7, 13, 1, 40, 70]  # 70 > one delta-rule chunk (64)
SHARD_SIZE = "40KB"  # several shards even for these tiny models


def build(arch, spec, seed):
    if arch == "qwen3_moe":
        return make_fixtures.build("", spec, seed)
    return make_next_fixtures.build(spec, seed)


def run(model, seqs):
    hidden, logits, lps = [], [], []
    with torch.no_grad():
        for s in seqs:
            out = model(input_ids=torch.tensor([s]), use_cache=False, output_hidden_states=True)
            hidden.append(out.hidden_states[-1][0].float())
            logits.append(out.logits[0].float())
            if len(s) > 1:
                logp = torch.log_softmax(out.logits[0].float(), -1)
                lps.append(logp[:-1].gather(1, torch.tensor(s[1:]).unsqueeze(1)).squeeze(1))
    return torch.cat(hidden), torch.cat(logits), torch.cat(lps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    os.makedirs(args.out, exist_ok=True)
    names = []
    for i, (name, arch, spec, seed) in enumerate(CONFIGS):
        d = os.path.join(args.out, name)
        os.makedirs(d, exist_ok=True)
        model = build(arch, spec, seed).to(torch.bfloat16)
        model.save_pretrained(os.path.join(d, "model"), max_shard_size=SHARD_SIZE)
        del model
        # What the test compares against: transformers loading the saved checkpoint in bf16.
        bf16 = AutoModelForCausalLM.from_pretrained(os.path.join(d, "model"), dtype=torch.bfloat16).eval()
        vocab = bf16.config.vocab_size
        g = torch.Generator().manual_seed(4000 + i)
        seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in SEQ_LENGTHS]
        hidden, logits, lps = run(bf16, seqs)
        _, _, lps32 = run(bf16.float(), seqs)
        with open(os.path.join(d, "inputs.json"), "w") as f:
            json.dump({"sequences": seqs, "arch": arch}, f)
        save_file({"hidden": hidden.contiguous(), "logits": logits.contiguous(),
                   "logprobs": lps.contiguous(), "logprobs_fp32": lps32.contiguous()},
                  os.path.join(d, "ref.safetensors"))
        shards = [f for f in os.listdir(os.path.join(d, "model")) if f.endswith(".safetensors")]
        print(f"{name}: {len(shards)} shards, bf16 vs fp32 arithmetic: max |d logprob| "
              f"{(lps - lps32).abs().max().item():.4f}")
        names.append(name)
    with open(os.path.join(args.out, "index.json"), "w") as f:
        json.dump({"configs": names}, f)
    print(f"wrote {len(names)} bf16 fixtures to {args.out}")


if __name__ == "__main__":
    main()
