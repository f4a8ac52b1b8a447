#!/usr/bin/env python3
"""Loads a model directory with transformers and compares its logits on a fixture's inputs with
the fixture's reference logits. Exit 0 when max |diff| <= --atol. Used by the C++ round-trip test
(C++ saves, transformers loads)."""
import argparse
import json
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("--model", required=True)
ap.add_argument("--fixture", required=True)
ap.add_argument("--atol", type=float, default=1e-4)
args = ap.parse_args()

model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
seqs = json.load(open(f"{args.fixture}/inputs.json"))["sequences"]
ref = load_file(f"{args.fixture}/ref.safetensors")["logits"]
with torch.no_grad():
    got = torch.cat([model(input_ids=torch.tensor([s])).logits[0] for s in seqs])
diff = (got - ref).abs().max().item()
print(f"max |logits - ref| = {diff:.3g}")
sys.exit(0 if diff <= args.atol else 1)
