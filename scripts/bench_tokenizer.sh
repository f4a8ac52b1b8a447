#!/usr/bin/env bash
# Tokenizer throughput, ours against Hugging Face `tokenizers` (Rust), one thread each, on the same
# multilingual corpus (tests/data/tokenizer_corpus.jsonl replicated to about --mb megabytes).
# Builds nothing: pass the build directory that holds bench/bench_tokenizer.
#
#   scripts/bench_tokenizer.sh BUILD_DIR [--mb 8] [--iters 3] [--tokenizer DIR]
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${1:?usage: scripts/bench_tokenizer.sh BUILD_DIR [--mb N] [--iters N] [--tokenizer DIR]}
shift
MB=8
ITERS=3
TOKENIZER=../shared/tokenizers/qwen2
while (($#)); do
  case "$1" in
    --mb) MB=$2; shift 2 ;;
    --iters) ITERS=$2; shift 2 ;;
    --tokenizer) TOKENIZER=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
PY=${OPD_PYTHON:-.venv/bin/python}
BENCH="$BUILD_DIR/bench/bench_tokenizer"
[ -x "$BENCH" ] || { echo "no $BENCH: build the bench_tokenizer target first" >&2; exit 1; }

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
CORPUS="$WORK/corpus.jsonl"

# Documents of ~4 KB made of corpus samples in a shuffled order, so that both sides see realistic
# document sizes (and the per-call overhead of Python is negligible).
"$PY" - "$MB" "$CORPUS" <<'EOF'
import json, random, sys
target = int(float(sys.argv[1]) * 1e6)
samples = [json.loads(l)["text"] for l in open("tests/data/tokenizer_corpus.jsonl", encoding="utf-8")]
rng = random.Random(0)
size, doc = 0, []
with open(sys.argv[2], "w", encoding="utf-8") as f:
    while size < target:
        doc.append(rng.choice(samples))
        if sum(len(s.encode()) for s in doc) >= 4096:
            text = "\n".join(doc)
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            size += len(text.encode())
            doc = []
EOF

echo "== ours (C++, one thread)"
OURS=$("$BENCH" --tokenizer "$TOKENIZER" --corpus "$CORPUS" --iters "$ITERS")
echo "$OURS"

echo "== Hugging Face tokenizers (Rust), one thread"
# encode() on a single string runs on the calling thread; RAYON_NUM_THREADS=1 makes sure.
THEIRS=$(RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false "$PY" - "$TOKENIZER" "$CORPUS" "$ITERS" <<'EOF'
import json, sys, time
sys.path.insert(0, "tests/python")
from tokenizer_reference import load_rust
tok = load_rust(sys.argv[1])
docs = [json.loads(l)["text"] for l in open(sys.argv[2], encoding="utf-8")]
iters = int(sys.argv[3])
nbytes = sum(len(d.encode()) for d in docs)
tokens = sum(len(tok.encode(d, add_special_tokens=False).ids) for d in docs)  # warm-up pass
start = time.perf_counter()
for _ in range(iters):
    for d in docs:
        tok.encode(d, add_special_tokens=False)
seconds = time.perf_counter() - start
print(f"docs={len(docs)} bytes={nbytes} tokens={tokens} iters={iters} seconds={seconds:.3f}")
print(f"rust MB/s={nbytes * iters / 1e6 / seconds:.2f}")
EOF
)
echo "$THEIRS"

OURS_MBS=$(sed -n 's/^opd MB\/s=//p' <<<"$OURS")
RUST_MBS=$(sed -n 's/^rust MB\/s=//p' <<<"$THEIRS")
OURS_TOK=$(sed -n 's/.*tokens=\([0-9]*\).*/\1/p' <<<"$OURS" | head -1)
RUST_TOK=$(sed -n 's/.*tokens=\([0-9]*\).*/\1/p' <<<"$THEIRS" | head -1)
[ "$OURS_TOK" = "$RUST_TOK" ] || echo "WARNING: token counts differ ($OURS_TOK vs $RUST_TOK)"
"$PY" -c "print(f'ratio ours/rust = {float($OURS_MBS) / float($RUST_MBS):.2f}x  (ours {float($OURS_MBS):.2f} MB/s, rust {float($RUST_MBS):.2f} MB/s)')"
