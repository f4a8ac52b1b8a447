#!/usr/bin/env python3
"""Block-wise FP8 fixtures for tests/fp8_test.cc: tiny random Qwen3-MoE and Qwen3-Next models
written as FP8 checkpoints in the layout Qwen publishes its -FP8 models in, and transformers'
outputs on the same weights dequantized.

For each configuration it writes, under --out/<name>/:
  model/            config.json with "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                    "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                    "modules_to_not_convert": [...]}, and two safetensors shards with their
                    model.safetensors.index.json: every linear layer's weight (experts included)
                    that the config converts (transformers' should_convert_module) as F8_E4M3 with
                    `<name>_scale_inv` F32 [ceil(N / 128), ceil(K / 128)] = amax / 448 of each
                    128 x 128 block (ragged edge blocks included; the scales all in the second
                    shard, apart from most of their weights); every other tensor BF16, per-expert
                    names as published (mlp.experts.E.{gate,up,down}_proj.weight)
  inputs.json       {"sequences": [...], "arch": ...}
  ref.safetensors   transformers in fp32 on the CPU, on the dequantized weights
                    (W = float(fp8) x scale_inv of its block, in fp32; the BF16 tensors upcast),
                    each sequence run alone, packed in order:
                      logits   [T, V]
                      logprobs [T - B] next-token log-probs
The sizes make every quantized weight ragged in at least one direction (hidden 160 = 128 + 32,
widths 136, 144, 200, ...), with several blocks, so that a scale indexed the wrong way shows.
Deterministic (fixed seeds).
"""
import argparse
import json
import os
import re
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.quantizers.quantizers_utils import should_convert_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures  # noqa: E402
import make_next_fixtures  # noqa: E402

BLOCK = 128
FP8_MAX = 448.0

CONFIGS = {
    # Qwen3-MoE: ragged everywhere, GQA 3, a dense layer, every layer's v_proj left in bf16 by a
    # regular-expression pattern, the routers and the LM head by name
    "fp8_moe": dict(
        arch="qwen3_moe", seed=5000,
        spec=dict(kind="moe", hidden_size=160, num_hidden_layers=2, num_attention_heads=3,
                  num_key_value_heads=1, head_dim=48, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=136, intermediate_size=200, mlp_only_layers=[1],
                  norm_topk_prob=True, tie_word_embeddings=False),
        not_convert=["lm_head", "model.embed_tokens", "mlp.gate", "model.layers.*.self_attn.v_proj"],
        seq_lengths=[7, 13, 1, 40]),
    # Qwen3-Next: a linear-attention and a full-attention layer, its shared expert quantized too,
    # in_proj_ba and the shared expert's gate left in bf16
    "fp8_next": dict(
        arch="qwen3_next", seed=5001,
        spec=dict(hidden_size=144, num_hidden_layers=2, full_attention_interval=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, partial_rotary_factor=0.25, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=32,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=136,
                  shared_expert_intermediate_size=72, norm_topk_prob=True, tie_word_embeddings=False),
        not_convert=["lm_head", "model.embed_tokens", "mlp.gate", "shared_expert_gate",
                     "linear_attn.in_proj_ba"],
        seq_lengths=[1, 5, 70]),
}


def build(arch, spec, seed):
    if arch == "qwen3_moe":
        model = make_fixtures.build("", spec, seed)
    else:
        model = make_next_fixtures.build(spec, seed)
    # Smaller weights than the parity fixtures': these layers are 3-5x wider.
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(0.5)
    return model.float().eval()


def quantize(w):
    """W [N, K] -> (fp8 [N, K], scale_inv [ceil(N/128), ceil(K/128)] fp32), per 128 x 128 block."""
    n, k = w.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.zeros(nb * BLOCK, kb * BLOCK)
    padded[:n, :k] = w
    blocks = padded.view(nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).float()
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nb * BLOCK, kb * BLOCK)[:n, :k].contiguous(), scale_inv.contiguous()


def dequantize(q, scale_inv):
    n, k = q.shape
    s = scale_inv.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return q.float() * s


EXPERT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj$")


def converts(name, linear, not_convert):
    """Whether the published converter quantizes tensor `name`: the weights of linear layers
    (transformers' model holds experts fused; the checkpoint has them per expert, as linears)
    that modules_to_not_convert does not exclude."""
    if not name.endswith(".weight"):
        return False
    module = name[: -len(".weight")]
    return (module in linear or EXPERT.match(module)) and should_convert_module(module, not_convert)


def write_fp8_checkpoint(src_dir, model_dir, linear, not_convert):
    """The saved fp32 model of `src_dir` as an FP8 checkpoint in `model_dir`; returns the
    dequantized fp32 state (what transformers runs)."""
    state = {}
    for f in sorted(os.listdir(src_dir)):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(src_dir, f)))
    weights, scales, dequantized = {}, {}, {}
    for name, t in state.items():
        if converts(name, linear, not_convert):
            q, s = quantize(t.float())
            weights[name], scales[name + "_scale_inv"] = q, s
            dequantized[name] = dequantize(q, s)
        else:
            weights[name] = t.to(torch.bfloat16).contiguous()
            dequantized[name] = weights[name].float()
    names = sorted(weights)
    first = {n: weights[n] for n in names[: len(names) // 2]}
    second = {n: weights[n] for n in names[len(names) // 2:]}
    second.update(scales)
    shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, os.path.join(model_dir, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in tensors})
    total = sum(t.numel() * t.element_size() for t in list(weights.values()) + list(scales.values()))
    with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return dequantized, len(scales)


def reference(model, seqs):
    logits, lps = [], []
    with torch.no_grad():
        for s in seqs:
            out = model(input_ids=torch.tensor([s]), use_cache=False)
            logits.append(out.logits[0].float())
            if len(s) > 1:
                logp = torch.log_softmax(out.logits[0].float(), -1)
                lps.append(logp[:-1].gather(1, torch.tensor(s[1:]).unsqueeze(1)).squeeze(1))
    return {"logits": torch.cat(logits).contiguous(), "logprobs": torch.cat(lps).contiguous()}


def make(out, name, cfg, index):
    d = os.path.join(out, name)
    model_dir = os.path.join(d, "model")
    os.makedirs(model_dir, exist_ok=True)
    for f in os.listdir(model_dir):
        os.remove(os.path.join(model_dir, f))
    model = build(cfg["arch"], cfg["spec"], cfg["seed"])
    with tempfile.TemporaryDirectory() as tmp:
        src, deq = os.path.join(tmp, "src"), os.path.join(tmp, "deq")
        model.save_pretrained(src)
        linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        dequantized, n_fp8 = write_fp8_checkpoint(src, model_dir, linear, cfg["not_convert"])
        with open(os.path.join(src, "config.json")) as f:
            config = json.load(f)
        # What transformers runs: the same config and the dequantized weights, in fp32.
        os.makedirs(deq)
        with open(os.path.join(deq, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        save_file(dequantized, os.path.join(deq, "model.safetensors"), metadata={"format": "pt"})
        ref_model = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    config["quantization_config"] = {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": cfg["not_convert"]}
    config["dtype"] = "bfloat16"
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    vocab = config["vocab_size"]
    g = torch.Generator().manual_seed(6000 + index)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in cfg["seq_lengths"]]
    with open(os.path.join(d, "inputs.json"), "w") as f:
        json.dump({"sequences": seqs, "arch": cfg["arch"]}, f)
    save_file(reference(ref_model, seqs), os.path.join(d, "ref.safetensors"))
    print(f"{name}: {n_fp8} FP8 weights")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    os.makedirs(args.out, exist_ok=True)
    for i, (name, cfg) in enumerate(CONFIGS.items()):
        make(args.out, name, cfg, i)
    with open(os.path.join(args.out, "index.json"), "w") as f:
        json.dump({"configs": list(CONFIGS)}, f)
    print(f"wrote {len(CONFIGS)} FP8 fixtures to {args.out}")


if __name__ == "__main__":
    main()
