#!/usr/bin/env python3
"""Checks what a demo run must show (the miniature demo in the test suite runs this):

  1. reverse KL to the teacher falls during each OPD stage (mean of a stage's first steps above
     the mean of its last steps);
  2. stage 1 ended by its convergence rule: the rule, recomputed here from the logged per-step
     reverse KL and the stage's config, fires exactly at the step where the learner switched;
  3. the student's accuracy after the cascade exceeds its accuracy after SFT;
  4. report.json, the plots and the TensorBoard logs exist.

Exits 1 naming every check that failed."""
import argparse
import glob
import json
import os
import sys

import yaml


def load_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def rule_fires_at(values, stage_cfg):
    """The step (1-based, within the stage) at which trainer/opd/convergence.cc ends the stage."""
    plateau = stage_cfg.get("plateau", {}) or {}
    beta, window = plateau.get("ema_beta", 0.9), plateau.get("window", 20)
    min_rel, min_steps = plateau.get("min_rel_improvement", 0.02), plateau.get("min_steps", 0)
    max_steps = stage_cfg.get("max_steps", 0)
    ema, history = 0.0, []
    for step, v in enumerate(values, start=1):
        ema = v if step == 1 else beta * ema + (1 - beta) * v
        history = (history + [ema])[-(window + 1):]
        if max_steps and step >= max_steps:
            return step, "max_steps"
        if plateau.get("enabled") and step >= min_steps and len(history) == window + 1:
            # A rise is not a plateau: the change counts in absolute value (as in convergence.cc).
            if abs(history[0] - history[-1]) / max(abs(history[0]), 1e-12) < min_rel:
                return step, "plateau"
    return None, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True, help="the demo's RUN directory")
    ap.add_argument("--edge", type=int, default=10, help="steps averaged at each end of a stage")
    args = ap.parse_args()
    failures = []
    report = json.load(open(os.path.join(args.run, "report.json")))
    config = yaml.safe_load(open(os.path.join(args.run, "opd", "config.yaml")))
    rows = [r for r in load_jsonl(os.path.join(args.run, "opd", "metrics.jsonl")) if "opd/reverse_kl" in r]
    stages = report["opd_stages"]

    start = 0
    for i, s in enumerate(stages):
        kl = [r["opd/reverse_kl"] for r in rows if int(r["opd/stage"]) == i]
        n = min(args.edge, len(kl) // 2)
        if n == 0:
            failures.append(f"stage {s['stage']}: too few steps ({len(kl)}) to see a trend")
            continue
        first, last = sum(kl[:n]) / n, sum(kl[-n:]) / n
        print(f"{s['stage']}: {len(kl)} steps, reverse KL {first:.4f} (first {n}) -> {last:.4f} (last {n}), "
              f"ended by {s['reason']}")
        if not last < first:
            failures.append(f"stage {s['stage']}: reverse KL did not fall ({first:.4f} -> {last:.4f})")
        fired, reason = rule_fires_at(kl, config["stages"][i])
        if fired != s["steps"] or reason != s["reason"]:
            failures.append(f"stage {s['stage']}: ended after {s['steps']} steps ({s['reason']}) but its rule "
                            f"fires after {fired} ({reason})")
        if s["end_step"] != start + s["steps"]:
            failures.append(f"stage {s['stage']}: end_step {s['end_step']} != {start} + {s['steps']}")
        start = s["end_step"]
    if len(stages) < 2:
        failures.append(f"expected two stages, the run has {len(stages)}")

    acc = {r["key"]: r["accuracy"] for r in report["table"]}
    print("accuracy: " + ", ".join(f"{k} {v:.3f}" for k, v in acc.items()))
    if not acc["student_stage2"] > acc["student_sft"]:
        failures.append(f"accuracy after the cascade {acc['student_stage2']:.3f} is not above "
                        f"after SFT {acc['student_sft']:.3f}")
    for pattern in ("plots/*.png", "opd/tensorboard/events.out.tfevents.*"):
        if not glob.glob(os.path.join(args.run, pattern)):
            failures.append(f"missing {pattern}")
    for f in failures:
        print("FAILED: " + f, file=sys.stderr)
    print("demo run checks: " + ("all passed" if not failures else f"{len(failures)} failed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
