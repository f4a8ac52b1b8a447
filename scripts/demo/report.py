#!/usr/bin/env python3
"""The demo's report, in the style of the Marco-MoE paper's Table 12: the student's task accuracy
(sampled at temperature 1.0) and per-token reverse KL to each teacher after SFT, after OPD stage 1
and after stage 2, next to both teachers' accuracy. Writes <run>/report.json and PNG plots of the
training curves (<run>/plots/), and prints the table."""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--teacher-small", required=True)
    ap.add_argument("--teacher-large", required=True)
    args = ap.parse_args()
    rows = []
    for name, label in [("student_sft", "student after SFT"), ("student_stage1", "student after OPD stage 1"),
                        ("student_stage2", "student after OPD stage 2"), ("teacher_small", "teacher (small, stage 1)"),
                        ("teacher_large", "teacher (large, stage 2)")]:
        e = json.load(open(os.path.join(args.run, f"eval_{name}.json")))
        rows.append({"model": label, "key": name, "accuracy": e["accuracy"],
                     "reverse_kl_to_small_teacher": e["reverse_kl"].get(args.teacher_small),
                     "reverse_kl_to_large_teacher": e["reverse_kl"].get(args.teacher_large),
                     "samples": e["samples"]})
    opd_summary = json.load(open(os.path.join(args.run, "opd", "summary.json")))
    report = {"table": rows, "opd_stages": opd_summary["stages"], "opd_steps": opd_summary["steps"]}
    with open(os.path.join(args.run, "report.json"), "w") as f:
        json.dump(report, f, indent=2)

    print(f"{'model':<28} {'accuracy':>9} {'rev. KL to small':>17} {'rev. KL to large':>17}")
    for r in rows:
        # A model's KL to itself comes out as +-1e-9 (float noise): print it as the 0 it is.
        kl = [0.0 if abs(v) < 5e-5 else v for v in (r['reverse_kl_to_small_teacher'], r['reverse_kl_to_large_teacher'])]
        print(f"{r['model']:<28} {100 * r['accuracy']:8.1f}% {kl[0]:17.4f} {kl[1]:17.4f}")
    for s in opd_summary["stages"]:
        print(f"stage {s['stage']}: {s['steps']} steps, ended by {s['reason']} at step {s['end_step']}, "
              f"smoothed reverse KL {s['smoothed_reverse_kl']:.4f}")

    plots = os.path.join(args.run, "plots")
    os.makedirs(plots, exist_ok=True)
    m = [r for r in load_jsonl(os.path.join(args.run, "opd", "metrics.jsonl")) if "opd/reverse_kl" in r]
    if m:
        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        steps = [r["step"] for r in m]
        ax[0].plot(steps, [r["opd/reverse_kl"] for r in m], label="per-token reverse KL")
        ax[0].plot(steps, [r["opd/smoothed_reverse_kl"] for r in m], label="smoothed (convergence rule)")
        for s in opd_summary["stages"][:-1]:
            ax[0].axvline(s["end_step"], color="gray", linestyle="--", label=f"switch after {s['stage']}")
        ax[0].set_xlabel("OPD step")
        ax[0].set_title("reverse KL to the stage's teacher")
        ax[0].legend()
        ax[1].plot(steps, [r["opd/teacher_logprob"] for r in m], label="teacher log-prob")
        ax[1].plot(steps, [r["opd/student_logprob"] for r in m], label="student log-prob")
        ax[1].set_xlabel("OPD step")
        ax[1].set_title("mean log-prob of sampled tokens")
        ax[1].legend()
        fig.tight_layout()
        fig.savefig(os.path.join(plots, "opd.png"), dpi=100)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("teacher_small", "teacher_large", "student"):
        m = [r for r in load_jsonl(os.path.join(args.run, "sft", name, "metrics.jsonl")) if "train/loss" in r]
        if m:
            ax.plot([r["step"] for r in m], [r["train/loss"] for r in m], label=name)
    ax.set_xlabel("SFT step")
    ax.set_ylabel("cross-entropy")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(plots, "sft.png"), dpi=100)
    print(f"report: {os.path.join(args.run, 'report.json')}, plots: {plots}/, "
          f"TensorBoard: tensorboard --logdir {args.run}")


if __name__ == "__main__":
    main()
