"""Outputs of simulated runs: JSON per run, a markdown table and plots."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np


def fmt_bytes(value: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return str(value)


def markdown_table(results: list[dict]) -> str:
    """One row per run: final accuracy and loss, consensus, bytes, time."""
    head = (
        "| topology | peers | delay | loss | method | lr | rounds | accuracy | "
        "loss (start -> end) | reference acc | consensus mean / max | total bytes | "
        "bytes / peer | fwd passes | s / round | apply ms / round |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in results:
        first, last = r["evals"][0], r["final"]
        acc = "-" if last["accuracy"] is None else f"{last['accuracy']:.3f}"
        ref = "-" if last["reference_accuracy"] is None else f"{last['reference_accuracy']:.3f}"
        cons = last["consensus"]
        lr = r["config"]["fo_lr"] if r["method"] == "dsgd" else r["config"]["run"]["lr"]
        lines.append(
            f"| {r['topology']['name']} | {r['topology']['peers']} | {r['config']['delay']} | "
            f"{r['config']['loss']:g} | {r['method']} | {lr:g} | "
            f"{last['round']} | {acc} | {first['loss']:.4f} -> {last['loss']:.4f} | {ref} | "
            f"{cons['mean_to_average']:.2e} / {cons['max_to_average']:.2e} | "
            f"{fmt_bytes(r['bytes']['total'])} | {fmt_bytes(r['bytes']['per_peer_mean'])} | "
            f"{last['forward_passes']} | {r['timing']['seconds_per_round']:.2f} | "
            f"{r['timing']['apply_ms_per_round']:.2f} |"
        )
    return head + "\n".join(lines) + "\n"


METHOD_COLOURS = {
    "seedflood": "tab:red",
    "seedflood-naive": "tab:purple",
    "dzsgd": "tab:green",
    "dsgd": "tab:orange",
    "centralized": "tab:blue",
}


def default_label(result: dict) -> str:
    return f"{result['method']} (n={result['topology']['peers']})"


def plot_runs(results: list[dict], path: Path, title: str, label: Any = default_label) -> None:
    """Accuracy and loss vs rounds, accuracy vs total bytes (log), consensus vs rounds.

    Colour: method; line style: the other settings (as told by `label`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (ax_acc, ax_loss), (ax_bytes, ax_cons) = axes
    variants: dict[str, str] = {}
    for r in results:
        name = label(r)
        variant = name.split("(", 1)[-1]
        style = variants.setdefault(variant, ["-", "--", ":", "-."][len(variants) % 4])
        look = dict(color=METHOD_COLOURS.get(r["method"]), linestyle=style, marker="o", ms=3)
        ev = r["evals"]
        x = [e["round"] for e in ev]
        acc = [e["accuracy"] if e["accuracy"] is not None else np.nan for e in ev]
        ax_acc.plot(x, acc, label=name, **look)
        ax_loss.plot(x, [e["loss"] for e in ev], label=name, **look)
        sent = [e["bytes_total"] for e in ev]
        if any(sent):
            ax_bytes.plot(sent[1:], acc[1:], label=name, **look)
        cons = [e["consensus"]["mean_to_average"] for e in ev]
        if any(c > 0 for c in cons):
            ax_cons.plot(x, [c if c > 0 else np.nan for c in cons], label=name, **look)
    ax_acc.set(xlabel="round", ylabel="held-out accuracy (mean of sampled peers)")
    ax_loss.set(xlabel="round", ylabel="held-out loss (mean of sampled peers)")
    ax_bytes.set(xlabel="total bytes sent (all peers)", ylabel="held-out accuracy", xscale="log")
    ax_cons.set(xlabel="round", ylabel="consensus distance: mean ||x_i - avg||", yscale="log")
    ax_cons.text(
        0.02,
        0.02,
        "not drawn: methods whose peers are identical (0)",
        transform=ax_cons.transAxes,
        fontsize=8,
    )
    for ax in (ax_acc, ax_bytes, ax_cons):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in axes.ravel():
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_name(result: dict) -> str:
    cfg = result["config"]
    return f"{cfg['topology']}_n{cfg['peers']}_{result['method']}"


def write_outputs(results: list[dict], out: Path, prefix: str = "sim_") -> list[Path]:
    """JSON per run, one markdown table, and one PNG per topology."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for result in results:
        path = out / f"{prefix}{run_name(result)}.json"
        path.write_text(json.dumps(result, indent=1))
        written.append(path)
    table = out / f"{prefix}table.md"
    table.write_text(markdown_table(results))
    written.append(table)
    by_topology: dict[str, list[dict]] = defaultdict(list)
    for result in results:
        by_topology[result["config"]["topology"]].append(result)
    for topology, group in by_topology.items():
        path = out / f"{prefix}{topology}.png"
        plot_runs(
            group,
            path,
            f"{topology}: {group[0]['config']['run']['model']} on "
            f"{group[0]['config']['run']['dataset']}",
        )
        written.append(path)
    return written
