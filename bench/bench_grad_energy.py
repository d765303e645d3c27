#!/usr/bin/env python
"""Where the loss gradient lives: energy per parameter group, SmolLM2-135M on MR.

A zeroth-order step along a random direction over a set S of weights gains, per forward
pass, about ||grad_S||^2 / |S|: the gradient's energy density in S. This measures the
first-order gradient of the classification loss (label words " terrible" / " great") on a
few training batches of 16 and reports, per group of weights, its share of the energy,
its share of the parameters, and their ratio (the density relative to the whole model).
It is what `train_norms` / `train_only` were chosen from.

    python bench/bench_grad_energy.py            # 4 batches, ~2 CPU-minutes
Writes bench/results/grad_energy.json and grad_energy.md.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from seedflood_p2p.algorithm.trainable import find_trainable_matrices
from seedflood_p2p.workload.batching import Batcher
from seedflood_p2p.workload.data import load_task
from seedflood_p2p.workload.models import load_model

OUT = Path(__file__).parent / "results"


def group_of(name: str, last_blocks: int, layers: int) -> str:
    """'L29.post_attention_layernorm' for the last blocks, 'q_proj' etc. for the others."""
    parts = name.split(".")
    if "layers" not in parts:
        return name
    index = int(parts[parts.index("layers") + 1])
    kind = parts[-2]
    return f"L{index}.{kind}" if index >= layers - last_blocks else f"{kind} (other blocks)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--last-blocks", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2-135m")
    task = load_task("mr")
    batcher = Batcher(task, tokenizer, 64)
    tensors = {m.name: m.weight for m in find_trainable_matrices(model, True, True)}
    for weight in tensors.values():
        weight.requires_grad_(True)
    energy: dict[str, float] = defaultdict(float)
    for seed in range(args.batches):
        batch = batcher(random.Random(seed).sample(task.train, 16))
        with torch.enable_grad():
            hidden = model.base_model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).last_hidden_state
            last = hidden[torch.arange(16), batch["target_positions"]]
            logits = model.get_output_embeddings()(last)[:, batch["label_word_ids"]]
            model.zero_grad()
            F.cross_entropy(logits, batch["labels"]).backward()
        for name, weight in tensors.items():
            energy[name] += float(weight.grad.pow(2).sum()) / args.batches
        print(f"batch {seed + 1}/{args.batches}", flush=True)
    layers = model.config.num_hidden_layers
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, weight in tensors.items():
        g = groups[group_of(name, args.last_blocks, layers)]
        g[0] += energy[name]
        g[1] += weight.numel()
    total_e, total_n = sum(energy.values()), sum(w.numel() for w in tensors.values())
    rows = sorted(
        (
            {
                "group": k,
                "energy_share": e / total_e,
                "parameter_share": n / total_n,
                "density": (e / total_e) / (n / total_n),
                "parameters": int(n),
            }
            for k, (e, n) in groups.items()
        ),
        key=lambda r: -r["density"],
    )
    norms = [r for r in rows if "norm" in r["group"]]
    summary = {
        "norm_scales_energy_share": sum(r["energy_share"] for r in norms),
        "norm_scales_parameter_share": sum(r["parameter_share"] for r in norms),
    }
    OUT.mkdir(exist_ok=True)
    result = {"batches": args.batches, "summary": summary, "groups": rows}
    (OUT / "grad_energy.json").write_text(json.dumps(result, indent=1))
    lines = [
        "# Gradient energy by parameter group (SmolLM2-135M, MR, label-word loss)",
        "",
        f"`python bench/bench_grad_energy.py` ({args.batches} batches of 16; all 2-D "
        "weights including the tied embedding, and every norm scale vector).",
        "",
        f"Norm scale vectors: {100 * summary['norm_scales_energy_share']:.1f}% of the "
        f"energy in {100 * summary['norm_scales_parameter_share']:.3f}% of the parameters.",
        "",
        "| group | energy % | parameters % | density |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['group']} | {100 * r['energy_share']:.2f} | "
            f"{100 * r['parameter_share']:.3f} | {r['density']:.2f} |"
        )
    (OUT / "grad_energy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
