#!/usr/bin/env python3
"""Inputs for the SFT tests (tests/sft_test.cc) and the tiny SFT demo (configs/sft/tiny.yaml).

Writes, under --out:
  tokenizer/tokenizer.json   a byte-level BPE (256 bytes + merges, 300 ids) trained with the
                             `tokenizers` library on the corpus below, with the ChatML specials
                             <|endoftext|> (0), <|im_start|> (1), <|im_end|> (2)
  tokenizer/tokenizer_config.json  so that transformers' AutoTokenizer loads it, ChatML template
  data/train.jsonl           synthetic chat conversations ({"messages": [...]})
  data/eval.jsonl            held-out conversations of the same task
The task is learnable by a tiny model in a few hundred steps: each conversation asks for facts
from a fixed table (the colour of a fruit, a word repeated, a small sum), phrased a few ways, with
an optional system message. Deterministic (fixed seed).
"""
import argparse
import json
import os
import random

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 300  # the tiny student (configs/sft/tiny_model.json) has 320 rows: larger, on purpose

FRUITS = {
    "apple": "red", "banana": "yellow", "lime": "green", "plum": "purple", "orange": "orange",
    "cherry": "red", "lemon": "yellow", "kiwi": "brown", "grape": "purple", "pear": "green",
    "coconut": "brown", "blueberry": "blue", "mango": "orange", "fig": "purple",
}
WORDS = ["sun", "moon", "star", "tree", "rock", "bird", "fish", "rain", "snow", "wind", "fire", "leaf"]
SYSTEMS = ["You are a helpful assistant.", "Answer briefly."]


def conversation(rng):
    kind = rng.randrange(3)
    if kind == 0:
        fruit = rng.choice(sorted(FRUITS))
        q = rng.choice(["What color is the {f}?", "Tell me the color of the {f}.", "{f} color?"]).format(f=fruit)
        a = f"The {fruit} is {FRUITS[fruit]}."
    elif kind == 1:
        w = rng.choice(WORDS)
        n = rng.randint(2, 3)
        q = rng.choice(["Say {w} {n} times.", "Repeat {w} {n} times."]).format(w=w, n=n)
        a = " ".join([w] * n)
    else:
        x, y = rng.randint(0, 9), rng.randint(0, 9)
        q = rng.choice(["What is {x} plus {y}?", "Add {x} and {y}."]).format(x=x, y=y)
        a = f"{x} + {y} = {x + y}"
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    messages.append({"role": "user", "content": q})
    messages.append({"role": "assistant", "content": a})
    if rng.random() < 0.25:  # a second turn now and then
        messages.append({"role": "user", "content": "Thanks!"})
        messages.append({"role": "assistant", "content": "You are welcome."})
    return {"messages": messages}


def chatml(messages):
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def train_tokenizer(texts, out_dir):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                   "pad_token": "<|endoftext|>", "chat_template": template}, f, indent=2)
    assert tok.get_vocab_size() <= VOCAB_SIZE, tok.get_vocab_size()
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, s


def write_jsonl(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--eval", type=int, default=100)
    args = ap.parse_args()
    rng = random.Random(1234)
    train = [conversation(rng) for _ in range(args.train)]
    held_out = [conversation(rng) for _ in range(args.eval)]
    train_tokenizer([chatml(c["messages"]) for c in train], os.path.join(args.out, "tokenizer"))
    write_jsonl(os.path.join(args.out, "data", "train.jsonl"), train)
    write_jsonl(os.path.join(args.out, "data", "eval.jsonl"), held_out)
    print(f"wrote the SFT fixtures to {args.out}")


if __name__ == "__main__":
    main()
