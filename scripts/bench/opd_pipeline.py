#!/usr/bin/env python3
"""One OPD step, split into its parts, run two ways on the same inputs, side by side.

A fixed small setup: the demo's addition task (its tokenizer and prompts), a random demo-sized
student served by one opd-rollout and a random teacher served by one opd-teacher, on loopback.
`opd-trainer opd` runs --steps steps twice, each process with --threads threads:

  --compare pipeline (default)  phase by phase (train.pipeline: false: sample all, score all, learn
                                all) against the pipeline (each sample scored as it arrives, each
                                micro-batch learned as soon as it is scored);
  --compare async               synchronous against one-step-off (train.async).

From the runs' metrics.jsonl (steps after the first) it prints each phase's busy time (sampling,
scoring, learning, weight push), the step's wall time, time/overlap (the sum of the phases' busy
times over the step's: above 1 when phases ran at the same time) and the ratio of the step times.
The two runs train the same weights (the pipeline changes when work happens, not what it is). On a
machine with fewer cores than the processes use, the phases compete for the CPU: the overlap then
shows in time/overlap more than in the step time.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from service_util import new_secret, running_service  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARTS = ("sample_s", "score_s", "learn_s", "push_s")
MODES = {"pipeline": (("phase by phase", {"pipeline": False}), ("pipelined", {"pipeline": True})),
         "async": (("synchronous", {"async": False}), ("one-step-off", {"async": True}))}


def prepare(args, build):
    task = os.path.join(args.workdir, "opd_task")
    py = sys.executable
    subprocess.run([py, os.path.join(ROOT, "scripts/demo/make_task.py"), "--out", task, "--teacher-examples",
                    "2000", "--student-examples", "100", "--prompts", "2000"], check=True, stdout=subprocess.DEVNULL)
    ctl = os.path.join(build, "ctl", "opd-ctl")
    models = {}
    for name, seed in (("student", 1), ("teacher_large", 2)):
        out = os.path.join(args.workdir, "opd_" + name)
        if not os.path.exists(os.path.join(out, "config.json")):
            subprocess.run([ctl, "init-model", "--config", os.path.join(task, "models", name + ".json"), "--out", out,
                            "--tokenizer", os.path.join(task, "tokenizer"), "--seed", str(seed)], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        models[name] = out
    return task, models


def run(args, build, task, models, rollout, teacher, secret_file, name, train):
    run_dir = os.path.join(args.workdir, "opd_" + name.replace(" ", "_").replace("-", "_"))
    config = {
        "model": {"path": models["student"], "chat_format": "qwen3"},
        "prompts": {"sources": [{"files": [os.path.join(task, "opd_prompts.jsonl")]}], "max_prompt_len": 64},
        "rollout": {"endpoints": [rollout], "samples_per_prompt": 2, "max_new_tokens": args.new_tokens},
        "stages": [{"name": "bench", "teachers": [teacher], "max_steps": args.steps}],
        "train": {"prompts_per_step": args.prompts, "threads": args.threads, **args.train, **train},
        "optim": {"lr": 1e-4, "min_lr": 1e-4},
        "checkpoint": {"every": 0},
        "logging": {"log_every": 1000, "tensorboard": False},
        "auth": {"secret_file": secret_file},
        "run": {"dir": run_dir, "resume": "never"},
    }
    os.makedirs(args.workdir, exist_ok=True)
    cfg_path = run_dir + ".yaml"
    with open(cfg_path, "w") as f:
        yaml.safe_dump(config, f)
    shutil.rmtree(run_dir, ignore_errors=True)  # each run starts fresh (the learner refuses to overwrite)
    done = subprocess.run([os.path.join(build, "trainer", "opd-trainer"), "opd", "--config", cfg_path],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        sys.exit("opd-trainer failed:\n" + done.stdout.decode()[-3000:])
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    rows = [r for r in rows if "time/step_s" in r][1:]  # the first step warms up
    mean = {p: sum(r["time/" + p] for r in rows) / len(rows) for p in (*PARTS, "step_s", "overlap")}
    mean["tokens_per_s"] = sum(r["throughput/tokens_per_s"] for r in rows) / len(rows)
    return mean


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--workdir", default="build/bench")
    ap.add_argument("--compare", choices=sorted(MODES), default="pipeline")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step (2 samples each)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="threads of each process")
    ap.add_argument("--train", action="append", default=[], metavar="KEY=VALUE",
                    help="a train: setting of both runs (e.g. micro_batch_tokens=1024), repeatable")
    args = ap.parse_args()
    args.train = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.train)}
    build = os.path.abspath(args.build)
    args.workdir = os.path.abspath(args.workdir)
    os.makedirs(args.workdir, exist_ok=True)
    task, models = prepare(args, build)
    secret = new_secret()
    secret_file = os.path.join(args.workdir, "opd_secret")
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, secret.encode())
    os.close(fd)
    threads = [f"--threads={args.threads}"]
    results = []
    with running_service(os.path.join(build, "rollout", "opd-rollout"), [f"--model={models['student']}", *threads],
                         secret) as rollout, \
            running_service(os.path.join(build, "teacher_service", "opd-teacher"),
                            [f"--model={models['teacher_large']}", *threads], secret) as teacher:
        for name, train in MODES[args.compare]:
            results.append((name, run(args, build, task, models, rollout, teacher, secret_file, name, train)))

    print(f"OPD step: {args.prompts} prompts x 2 samples x <= {args.new_tokens} new tokens, demo student and "
          f"teacher (random weights), {args.threads} thread(s) per process, mean of steps 2..{args.steps}")
    print(f"  {'busy seconds':16}{'sample':>9}{'score':>9}{'learn':>9}{'push':>9}{'step':>9}{'overlap':>9}"
          f"{'tokens/s':>10}")
    for name, m in results:
        print(f"  {name:16}" + "".join(f"{m[p]:9.3f}" for p in (*PARTS, "step_s", "overlap")) +
              f"{m['tokens_per_s']:10.1f}")
    (a_name, a), (b_name, b) = results
    print(f"  step time {a_name} / {b_name}: {a['step_s'] / b['step_s']:.2f}x")


if __name__ == "__main__":
    main()
