#!/usr/bin/env python3
"""The demo's procedurally generated task: integer addition in chat format, with checkable answers.

  user: "37+45="      assistant: "82"

Writes into --out:
  tokenizer/               a small byte-level BPE (Hugging Face tokenizer.json) with the ChatML
                           special tokens, trained on the task's own text (so tiny models stay tiny)
  sft_teacher.jsonl        chat data the teachers are fine-tuned on
  sft_student.jsonl        a smaller set: the student is fine-tuned only briefly
  heldout.jsonl            held-out chat data (evaluation loss)
  opd_prompts.jsonl        prompts without the assistant turn, with "answer" (on-policy stage data)
  eval_prompts.jsonl       held-out prompts with "answer" (accuracy)
  models/{student,teacher_small,teacher_large}.json   HF config.json of each random model
Deterministic for a given --seed.
"""
import argparse
import json
import os
import random

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def problem(rng, max_operand):
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    return f"{a}+{b}=", str(a + b)


def chat(q, a=None):
    msgs = [{"role": "user", "content": q}]
    if a is not None:
        msgs.append({"role": "assistant", "content": a})
    return msgs


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def make_tokenizer(out_dir, corpus, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                   "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": 4096}, f, indent=2)
    return tok.get_vocab_size()


def model_config(vocab, hidden, layers, heads, kv_heads, experts, top_k, expert_dim):
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
        "num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": expert_dim,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "bos_token_id": None,
        "eos_token_id": 2, "pad_token_id": 0,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-operand", type=int, default=49)
    ap.add_argument("--teacher-examples", type=int, default=20000)
    ap.add_argument("--student-examples", type=int, default=3000)
    ap.add_argument("--prompts", type=int, default=4000)
    ap.add_argument("--eval", type=int, default=256)
    ap.add_argument("--tokenizer-vocab", type=int, default=320, help="BPE vocabulary size target")
    ap.add_argument("--scale", choices=["full", "mini"], default="full",
                    help="mini: a smaller stronger teacher, for the miniature demo in the test suite")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)
    # Held-out problems never appear in any training or prompt set.
    eval_set = {}
    while len(eval_set) < args.eval:
        q, a = problem(rng, args.max_operand)
        eval_set[q] = a

    def draw(n):
        rows = []
        while len(rows) < n:
            q, a = problem(rng, args.max_operand)
            if q not in eval_set:
                rows.append((q, a))
        return rows

    teacher = draw(args.teacher_examples)
    student = draw(args.student_examples)
    heldout = draw(256)
    prompts = draw(args.prompts)
    write_jsonl(os.path.join(args.out, "sft_teacher.jsonl"), [{"messages": chat(q, a)} for q, a in teacher])
    write_jsonl(os.path.join(args.out, "sft_student.jsonl"), [{"messages": chat(q, a)} for q, a in student])
    write_jsonl(os.path.join(args.out, "heldout.jsonl"), [{"messages": chat(q, a)} for q, a in heldout])
    write_jsonl(os.path.join(args.out, "opd_prompts.jsonl"),
                [{"messages": chat(q), "answer": a, "domain": "arithmetic"} for q, a in prompts])
    write_jsonl(os.path.join(args.out, "eval_prompts.jsonl"),
                [{"messages": chat(q), "answer": a, "domain": "arithmetic"} for q, a in eval_set.items()])

    corpus = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n" for q, a in teacher]
    vocab = make_tokenizer(os.path.join(args.out, "tokenizer"), corpus, args.tokenizer_vocab)
    padded = (vocab + 63) // 64 * 64  # embedding rows padded like Qwen's
    mdir = os.path.join(args.out, "models")
    os.makedirs(mdir, exist_ok=True)
    configs = {
        # a Marco-style student: many small experts, few active
        "student": model_config(padded, 64, 2, 4, 2, 16, 2, 32),
        "teacher_small": model_config(padded, 96, 2, 4, 2, 8, 2, 96),
        "teacher_large": model_config(padded, 128, 4, 4, 2, 16, 4, 128),
    }
    if args.scale == "mini":  # fewer layers and experts: the same width at a fraction of the cost
        configs["teacher_large"] = model_config(padded, 128, 2, 4, 2, 8, 2, 128)
    for name, cfg in configs.items():
        with open(os.path.join(mdir, f"{name}.json"), "w") as f:
            json.dump(cfg, f, indent=2)
    print(json.dumps({"tokenizer_vocab": vocab, "model_vocab": padded, "out": args.out}))


if __name__ == "__main__":
    main()
