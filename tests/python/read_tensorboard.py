#!/usr/bin/env python3
"""Reads a run's TensorBoard event files with tensorboard's own EventAccumulator (what the
TensorBoard UI uses) and prints {tag: [[step, value], ...]} as one JSON line."""
import json
import sys

from tensorboard.backend.event_processing import event_accumulator


def main():
    acc = event_accumulator.EventAccumulator(sys.argv[1], size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    out = {tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
