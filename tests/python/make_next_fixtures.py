#!/usr/bin/env python3
"""Builds tiny random Qwen3-Next models and their reference outputs for the C++ parity tests
(tests/qwen3_next_test.cc). transformers' PyTorch fallbacks (torch_chunk_gated_delta_rule, the
conv1d path) run on CPU, so this needs no kernels.

For each configuration it writes, under --out/<name>/:
  model/            save_pretrained() output (config.json + model.safetensors); one of them also
                    carries `mtp.*` tensors, as published checkpoints do
  inputs.json       {"sequences": [...], "mtp_tensors": n, "generate": [...]}: token sequences of
                    lengths 1, 5, 64, 100, 130 (not multiples of the chunk size 64, and one of
                    exactly 64); "generate": greedy continuations by transformers' own generate
                    (its cache: conv state + recurrent delta rule per token), {"prompt", "tokens"}
                    for prompts of 2 (a conv window not yet full), 5 and 100 tokens
  ref.safetensors   logits [T, V]: every sequence run ALONE (batch of one, no padding), packed in
                    order; next-token log-probs [T - B]; the loss (mean next-token cross-entropy
                    over all sequences) and d(loss)/d(param) for every parameter ("grad.<name>");
                    generate_logits [sum of new tokens, V]: the logits each generated token was
                    chosen from, prompts in order
Everything is fp32 on CPU, with fixed seeds. The generator also checks that the reference's own
rounding error (fp32 against fp64) is far below the tests' tolerance.
"""
import argparse
import copy
import json
import math
import os

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_next import modeling_qwen3_next as modeling

COMMON = dict(vocab_size=96, max_position_embeddings=512, rms_norm_eps=1e-6, hidden_act="silu")

CONFIGS = {
    # the published layout in miniature: interval 4, GQA 2, partial rotary 0.25, 2 value heads per
    # key head, top-2 of 8 experts renormalised, untied; its checkpoint carries mtp.* tensors
    "next_interval4": dict(
        hidden_size=32, num_hidden_layers=4, full_attention_interval=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.25, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        norm_topk_prob=True, tie_word_embeddings=False, mtp=True),
    # interval 2, one value head per key head, dk != dv, partial rotary 0.5, top-4 of 16 without
    # renormalisation, tied embeddings, a saturating shared-expert gate
    "next_interval2_tied": dict(
        hidden_size=48, num_hidden_layers=4, full_attention_interval=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.5, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=8, num_experts=16,
        num_experts_per_tok=4, moe_intermediate_size=12, shared_expert_intermediate_size=20,
        norm_topk_prob=False, tie_word_embeddings=True, shared_gate_std=1.5),
    # explicit layer_types with full attention first, 4 value heads per key head, full rotary and
    # rope_theta 1e6, conv kernel 3, top-1, a dense MLP layer (mlp_only_layers, no shared expert)
    "next_full_first_ratio4": dict(
        hidden_size=32, num_hidden_layers=3,
        layer_types=["full_attention", "linear_attention", "linear_attention"], num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, partial_rotary_factor=1.0, rope_theta=1e6,
        linear_num_key_heads=1, linear_num_value_heads=4, linear_key_head_dim=12, linear_value_head_dim=6,
        linear_conv_kernel_dim=3, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=16,
        shared_expert_intermediate_size=8, mlp_only_layers=[1], intermediate_size=40,
        norm_topk_prob=True, tie_word_embeddings=False),
    # interval 3 over 5 layers, 3 value heads per key head, top-8 of 8, MoE every 2nd layer
    "next_sparse2_ratio3": dict(
        hidden_size=40, num_hidden_layers=5, full_attention_interval=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, partial_rotary_factor=0.5, linear_num_key_heads=2,
        linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=16, num_experts=8,
        num_experts_per_tok=8, moe_intermediate_size=12, shared_expert_intermediate_size=32,
        decoder_sparse_step=2, intermediate_size=48, norm_topk_prob=True, tie_word_embeddings=False),
}

SEQ_LENGTHS = [1, 5, 64, 100, 130]
GENERATE_NEW_TOKENS = 8
# top-1 over top-2 logit of every greedy step: 4x the reference's own noise floor, far above the
# C++ decode's ~1e-6 distance from transformers, so no argmax can flip
GREEDY_MARGIN = 1e-4
NOISE_FLOOR = 2.5e-5  # the reference's own fp32 error must stay well below the tests' 1e-4


def make_config(spec):
    spec = dict(spec)
    spec.pop("mtp", None)
    spec.pop("shared_gate_std", None)
    rope = {"rope_type": "default", "rope_theta": spec.pop("rope_theta", 10000.0),
            "partial_rotary_factor": spec.pop("partial_rotary_factor")}
    return Qwen3NextConfig(**COMMON, **spec, rope_parameters=rope)


def randomise(model, spec):
    """Weights larger than the default init so that every term matters at the tolerance we test;
    norm weights, decays (A_log, dt_bias) and conv taps random too.

    Keys share most of their queries' projection (and conv taps), as in trained models: with
    independent random q and k, q.k is near zero for some tokens, the gated RMSNorm then divides by
    a near-zero rms and fp32 rounding (transformers' own included) is amplified past the tolerance.
    `noise_floor` checks the result."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # decay rates A from 0.01 (long memory) to 16 (forgets at once)
                p.copy_(torch.empty_like(p).uniform_(math.log(0.01), math.log(16.0)))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("linear_attn.norm.weight"):  # gated norm: scale w
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.dim() == 1:  # zero-centred norms: scale 1 + w
                p.copy_(0.2 * torch.randn_like(p))
            elif "conv1d" in name:
                p.normal_(0.0, 0.3)
            elif "shared_expert_gate" in name:
                p.normal_(0.0, spec.get("shared_gate_std", 0.3))
            else:
                p.normal_(0.0, 0.1)
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                correlate_keys_with_queries(layer.linear_attn, 0.3)


def correlate_keys_with_queries(la, noise):
    hk, dk, dv = la.num_k_heads, la.head_k_dim, la.head_v_dim
    r = la.num_v_heads // hk
    w = la.in_proj_qkvz.weight.view(hk, 2 * dk + 2 * r * dv, -1)  # per key head [q | k | v | z]
    w[:, dk:2 * dk] = w[:, :dk] + noise * w[:, dk:2 * dk]
    taps = la.conv1d.weight  # channels [q (hk dk) | k (hk dk) | v]
    taps[hk * dk:2 * hk * dk] = taps[:hk * dk] + noise * taps[hk * dk:2 * hk * dk]


def build(spec, seed):
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(make_config(spec))
    randomise(model, spec)
    return model.float().eval()


def reference(model, seqs):
    logits, lps = [], []
    for s in seqs:
        out = model(input_ids=torch.tensor([s]), use_cache=False).logits[0]  # [L, V], alone
        logits.append(out)
        if len(s) > 1:
            logp = torch.log_softmax(out.float(), -1)
            lps.append(logp[:-1].gather(1, torch.tensor(s[1:]).unsqueeze(1)).squeeze(1))
    lps = torch.cat(lps)
    loss = -lps.mean()
    model.zero_grad()
    loss.backward()
    ref = {
        "logits": torch.cat(logits).detach().contiguous(),
        "logprobs": lps.detach().contiguous(),
        "loss": loss.detach().reshape(1),
    }
    for name, p in model.named_parameters():
        ref["grad." + name] = p.grad.detach().contiguous()
    return ref


def generate(model, seqs):
    """Greedy continuations through transformers' generate with its cache."""
    from transformers import GenerationConfig
    gc = GenerationConfig(max_new_tokens=GENERATE_NEW_TOKENS, do_sample=False, eos_token_id=None,
                          pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    cases, logits = [], []
    # Per case the first candidate prompt whose continuation has no near tie.
    for candidates in ([seqs[2][:n] for n in (2, 3)], [seqs[1], seqs[2][:5]],
                       [seqs[3][:n] for n in range(100, 90, -1)]):
        for prompt in candidates:
            with torch.no_grad():
                ids = torch.tensor([prompt])  # an explicit mask: no id is taken for padding
                out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
            step_logits = torch.cat(out.logits)  # [new, V]
            top2 = step_logits.topk(2, -1).values
            if (top2[:, 0] - top2[:, 1]).min().item() >= GREEDY_MARGIN:
                break
        else:
            raise SystemExit(f"every greedy continuation of {len(candidates[0])} tokens has a near "
                             "tie: re-seed this config")
        cases.append({"prompt": prompt, "tokens": out.sequences[0, len(prompt):].tolist()})
        logits.append(step_logits)
    return cases, torch.cat(logits).contiguous()


def exact_delta_rule(query, key, value, g, beta, use_qk_l2norm_in_kernel=True, **kwargs):
    """The delta rule per token in fp64 (transformers' fallbacks always compute it in fp32)."""
    r = value.shape[2] // key.shape[2]
    q = modeling.l2norm(query.double().repeat_interleave(r, 2), -1, 1e-6) / math.sqrt(query.shape[-1])
    k = modeling.l2norm(key.double().repeat_interleave(r, 2), -1, 1e-6)
    v, g, beta = value.double(), g.double(), beta.double()
    state = torch.zeros(k.shape[0], k.shape[2], k.shape[3], v.shape[3], dtype=torch.float64)
    out = torch.zeros_like(v)
    for t in range(k.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - (state * k[:, t, ..., None]).sum(-2)) * beta[:, t, ..., None]
        state = state + k[:, t, ..., None] * delta[..., None, :]
        out[:, t] = (state * q[:, t, ..., None]).sum(-2)
    return out.to(query.dtype), None


def noise_floor(model, seqs):
    """Max |logits| difference of transformers in fp32 against the same weights in fp64: the
    reference's own rounding error, which must sit well below the C++ tests' 1e-4."""
    exact = copy.deepcopy(model).double()
    exact.config._experts_implementation = "eager"
    chunked = modeling.torch_chunk_gated_delta_rule
    modeling.torch_chunk_gated_delta_rule = exact_delta_rule
    try:
        with torch.no_grad():
            return max((model(input_ids=torch.tensor([s]), use_cache=False).logits[0].double() -
                        exact(input_ids=torch.tensor([s]), use_cache=False).logits[0]).abs().max().item()
                       for s in seqs)
    finally:
        modeling.torch_chunk_gated_delta_rule = chunked


def add_mtp_tensors(model_dir, hidden):
    """Published checkpoints carry multi-token-prediction weights; inference ignores them."""
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    g = torch.Generator().manual_seed(7)
    mtp = {
        "mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=g),
        "mtp.norm.weight": torch.randn(hidden, generator=g),
        "mtp.pre_fc_norm_embedding.weight": torch.randn(hidden, generator=g),
        "mtp.layers.0.self_attn.q_proj.weight": torch.randn(hidden, hidden, generator=g),
    }
    tensors.update(mtp)
    save_file(tensors, path, metadata={"format": "pt"})
    return len(mtp)


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
        model = build(spec, seed=3000 + i)
        g = torch.Generator().manual_seed(4000 + i)
        seqs = [torch.randint(0, COMMON["vocab_size"], (n,), generator=g).tolist() for n in SEQ_LENGTHS]
        model.save_pretrained(os.path.join(d, "model"))
        mtp = add_mtp_tensors(os.path.join(d, "model"), spec["hidden_size"]) if spec.get("mtp") else 0
        gen_cases, gen_logits = generate(model, seqs)
        with open(os.path.join(d, "inputs.json"), "w") as f:
            json.dump({"sequences": seqs, "mtp_tensors": mtp, "generate": gen_cases}, f)
        ref = reference(model, seqs)
        ref["generate_logits"] = gen_logits
        save_file(ref, os.path.join(d, "ref.safetensors"))
        floor = noise_floor(model, seqs)
        print(f"{name}: transformers fp32 vs fp64 logits: {floor:.2g}")
        if floor > NOISE_FLOOR:
            raise SystemExit(f"{name}: reference rounding error {floor:.2g} > {NOISE_FLOOR}: re-seed this config")
        names.append(name)
    with open(os.path.join(args.out, "index.json"), "w") as f:
        json.dump({"configs": names}, f)
    print(f"wrote {len(names)} Qwen3-Next fixtures to {args.out}")


if __name__ == "__main__":
    main()
