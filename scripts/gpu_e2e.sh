#!/usr/bin/env bash
# The job end to end on one GPU, at the demo's miniature scale: scripts/demo/make_task.py's task,
# a few SFT steps of the student on cuda:0 (bf16-mixed), then cascaded OPD with two opd-teacher
# processes and one opd-rollout (paged engine) on cuda:0 in bf16 and the learner there in
# bf16-mixed, two stages of 3 steps. Checks that every process did its part: the SFT's summary,
# both OPD stages in summary.json, every step's reverse KL finite, the rollout serving the last
# pushed weights. Prints one line per step and stops every process it started.
#
#   scripts/gpu_e2e.sh BUILD_DIR WORK_DIR      (BUILD_DIR: a build tree or an unpacked GPU payload)
#
# scripts/gpu_check.sh --payload runs it as its last step; OPD_PYTHON: a python3 with `tokenizers`;
# OPD_E2E_DEVICE (default cuda): the device of every process (cpu checks the script itself).
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -eq 2 ]] || { echo "usage: scripts/gpu_e2e.sh BUILD_DIR WORK_DIR" >&2; exit 2; }
BUILD=$(realpath "$1") W=$2 PY=${OPD_PYTHON:-python3} DEV=${OPD_E2E_DEVICE:-cuda}
CTL=$BUILD/ctl/opd-ctl TRAINER=$BUILD/trainer/opd-trainer
rm -rf "$W" && mkdir -p "$W/logs"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]:-}"; do [[ -n "$pid" ]] && kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]:-}"; do [[ -n "$pid" ]] && wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
fail() {
  echo "gpu_e2e: $*" >&2
  for f in "$W"/logs/*.log; do echo "--- $f (last lines)"; tail -n 15 "$f"; done >&2
  exit 1
}
START=$(date +%s)
t() { echo "$(($(date +%s) - START))s"; }

"$PY" scripts/demo/make_task.py --out "$W/task" --scale mini --teacher-examples 800 --prompts 256 \
  --eval 32 >"$W/logs/task.log" 2>&1 || fail "make_task.py"
T=$W/task
for m in student:1 teacher_small:2 teacher_large:3; do
  "$CTL" init-model --config "$T/models/${m%%:*}.json" --out "$W/init/${m%%:*}" \
    --tokenizer "$T/tokenizer" --seed "${m#*:}" --std 0.05 >>"$W/logs/init.log" 2>&1 || fail "init-model"
done

"$TRAINER" sft --config configs/demo/sft.yaml --set run.dir="$W/sft" \
  --set model.path="$W/init/student" --set "data.train=[{files: [$T/sft_student.jsonl]}]" \
  --set "data.eval=[{files: [$T/heldout.jsonl]}]" --set train.max_steps=6 --set eval.every=6 \
  --set logging.log_every=1 --set run.resume=never --set train.device=$DEV \
  --set checkpoint.every=6 >"$W/logs/sft.log" 2>&1 || fail "SFT on $DEV"
[[ -f "$W/sft/summary.json" ]] || fail "SFT wrote no summary.json"
STUDENT=$(ls -d "$W"/sft/checkpoints/step_*/model | sort | tail -1)
echo "SFT on $DEV: 6 steps, $(grep -c '"train/loss"' "$W/sft/metrics.jsonl" || true) logged, t=$(t)"

umask 077
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$W/secret"
umask 022
serve() {  # name, binary, model
  "$2" --model "$3" --listen 127.0.0.1:0 --port-file "$W/$1.port" --secret-file "$W/secret" \
    --device "$DEV" >"$W/logs/$1.log" 2>&1 &
  PIDS+=($!)
}
serve teacher_small "$BUILD/teacher_service/opd-teacher" "$W/init/teacher_small"
serve teacher_large "$BUILD/teacher_service/opd-teacher" "$W/init/teacher_large"
serve rollout "$BUILD/rollout/opd-rollout" "$STUDENT"
for f in teacher_small teacher_large rollout; do
  for _ in $(seq 600); do [[ -s "$W/$f.port" ]] && break; sleep 0.1; done
  [[ -s "$W/$f.port" ]] || fail "$f did not start"
done
echo "servers on $DEV: teachers :$(cat "$W/teacher_small.port") :$(cat "$W/teacher_large.port"), rollout :$(cat "$W/rollout.port"), t=$(t)"

"$TRAINER" opd --config configs/demo/opd.yaml --set run.dir="$W/opd" --set model.path="$STUDENT" \
  --set "prompts.sources=[{files: [$T/opd_prompts.jsonl]}]" \
  --set "rollout.endpoints=[127.0.0.1:$(cat "$W/rollout.port")]" \
  --set "stages.0.teachers=[127.0.0.1:$(cat "$W/teacher_small.port")]" \
  --set "stages.1.teachers=[127.0.0.1:$(cat "$W/teacher_large.port")]" \
  --set stages.0.max_steps=3 --set stages.1.max_steps=3 --set stages.0.plateau.enabled=false \
  --set train.prompts_per_step=32 --set logging.log_every=1 --set train.device=$DEV \
  --set auth.secret_file="$W/secret" --set run.resume=never >"$W/logs/opd.log" 2>&1 ||
  fail "OPD on $DEV"
"$PY" - "$W/opd" <<'EOF' || fail "OPD results"
import json, math, sys
run = sys.argv[1]
summary = json.load(open(f"{run}/summary.json"))
stages = summary["stages"]
assert len(stages) == 2, f"{len(stages)} stages in summary.json"
rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if "opd/reverse_kl" in l]
assert len(rows) == 6, f"{len(rows)} steps logged, expected 6"
for r in rows:
    assert math.isfinite(r["opd/reverse_kl"]), r
    print(" ".join(f"{k}={r[k]:.4g}" if isinstance(r[k], float) else f"{k}={r[k]}"
                   for k in sorted(r) if k in ("step", "opd/stage", "opd/reverse_kl",
                                               "time/step_s", "time/sample_s", "time/score_s",
                                               "time/learn_s", "opd/weight_version",
                                               "opd/sampler_learner_abs_diff")))
print("stages:", json.dumps(stages))
EOF
echo "OPD on $DEV: 2 stages x 3 steps, t=$(t)"
