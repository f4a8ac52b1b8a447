#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (fuzz/corpus/TARGET/*). The seeds are committed;
this script documents where they came from and regenerates them (standard library only)."""
import json
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def safetensors(tensors, metadata=None, raw_header=None):
    header, data, offset = {}, b"", 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, payload in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(payload)]}
        data += payload
        offset += len(payload)
    text = raw_header if raw_header is not None else json.dumps(header, separators=(",", ":"))
    text += " " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text.encode() + data


def byte_level():
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    spelled, n = {}, 0
    for b in range(256):
        if b in printable:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + n)
            n += 1
    return spelled


def tokenizer_json(merges_as_lists=False, split_regex=False, ignore_merges=False, added=True):
    bl = byte_level()
    vocab = {bl[b]: b for b in range(256)}
    extra = ["he", "ll", "hell", bl[32] + "h", "wo", "wor", "worl", "world"]
    for i, t in enumerate(extra):
        vocab[t] = 256 + i
    merges = ["h e", "l l", "he ll", bl[32] + " h", "w o", "wo r", "wor l", "worl d"]
    if merges_as_lists:
        merges = [m.split(" ") for m in merges]
    j = {
        "version": "1.0",
        "added_tokens": [
            {"id": 300, "content": "<|im_start|>", "special": True},
            {"id": 301, "content": "<|im_end|>", "special": True},
            {"id": 302, "content": "<think>", "special": False},
        ] if added else [],
        "normalizer": {"type": "NFC"},
        "model": {"type": "BPE", "dropout": None, "vocab": vocab, "merges": merges,
                  "ignore_merges": ignore_merges},
    }
    if split_regex:
        pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
                   r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
        j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    else:
        j["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    return json.dumps(j, ensure_ascii=False)


def main():
    shutil.rmtree(os.path.join(HERE, "corpus"), ignore_errors=True)

    t = "safetensors_header_fuzzer"
    f32 = struct.pack("<6f", 0, 1.5, -2.25, 3, 0.125, -7)
    write(t, "valid", safetensors([("a", "F32", [2, 3], f32), ("b", "F16", [2], b"\x00\x3c\x00\xc0"),
                                   ("c", "BF16", [2], b"\x80\x3f\x00\xc0"), ("s", "F32", [], f32[:4]),
                                   ("e", "F32", [0, 3], b"")], {"format": "pt"}))
    write(t, "metadata_only", safetensors([], {"format": "pt", "k": "v"}))
    write(t, "overlap", safetensors([], raw_header='{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                                     '"b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}}') + b"\0" * 8)
    write(t, "unknown_dtype", safetensors([("x", "I64", [1], b"\0" * 8)]))
    write(t, "truncated", safetensors([("a", "F32", [2, 3], f32)])[:-5])

    t = "checkpoint_index_fuzzer"
    wm = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
          "model.layers.0.mlp.experts.0.gate_proj.weight": "model-00001-of-00002.safetensors",
          "lm_head.weight": "model-00002-of-00002.safetensors"}
    write(t, "valid", json.dumps({"metadata": {"total_size": 123456}, "weight_map": wm}, indent=2))
    write(t, "subdir", json.dumps({"weight_map": {"a": "shards/a.safetensors", "b": "./b.safetensors"}}))
    write(t, "dotdot", json.dumps({"weight_map": {"a": "../outside.safetensors"}}))
    write(t, "absolute", json.dumps({"weight_map": {"a": "/etc/passwd"}}))
    write(t, "not_string", json.dumps({"weight_map": {"a": 7, "b": None}}))
    write(t, "no_map", json.dumps({"metadata": {}}))

    t = "tokenizer_json_fuzzer"
    write(t, "bytelevel", tokenizer_json() + "\0hello world<|im_start|>user\nhi<|im_end|> hell")
    write(t, "split_regex", tokenizer_json(split_regex=True) + "\0Hello, world! 123 <think>x</think>\r\n\n  ")
    write(t, "merge_lists_ignore_merges", tokenizer_json(merges_as_lists=True, ignore_merges=True) +
          "\0world hello \u4e2d\u6587")
    write(t, "no_added", tokenizer_json(added=False))
    write(t, "bad_id", tokenizer_json().replace('"id": 300', '"id": -3'))
    # Regression: \C in the pre-tokenizer regex ended matches mid-character (heap over-read).
    split = json.loads(tokenizer_json(split_regex=True))
    split["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"a\C|"
    write(t, "regression_backslash_c", json.dumps(split) + "\0x a\u00e9")

    t = "jsonl_fuzzer"
    rows = [
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "<think>\n</think>\n\nhello"}]},
        {"messages": [{"role": "user", "content": "only a prompt"}], "answer": "x"},
    ]
    write(t, "chat", "\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n")
    write(t, "mixed", json.dumps(rows[0]) + "\r\n\n   \n{not json\n[1,2]\n" +
          json.dumps({"messages": [{"role": "assistant", "content": "x"}]}) + "\n\xff\n")

    t = "yaml_config_fuzzer"
    for sub in ("sft", "opd", "demo"):
        d = os.path.join(ROOT, "configs", sub)
        for name in sorted(os.listdir(d)):
            if name.endswith(".yaml"):
                with open(os.path.join(d, name), "rb") as f:
                    write(t, f"{sub}_{name[:-5]}", f.read())
    write(t, "with_overrides", "model: {path: m}\n\0train.max_steps=5\noptim.lr=[1, 2]\nstages.0.name=x\n")
    write(t, "anchors", "a: &x {lr: 1.0}\noptim: *x\ntrain: {max_steps: 1e3}\n")


if __name__ == "__main__":
    main()
