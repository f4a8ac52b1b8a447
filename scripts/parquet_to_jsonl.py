#!/usr/bin/env python3
"""Convert Parquet / Hugging Face datasets files into our JSON-lines chat format.

Inputs: .parquet files, .arrow files (what `datasets` writes in its cache and with save_to_disk),
or directories holding either (read in name order). Output, one line per row:

  --format sft      {"messages": [{"role": ..., "content": ...}, ...]}
  --format prompt   {"messages": [...]} without a final assistant turn, or {"prompt": ...},
                    plus "domain" and "answer" when asked for

Columns: a chat column (--messages-column, default "messages"; ShareGPT style
[{"from": "human", "value": ...}] is mapped to roles), or prompt/response style columns
(--prompt-column, --response-column, optional --system-column). Rows are written as they are;
the C++ readers validate them (and report bad lines by file:line). Needs only pyarrow.

Examples:
  parquet_to_jsonl.py train.parquet --out sft.jsonl
  parquet_to_jsonl.py data/ --prompt-column question --response-column answer --out sft.jsonl
  parquet_to_jsonl.py gsm8k.parquet --format prompt --prompt-column question \\
      --answer-column answer --domain math --out prompts.jsonl
"""
import argparse
import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "model": "assistant", "bot": "assistant"}


def input_files(paths):
    files = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(os.path.join(p, f) for f in os.listdir(p)
                           if f.endswith((".parquet", ".arrow")))
            if not found:
                sys.exit(f"{p}: no .parquet or .arrow files")
            files += found
        elif os.path.isfile(p):
            files.append(p)
        else:
            sys.exit(f"no such file or directory: {p}")
    return files


def read_table(path):
    if path.endswith(".parquet"):
        return pq.read_table(path)
    with pa.memory_map(path) as source:  # datasets writes the IPC stream format
        try:
            return pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            return pa.ipc.open_file(source).read_all()


def all_rows(files):
    for path in files:
        for batch in read_table(path).to_batches():
            yield from batch.to_pylist()


def chat_messages(raw):
    """A chat column value -> [{"role", "content"}], mapping ShareGPT's from/value."""
    out = []
    for m in raw or []:
        if "role" in m and m.get("role") is not None:
            out.append({"role": m["role"], "content": m.get("content")})
        else:
            role = SHAREGPT_ROLES.get(str(m.get("from", "")).lower(), m.get("from"))
            out.append({"role": role, "content": m.get("value")})
    return out


def convert_row(row, args):
    if args.prompt_column:
        messages = []
        if args.system_column and row.get(args.system_column):
            messages.append({"role": "system", "content": row[args.system_column]})
        if args.format == "prompt" and not messages:
            out = {"prompt": row.get(args.prompt_column)}
        else:
            messages.append({"role": "user", "content": row.get(args.prompt_column)})
            if args.format == "sft":
                messages.append({"role": "assistant", "content": row.get(args.response_column)})
            out = {"messages": messages}
    else:
        if args.messages_column not in row:
            sys.exit(f"no column '{args.messages_column}' (columns: {sorted(row)}); "
                     "use --messages-column or --prompt-column")
        messages = chat_messages(row[args.messages_column])
        if args.format == "prompt" and messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        out = {"messages": messages}
    if args.format == "prompt":
        if args.domain_column and row.get(args.domain_column) is not None:
            out["domain"] = str(row[args.domain_column])
        elif args.domain:
            out["domain"] = args.domain
        if args.answer_column and row.get(args.answer_column) is not None:
            answer = row[args.answer_column]
            out["answer"] = answer if isinstance(answer, (str, int, float)) else str(answer)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help=".parquet/.arrow files or directories")
    ap.add_argument("--out", required=True, help="output .jsonl")
    ap.add_argument("--format", choices=("sft", "prompt"), default="sft")
    ap.add_argument("--messages-column", default="messages")
    ap.add_argument("--prompt-column")
    ap.add_argument("--response-column")
    ap.add_argument("--system-column")
    ap.add_argument("--domain", help="domain tag for every prompt")
    ap.add_argument("--domain-column")
    ap.add_argument("--answer-column")
    ap.add_argument("--limit", type=int, default=0, help="stop after this many rows")
    args = ap.parse_args()
    if args.format == "sft" and args.prompt_column and not args.response_column:
        ap.error("--format sft with --prompt-column needs --response-column")

    rows = 0
    with open(args.out, "w", encoding="utf-8") as out:
        for row in all_rows(input_files(args.inputs)):
            if args.limit and rows >= args.limit:
                break
            out.write(json.dumps(convert_row(row, args), ensure_ascii=False) + "\n")
            rows += 1
    print(f"wrote {rows} rows to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
