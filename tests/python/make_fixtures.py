#!/usr/bin/env python3
"""Builds tiny random Hugging Face models and their reference outputs for the C++ parity tests.

For each configuration it writes, under --out/<name>/:
  model/            save_pretrained() output (config.json + model.safetensors)
  inputs.json       the token sequences (a batch of different lengths)
  ref.safetensors   logits [T, V] of every real token (packed in sequence order), next-token
                    log-probs [T - B], the router load-balancing loss, the loss used for the
                    gradients and d(loss)/d(param) for every parameter ("grad.<name>")
The loss is mean next-token cross-entropy over all sequences + aux_coef * load-balancing loss.
Everything is fp32 on CPU. Re-running is cheap and deterministic (fixed seeds).
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

COMMON = dict(vocab_size=96, max_position_embeddings=256, rms_norm_eps=1e-6, hidden_act="silu")

CONFIGS = {
    # tied, norm_topk_prob, GQA 2, head_dim != hidden/heads, top-8 of 16
    "moe_tied_topk8": dict(kind="moe", hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=8,
                           moe_intermediate_size=24, norm_topk_prob=True, tie_word_embeddings=True),
    # untied, no renormalisation, top-1, MHA (GQA ratio 1), MoE every 2nd layer
    "moe_untied_top1_sparse2": dict(kind="moe", hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=4, head_dim=8, num_experts=8, num_experts_per_tok=1,
                                    moe_intermediate_size=16, intermediate_size=40, norm_topk_prob=False,
                                    decoder_sparse_step=2, tie_word_embeddings=False),
    # dense layers mixed in through mlp_only_layers, GQA 4, rope_theta in rope_parameters
    "moe_mlp_only_gqa4": dict(kind="moe", hidden_size=32, num_hidden_layers=3, num_attention_heads=8,
                              num_key_value_heads=2, head_dim=12, num_experts=6, num_experts_per_tok=2,
                              moe_intermediate_size=20, intermediate_size=36, norm_topk_prob=True,
                              mlp_only_layers=[0, 2], tie_word_embeddings=False, rope_theta=1e6),
    # dense Qwen3 (the same code path with no MoE layers)
    "dense_qwen3": dict(kind="dense", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=64, tie_word_embeddings=True),
    # Marco-like proportions in miniature: many experts, top-8, untied
    "moe_many_experts": dict(kind="moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=1, head_dim=16, num_experts=32, num_experts_per_tok=8,
                             moe_intermediate_size=16, norm_topk_prob=True, tie_word_embeddings=False),
}

SEQ_LENGTHS = [7, 13, 1, 20]


def build(name, spec, seed):
    spec = dict(spec)
    kind = spec.pop("kind")
    torch.manual_seed(seed)
    if kind == "moe":
        cfg = Qwen3MoeConfig(**COMMON, **spec, router_aux_loss_coef=0.05)
        model = Qwen3MoeForCausalLM(cfg)
    else:
        cfg = Qwen3Config(**COMMON, **spec)
        model = Qwen3ForCausalLM(cfg)
    # Larger-than-default weights so that every term matters at the tolerance we test; norm
    # weights away from 1 so that a missing norm weight shows.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model.float().eval()


def reference(model, seqs):
    is_moe = isinstance(model, Qwen3MoeForCausalLM)
    B, L = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = 1
    kwargs = dict(output_router_logits=True) if is_moe else {}
    out = model(input_ids=ids, attention_mask=mask, **kwargs)
    logits = out.logits  # [B, L, V]
    logp = torch.log_softmax(logits.float(), -1)
    packed_logits, lps = [], []
    for b, s in enumerate(seqs):
        n = len(s)
        packed_logits.append(logits[b, :n])
        if n > 1:
            lps.append(logp[b, : n - 1].gather(1, torch.tensor(s[1:]).unsqueeze(1)).squeeze(1))
    lps = torch.cat(lps)
    ce = -lps.mean()
    aux = out.aux_loss if is_moe else torch.zeros(())
    coef = model.config.router_aux_loss_coef if is_moe else 0.0
    loss = ce + coef * aux
    model.zero_grad()
    loss.backward()
    ref = {
        "logits": torch.cat(packed_logits).detach().contiguous(),
        "logprobs": lps.detach().contiguous(),
        "aux_loss": aux.detach().reshape(1).float(),
        "loss": loss.detach().reshape(1),
        "aux_coef": torch.tensor([coef], dtype=torch.float32),
    }
    for pname, p in model.named_parameters():
        ref["grad." + pname] = p.grad.detach().contiguous()
    return ref


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    os.makedirs(args.out, exist_ok=True)
    names = []
    for i, (name, spec) in enumerate(CONFIGS.items()):
        d = os.path.join(args.out, name)
        os.makedirs(d, exist_ok=True)
        model = build(name, spec, seed=1000 + i)
        g = torch.Generator().manual_seed(2000 + i)
        seqs = [torch.randint(0, COMMON["vocab_size"], (n,), generator=g).tolist() for n in SEQ_LENGTHS]
        model.save_pretrained(os.path.join(d, "model"))
        with open(os.path.join(d, "inputs.json"), "w") as f:
            json.dump({"sequences": seqs}, f)
        save_file(reference(model, seqs), os.path.join(d, "ref.safetensors"))
        names.append(name)
    with open(os.path.join(args.out, "index.json"), "w") as f:
        json.dump({"configs": names}, f)
    print(f"wrote {len(names)} fixtures to {args.out}")


if __name__ == "__main__":
    main()
