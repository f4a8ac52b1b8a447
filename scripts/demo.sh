#!/usr/bin/env bash
# The main job on its built-in default: the whole pipeline on CPU, end to end.
#
#   1. a procedurally generated task with checkable answers (integer addition in chat format)
#   2. SFT trains two teachers of different strength and briefly a small Marco-style MoE student
#   3. two opd-teacher processes and one opd-rollout process start (loopback, shared secret)
#   4. cascaded OPD: stage 1 with the weaker teacher until its reverse KL plateaus, then stage 2
#      with the stronger one, switching automatically
#   5. a Table-12-style report: accuracy (sampled at temperature 1.0) and reverse KL after SFT,
#      after stage 1 and after stage 2, next to both teachers; report.json, PNG plots, TensorBoard
# Every process started here is stopped at the end, also on Ctrl-C.
#   RUN=runs/demo ./scripts/demo.sh        (re-running reuses finished SFT models)
# DEMO_SCALE=mini runs the miniature the test suite checks (a smaller stronger teacher, shorter
# SFT and stages; a few minutes). BUILD=DIR uses binaries already built there (no set-up/build).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/demo}
SCALE=${DEMO_SCALE:-full}
PY=.venv/bin/python
if [ -z "${BUILD:-}" ]; then
  BUILD=build
  ./scripts/setup.sh
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null 2>&1
  cmake --build build -j"$(nproc)" --target opd-trainer opd-ctl opd-teacher opd-rollout
fi
CTL=$BUILD/ctl/opd-ctl
TRAINER=$BUILD/trainer/opd-trainer
# SFT steps of the weaker teacher, the stronger teacher and the student; changes to the task and
# to configs/demo/opd.yaml.
case $SCALE in
  full) SFT_STEPS=(220 400 120) TASK_ARGS=() OPD_SET=() ;;
  mini) SFT_STEPS=(220 300 120) TASK_ARGS=(--scale mini --teacher-examples 8000 --prompts 2000 --eval 128)
        OPD_SET=() ;;
  *) echo "DEMO_SCALE must be full or mini, not '$SCALE'"; exit 2 ;;
esac
mkdir -p "$RUN/logs"
log() { printf '\n== %s ==\n' "$*"; }

PIDS=()
cleanup() {
  for pid in "${PIDS[@]:-}"; do [ -n "$pid" ] && kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]:-}"; do [ -n "$pid" ] && wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'echo "interrupted"; exit 130' INT TERM

log "task data, tokenizer and model configs"
$PY scripts/demo/make_task.py --out "$RUN/task" "${TASK_ARGS[@]}"
T=$RUN/task

final_model() { ls -d "$1"/checkpoints/step_*/model | sort | tail -1; }

sft() {  # name, config json, training file, steps, seed
  local name=$1 cfg=$2 data=$3 steps=$4 seed=$5
  local dir=$RUN/sft/$name
  if ls -d "$dir"/checkpoints/step_*/model >/dev/null 2>&1 && [ -f "$dir/summary.json" ]; then
    echo "$name: already trained ($(final_model "$dir"))"
    return
  fi
  $CTL init-model --config "$cfg" --out "$RUN/init/$name" --tokenizer "$T/tokenizer" --seed "$seed" --std 0.05
  $TRAINER sft --config configs/demo/sft.yaml --set run.dir="$dir" --set model.path="$RUN/init/$name" \
    --set "data.train=[{files: [$data]}]" --set "data.eval=[{files: [$T/heldout.jsonl]}]" \
    --set train.max_steps="$steps" --set run.resume=never 2>&1 | tee "$RUN/logs/sft_$name.log" | grep -E "held-out|done|error" || true
  [ -f "$dir/summary.json" ] || { echo "SFT of $name failed: see $RUN/logs/sft_$name.log"; exit 1; }
}

log "SFT: the weaker teacher, the stronger teacher, and (briefly) the student"
sft teacher_small "$T/models/teacher_small.json" "$T/sft_teacher.jsonl" "${SFT_STEPS[0]}" 11
sft teacher_large "$T/models/teacher_large.json" "$T/sft_teacher.jsonl" "${SFT_STEPS[1]}" 12
sft student "$T/models/student.json" "$T/sft_student.jsonl" "${SFT_STEPS[2]}" 13
TS=$(final_model "$RUN/sft/teacher_small"); TL=$(final_model "$RUN/sft/teacher_large"); ST=$(final_model "$RUN/sft/student")

log "services: two teachers and one rollout worker on loopback"
umask 077
[ -f "$RUN/secret" ] || head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$RUN/secret"
umask 022
start() {  # name, binary, model
  rm -f "$RUN/$1.port"
  "$2" --model "$3" --listen 127.0.0.1:0 --port-file "$RUN/$1.port" --secret-file "$RUN/secret" --threads 1 \
    >"$RUN/logs/$1.log" 2>&1 &
  PIDS+=($!)
}
start teacher_small "$BUILD/teacher_service/opd-teacher" "$TS"
start teacher_large "$BUILD/teacher_service/opd-teacher" "$TL"
start rollout "$BUILD/rollout/opd-rollout" "$ST"
for f in teacher_small teacher_large rollout; do
  for _ in $(seq 300); do [ -s "$RUN/$f.port" ] && break; sleep 0.1; done
  [ -s "$RUN/$f.port" ] || { echo "$f did not start: see $RUN/logs/$f.log"; exit 1; }
done
EP_TS=127.0.0.1:$(cat "$RUN/teacher_small.port")
EP_TL=127.0.0.1:$(cat "$RUN/teacher_large.port")
EP_RO=127.0.0.1:$(cat "$RUN/rollout.port")
echo "teacher (small) $EP_TS, teacher (large) $EP_TL, rollout $EP_RO"

log "cascaded on-policy distillation"
rm -rf "$RUN/opd"
$TRAINER opd --config configs/demo/opd.yaml "${OPD_SET[@]}" --set run.dir="$RUN/opd" --set model.path="$ST" \
  --set "prompts.sources=[{files: [$T/opd_prompts.jsonl]}]" --set "rollout.endpoints=[$EP_RO]" \
  --set "stages.0.teachers=[$EP_TS]" --set "stages.1.teachers=[$EP_TL]" --set auth.secret_file="$RUN/secret" \
  2>&1 | tee "$RUN/logs/opd.log" | grep -vE "^\s*$" | grep -E "stage|done|error|step [0-9]+/" || true
[ -f "$RUN/opd/summary.json" ] || { echo "OPD failed: see $RUN/logs/opd.log"; exit 1; }

log "evaluation (sampled at temperature 1.0) and report"
S1_STEP=$($PY -c "import json,sys; print(json.load(open('$RUN/opd/summary.json'))['stages'][0]['end_step'])")
S2_STEP=$($PY -c "import json,sys; print(json.load(open('$RUN/opd/summary.json'))['stages'][-1]['end_step'])")
S1=$RUN/opd/checkpoints/$(printf 'step_%06d' "$S1_STEP")/model
S2=$RUN/opd/checkpoints/$(printf 'step_%06d' "$S2_STEP")/model
for m in "student_sft:$ST" "student_stage1:$S1" "student_stage2:$S2" "teacher_small:$TS" "teacher_large:$TL"; do
  name=${m%%:*}; dir=${m#*:}
  $CTL eval --model "$dir" --tokenizer "$T/tokenizer" --prompts "$T/eval_prompts.jsonl" --samples 2 \
    --temperature 1.0 --max-new-tokens 8 --teachers "$TS,$TL" --threads 2 2>/dev/null > "$RUN/eval_$name.json"
done
$PY scripts/demo/report.py --run "$RUN" --teacher-small "$TS" --teacher-large "$TL"

log "checks: reverse KL falls in each stage, stages end by their rule, accuracy above post-SFT"
$PY scripts/demo/check_run.py --run "$RUN"
