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


# Protocol buffers wire format, by hand (the seeds of the request validators' fuzzers are
# serialized opd.v1 messages; see proto/opd/v1/*.proto for the field numbers).
def varint(v):
    v &= (1 << 64) - 1  # negative int32/int64 travel as ten-byte two's complement
    out = b""
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def pb_int(field, v):
    return varint(field << 3) + varint(v)


def pb_bytes(field, data):
    data = data.encode() if isinstance(data, str) else data
    return varint(field << 3 | 2) + varint(len(data)) + data


def pb_packed(field, values):
    return pb_bytes(field, b"".join(varint(v) for v in values))


def pb_float(field, v):
    return varint(field << 3 | 5) + struct.pack("<f", v)


def pb_fixed64(field, v):
    return varint(field << 3 | 1) + struct.pack("<Q", v)


def score_request(seqs, temperature=None, top_k=None):
    """seqs: (tokens, response_start) pairs."""
    out = b"".join(pb_bytes(1, pb_packed(1, t) + pb_int(2, start)) for t, start in seqs)
    if temperature is not None:
        out += pb_float(2, temperature)
    if top_k is not None:
        out += pb_int(3, top_k)
    return out


def generate_request(prompts, samples=None, temperature=None, top_p=None, top_k=None,
                     max_new=None, stop=None, seed=None, routing=False, seed_indices=None):
    params = b""
    if temperature is not None:
        params += pb_float(1, temperature)
    if top_p is not None:
        params += pb_float(2, top_p)
    if top_k is not None:
        params += pb_int(3, top_k)
    if max_new is not None:
        params += pb_int(4, max_new)
    if stop:
        params += pb_packed(5, stop)
    if seed is not None:
        params += pb_int(6, seed)
    seed_indices = seed_indices or [None] * len(prompts)
    out = b"".join(pb_bytes(1, pb_packed(1, p) + (b"" if i is None else pb_int(2, i)))
                   for p, i in zip(prompts, seed_indices))
    if samples is not None:
        out += pb_int(2, samples)
    out += pb_bytes(3, params)
    if routing:
        out += pb_int(4, 1)
    return out


def manifest_dtype(dt):
    """A dtype by name (string field 3, as older senders write it), by enum (field 5, an int),
    or both ((enum, name))."""
    if isinstance(dt, int):
        return pb_int(5, dt)
    if isinstance(dt, tuple):
        return pb_int(5, dt[0]) + pb_bytes(3, dt[1])
    return pb_bytes(3, dt)


def weight_chunk(tensors, base_version=None, version=1, name="", data=b""):
    """The first chunk of an UpdateWeights stream; tensors: (name, shape, dtype, checksum)."""
    manifest = b"".join(pb_bytes(1, pb_bytes(1, n) + pb_packed(2, shape) + manifest_dtype(dt) +
                                 pb_fixed64(4, ck)) for n, shape, dt, ck in tensors)
    if base_version is not None:
        manifest += pb_int(2, base_version)
    out = pb_int(1, version)
    if name:
        out += pb_bytes(2, name) + pb_bytes(6, data)
    return out + pb_bytes(7, manifest)


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

    # The limits the fuzzers check against: vocabulary 1000, sequences of at most 64 tokens.
    t = "score_request_fuzzer"
    write(t, "valid", score_request([([1, 2, 3, 4], 2), ([7, 8], 1)]))
    write(t, "top_k", score_request([(list(range(10, 30)), 5)], temperature=0.7, top_k=8))
    write(t, "stream_chunks", score_request([(list(range(40)), 1)] * 6, top_k=2))
    write(t, "reply_too_big", score_request([(list(range(64)), 1)] * 4, top_k=16))
    write(t, "start_past_end", score_request([([1, 2], 3)]))
    write(t, "start_zero", score_request([([1, 2], 0)]))
    write(t, "id_outside", score_request([([5, 1000], 1)]))
    write(t, "negative_id", score_request([([5, -1], 1)]))
    write(t, "tiny_temperature", score_request([([1, 2], 1)], temperature=1e-5))
    write(t, "nan_temperature", score_request([([1, 2], 1)], temperature=float("nan")))
    write(t, "top_k_over", score_request([([1, 2], 1)], top_k=17))
    write(t, "empty", b"")
    write(t, "empty_sequence", score_request([([], 0)]))

    t = "generate_request_fuzzer"
    write(t, "valid", generate_request([[1, 2, 3], [4, 5]], samples=2, max_new=8, seed=7))
    write(t, "greedy_stop", generate_request([[9] * 10], temperature=0, max_new=16, stop=[2, 999]))
    write(t, "filters", generate_request([[1]], temperature=0.8, top_p=0.9, top_k=50, max_new=4,
                                         routing=True))
    write(t, "many_sequences", generate_request([[1] * 40] * 4, samples=8, max_new=20))
    write(t, "seed_index", generate_request([[1, 2], [3]], max_new=4, seed_indices=[7, None]))
    write(t, "negative_seed_index", generate_request([[1, 2]], max_new=4, seed_indices=[-1]))
    write(t, "too_many_slots", generate_request([[1]] * 5, samples=8, max_new=1))
    write(t, "too_long", generate_request([[1] * 60], max_new=8))
    write(t, "no_max_new", generate_request([[1, 2]]))
    write(t, "bad_stop", generate_request([[1, 2]], max_new=2, stop=[1000]))
    write(t, "bad_temperature", generate_request([[1, 2]], temperature=-1.0, max_new=2))
    write(t, "bad_top_p", generate_request([[1, 2]], top_p=1.5, max_new=2))
    write(t, "negative_id", generate_request([[3, -7]], max_new=2))
    write(t, "empty_prompt", generate_request([[]], max_new=2))
    write(t, "no_prompts", generate_request([], max_new=2))

    # The fuzzer's model: model.embed_tokens.weight [64, 8], model.layers.0.self_attn.q_proj.weight
    # [8, 8], model.layers.0.mlp.experts.gate_up_proj [2, 16, 8], model.norm.weight [8],
    # lm_head.weight [64, 8], scale [], empty [0, 8].
    t = "weight_manifest_fuzzer"
    embed, norm = "model.embed_tokens.weight", "model.norm.weight"
    write(t, "valid", weight_chunk([(embed, [64, 8], "bfloat16", 0x1234),
                                    (norm, [8], "float32", 0xFFFFFFFFFFFFFFFF),
                                    ("scale", [], "float16", 0), ("empty", [0, 8], "float32", 5)],
                                   base_version=3))
    write(t, "with_data", weight_chunk([("model.layers.0.mlp.experts.gate_up_proj", [2, 16, 8],
                                         "float32", 1)], name=norm, data=b"\0" * 32))
    write(t, "empty_manifest", weight_chunk([], base_version=0))
    write(t, "unknown_name", weight_chunk([(norm, [8], "float32", 0), ("nope", [8], "float32", 0)]))
    write(t, "twice", weight_chunk([(norm, [8], "float32", 0), (norm, [8], "float32", 0)]))
    write(t, "bad_shape", weight_chunk([("lm_head.weight", [8, 64], "float32", 0)]))
    write(t, "bad_dtype", weight_chunk([("lm_head.weight", [64, 8], "int8", 0)]))
    write(t, "negative_dim", weight_chunk([("empty", [0, -8], "float32", 0)]))
    # opd.v1.WireDtype: 1 float32, 2 bfloat16, 3 float16; the enum wins over the name.
    write(t, "enum_dtype", weight_chunk([(embed, [64, 8], 2, 7), (norm, [8], (1, "float32"), 8),
                                         ("scale", [], 3, 9)]))
    write(t, "enum_over_name", weight_chunk([(norm, [8], (2, "int8"), 0)]))
    write(t, "unknown_enum", weight_chunk([(norm, [8], "float32", 0), ("scale", [], 9, 0)]))


if __name__ == "__main__":
    main()
