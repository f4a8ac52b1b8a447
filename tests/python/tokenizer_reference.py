#!/usr/bin/env python3
"""Reference token ids from Hugging Face `transformers` / `tokenizers` for the C++ parity test.

For the Qwen2 token set (the vocabulary directory as it ships) and the Qwen3 token set (the same
vocabulary plus Qwen3's added tokens 151646..151668), writes to --out:

  <set>_expected.jsonl   one line per sample: text, NFC(text), ids, decode(ids) with and without
                         special tokens
  <set>/tokenizer.json   the same tokenizer saved by the Rust library (tests the C++
                         tokenizer.json loader)
  <set>_added.json       its added tokens (id, content, special)
  <set>_decode.jsonl     random id sequences (split UTF-8 characters, added tokens, unknown ids)
                         and their decoded text, with and without special tokens

Samples are the corpus file's plus --random seeded random strings mixing many scripts, combining
marks, emoji and whitespace. Every id is checked twice here: transformers' AutoTokenizer and the
Rust tokenizer object must agree before anything is written.
"""
import argparse
import json
import os
import random
import sys
import unicodedata

from tokenizers import AddedToken, Tokenizer
from transformers import AutoTokenizer

# Qwen3's added tokens from id 151643, with the "special" flag Qwen3's tokenizer.json gives them.
QWEN3_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]
QWEN3_FIRST_ID = 151643


def load_hf(tokenizer_dir, qwen3=False):
    """The transformers tokenizer for the directory, optionally with Qwen3's added tokens."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if qwen3:
        for i, (content, special) in enumerate(QWEN3_ADDED):
            if content in tok.get_vocab():
                continue
            tok.add_tokens([AddedToken(content, special=special, normalized=False)],
                           special_tokens=special)
        for i, (content, special) in enumerate(QWEN3_ADDED):
            assert tok.convert_tokens_to_ids(content) == QWEN3_FIRST_ID + i, content
    return tok


def load_rust(tokenizer_dir, qwen3=False):
    """The bare Rust tokenizer (tokenizers.Tokenizer) that transformers builds for the directory."""
    return load_hf(tokenizer_dir, qwen3).backend_tokenizer


def random_samples(n, seed=1234):
    """Random strings over many scripts, with combining marks, emoji, digits and whitespace."""
    rng = random.Random(seed)
    ranges = [
        (0x20, 0x7E), (0x20, 0x7E), (0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x3FF),
        (0x400, 0x4FF), (0x530, 0x58F), (0x5D0, 0x5EA), (0x600, 0x6FF), (0x900, 0x97F),
        (0x980, 0x9FF), (0xB80, 0xBFF), (0xE00, 0xE7F), (0x1780, 0x17FF), (0x1100, 0x11FF),
        (0x2000, 0x206F), (0x20A0, 0x20BF), (0x2190, 0x22FF), (0x3000, 0x303F), (0x3040, 0x30FF),
        (0x4E00, 0x9FA5), (0xAC00, 0xD7A3), (0xFF00, 0xFFEF), (0x1F300, 0x1F64F),
        (0x1F900, 0x1F9FF), (0x1D400, 0x1D7FF),
    ]
    pieces = [" ", "  ", "\n", "\n\n", "\t", " \n", "'s", "'LL", "\u200d", "\ufe0f", "123",
              "<|im_end|>", "<think>", "<|endoftext|>"]
    out = []
    for _ in range(n):
        chars = []
        for _ in range(rng.randint(1, 60)):
            if rng.random() < 0.15:
                chars.append(rng.choice(pieces))
                continue
            lo, hi = rng.choice(ranges)
            cp = rng.randint(lo, hi)
            if unicodedata.category(chr(cp)) in ("Cn", "Cs", "Co"):
                continue  # unassigned: Unicode versions of the two libraries may differ
            chars.append(chr(cp))
        out.append({"tag": "random", "text": "".join(chars)})
    return out


def read_corpus(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_expected(hf, samples, path):
    rust = hf.backend_tokenizer
    with open(path, "w", encoding="utf-8") as f:
        for s in samples:
            text = s["text"]
            ids = hf.encode(text, add_special_tokens=False)
            rust_ids = rust.encode(text, add_special_tokens=False).ids
            if ids != rust_ids:
                sys.exit(f"transformers and tokenizers disagree on {text!r}")
            row = {
                "tag": s.get("tag", ""),
                "text": text,
                "nfc": unicodedata.normalize("NFC", text),
                "ids": ids,
                "decoded": hf.decode(ids, skip_special_tokens=False),
                "decoded_skip_special": hf.decode(ids, skip_special_tokens=True),
            }
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_decode_cases(hf, path, n=400, seed=99):
    """Random id sequences: many tokens are single bytes or cut characters, so most sequences hold
    invalid or incomplete UTF-8 that decode must replace exactly as the Rust library does."""
    rng = random.Random(seed)
    vocab_size = len(hf)
    byte_tokens = [hf.convert_tokens_to_ids(t) for t in hf.backend_tokenizer.get_vocab()
                   if len(t) == 1]
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            ids = []
            for _ in range(rng.randint(1, 30)):
                r = rng.random()
                if r < 0.5:
                    ids.append(rng.choice(byte_tokens))
                elif r < 0.9:
                    ids.append(rng.randrange(vocab_size - 30))
                elif r < 0.97:
                    ids.append(rng.randrange(QWEN3_FIRST_ID, vocab_size))
                else:
                    ids.append(vocab_size + rng.randrange(1000))  # unknown: skipped
            row = {"ids": ids,
                   "decoded": hf.decode(ids, skip_special_tokens=False),
                   "decoded_skip_special": hf.decode(ids, skip_special_tokens=True)}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokenizer", required=True, help="directory with vocab.json + merges.txt")
    ap.add_argument("--corpus", required=True, help="JSON lines with a 'text' field")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--random", type=int, default=500, help="number of random samples")
    args = ap.parse_args()

    samples = read_corpus(args.corpus) + random_samples(args.random)
    os.makedirs(args.out, exist_ok=True)
    for name, qwen3 in (("qwen2", False), ("qwen3", True)):
        hf = load_hf(args.tokenizer, qwen3)
        write_expected(hf, samples, os.path.join(args.out, f"{name}_expected.jsonl"))
        write_decode_cases(hf, os.path.join(args.out, f"{name}_decode.jsonl"))
        os.makedirs(os.path.join(args.out, name), exist_ok=True)
        hf.backend_tokenizer.save(os.path.join(args.out, name, "tokenizer.json"))
        added = json.loads(hf.backend_tokenizer.to_str())["added_tokens"]
        with open(os.path.join(args.out, f"{name}_added.json"), "w") as f:
            json.dump([{"id": a["id"], "content": a["content"], "special": a["special"]}
                       for a in added], f)
    print(f"wrote {len(samples)} samples per token set to {args.out}")


if __name__ == "__main__":
    main()
