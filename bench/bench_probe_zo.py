#!/usr/bin/env python
"""How far can zeroth-order (ZO) steps go on the smallest useful parameter set?

Trains only SmolLM2's final RMSNorm scale (576 weights). With the rest frozen, the label
words' logits are exactly emb[label] . (scale * rmsnorm(h)), h being the hidden state that
enters the final norm at the prompt's last position, so one forward pass per sentence
(cached) makes every method below cost microseconds per step: the exact loss the model
would compute, without the model. That isolates the estimator from the forward pass.

Methods, all with batches of 16 drawn from the same cached training sentences, 4 peers
per round, scored on the 1,000-sentence MR test split:
* adam: first-order Adam on the scale (one step = 3 forward-pass equivalents);
* zo: SubCGE's estimator shape, k directions of +-1 entries per message, direction j on
  the j-th share of the batch (k = 16: one direction per example);
* zo-fullbatch: k directions, each on the whole batch (possible here because only the
  head trains: the body's forward is shared by every direction);
* zo-momentum: heavy-ball momentum on the applied sum (a pure function of the ledger);
* zo-precond: directions scaled by (diag Gauss-Newton + damping)^-1/2 at the base
  weights (would travel in the manifest);
* zo-pca: directions in the top-r principal subspace of per-example gradients at the base
  weights, whitened.

    python bench/bench_probe_zo.py                  # extracts features once (~25 CPU-min)
    python bench/bench_probe_zo.py --cache F.pt     # reuse features

Writes bench/results/probe_zo.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results"
EVAL_AT = (100, 300, 500, 1000)


def extract(path: Path, train_examples: int) -> None:
    """Hidden states entering the final norm at each prompt's last position."""
    from seedflood_p2p.core.config import RunConfig
    from seedflood_p2p.workload.batching import Batcher
    from seedflood_p2p.workload.data import load_task
    from seedflood_p2p.workload.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    task = load_task("mr")
    batcher = Batcher(task, tokenizer, RunConfig().max_length)
    captured: dict[str, torch.Tensor] = {}
    model.base_model.norm.register_forward_pre_hook(lambda m, args: captured.update(h=args[0]))
    out: dict = {}
    for split, examples in (("test", task.test[:1000]), ("train", task.train[:train_examples])):
        hidden, labels = [], []
        for start in range(0, len(examples), 32):
            batch = batcher(examples[start : start + 32])
            with torch.no_grad():
                model.base_model(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
                )
            rows = torch.arange(captured["h"].shape[0])
            hidden.append(captured["h"][rows, batch["target_positions"]].clone())
            labels.append(batch["labels"].clone())
            print(f"{split} {start + len(batch['labels'])}/{len(examples)}", flush=True)
        out[split] = (torch.cat(hidden), torch.cat(labels))
    out["emb"] = model.get_output_embeddings().weight[batch["label_word_ids"]].detach().clone()
    out["norm_w"] = model.base_model.norm.weight.detach().clone()
    out["eps"] = model.base_model.norm.variance_epsilon
    torch.save(out, path)


class Probe:
    """The final norm + label-word head as a function of the scale vector."""

    def __init__(self, cache: dict) -> None:
        def rmsnorm(h: torch.Tensor) -> torch.Tensor:
            h = h.double()
            return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + cache["eps"])

        self.xtr, self.ytr = rmsnorm(cache["train"][0]), cache["train"][1]
        self.xte, self.yte = rmsnorm(cache["test"][0]), cache["test"][1]
        self.emb, self.g0 = cache["emb"].double(), cache["norm_w"].double()

    def losses(self, x: torch.Tensor, y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy((x * g) @ self.emb.T, y, reduction="none")

    def score(self, g: torch.Tensor) -> float:
        return float((((self.xte * g) @ self.emb.T).argmax(-1) == self.yte).double().mean())

    def per_example_grads(self, g: torch.Tensor) -> torch.Tensor:
        p = torch.softmax((self.xtr * g) @ self.emb.T, -1)[:, 1]
        return (p - (self.ytr == 1).double())[:, None] * ((self.emb[1] - self.emb[0]) * self.xtr)


def adam(probe: Probe, lr: float, seed: int, steps: int = 334) -> dict[int, float]:
    gen = torch.Generator().manual_seed(seed)
    g = probe.g0.clone().requires_grad_(True)
    opt = torch.optim.Adam([g], lr=lr)
    curve = {}
    for step in range(1, steps + 1):
        idx = torch.randint(len(probe.ytr), (16,), generator=gen)
        loss = probe.losses(probe.xtr[idx], probe.ytr[idx], g).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        for at in EVAL_AT:
            if 3 * (step - 1) < at <= 3 * step:
                curve[at] = probe.score(g.detach())
    return curve


def zo(
    probe: Probe,
    lr: float,
    seed: int,
    k: int = 16,
    basis: torch.Tensor | None = None,
    full_batch: bool = False,
    momentum: float = 0.0,
    peers: int = 4,
    eps: float = 1e-3,
) -> dict[int, float]:
    """Two-point estimates, k directions per message, the sum of a round's messages applied."""
    gen = torch.Generator().manual_seed(seed)
    g, velocity, curve, forwards = probe.g0.clone(), torch.zeros_like(probe.g0), {}, 0
    dims = probe.g0.numel() if basis is None else basis.shape[1]
    while forwards < max(EVAL_AT):
        step = torch.zeros_like(g)
        for _ in range(peers):
            idx = torch.randint(len(probe.ytr), (16,), generator=gen)
            x, y = probe.xtr[idx], probe.ytr[idx]
            z = torch.randint(0, 2, (k, dims), generator=gen).double() * 2 - 1
            if basis is not None:
                z = z @ basis.T
            if full_batch:
                diff = [
                    probe.losses(x, y, g + eps * zj).mean()
                    - probe.losses(x, y, g - eps * zj).mean()
                    for zj in z
                ]
                scalars = torch.stack(diff) / (2 * eps)
            else:
                per_example = z.repeat_interleave(16 // k, 0)
                diff = probe.losses(x, y, g + eps * per_example) - probe.losses(
                    x, y, g - eps * per_example
                )
                scalars = (diff / (2 * eps)).view(k, -1).mean(1)
            step += (scalars[:, None] * z).sum(0) / k
            forwards += 2
        velocity = momentum * velocity + step
        g = g - lr * velocity
        for at in EVAL_AT:
            if forwards - 2 * peers < at <= forwards:
                curve[at] = probe.score(g)
    return curve


def preconditioner(probe: Probe, damping_quantile: float) -> torch.Tensor:
    p = torch.softmax((probe.xtr * probe.g0) @ probe.emb.T, -1)[:, 1]
    curvature = ((p * (1 - p))[:, None] * ((probe.emb[1] - probe.emb[0]) * probe.xtr) ** 2).mean(0)
    scale = (curvature + curvature.quantile(damping_quantile)).rsqrt()
    return torch.diag(scale / scale.max())


def pca_basis(probe: Probe, rank: int) -> torch.Tensor:
    grads = probe.per_example_grads(probe.g0)[: len(probe.ytr) // 2]
    _, s, v = torch.linalg.svd(grads, full_matrices=False)
    basis = v[:rank].T * (s[0] / s[:rank])
    return basis / basis.norm(dim=0).max()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", type=Path, default=RESULTS / "probe_features.pt")
    parser.add_argument("--train-examples", type=int, default=2400)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--out", default="probe_zo")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not args.cache.exists():
        extract(args.cache, args.train_examples)
    probe = Probe(torch.load(args.cache))
    rows = {
        "adam lr 0.03": lambda s: adam(probe, 0.03, s),
        "adam lr 0.1": lambda s: adam(probe, 0.1, s),
        "zo k=1 lr 0.3": lambda s: zo(probe, 0.3, s, k=1),
        "zo k=16 lr 0.01": lambda s: zo(probe, 0.01, s),
        "zo k=16 lr 0.03": lambda s: zo(probe, 0.03, s),
        "zo k=16 lr 0.1": lambda s: zo(probe, 0.1, s),
        "zo k=16 lr 0.3": lambda s: zo(probe, 0.3, s),
        "zo k=4 lr 0.1": lambda s: zo(probe, 0.1, s, k=4),
        "zo-fullbatch k=16 lr 0.03": lambda s: zo(probe, 0.03, s, full_batch=True),
        "zo-fullbatch k=16 lr 0.1": lambda s: zo(probe, 0.1, s, full_batch=True),
        "zo-momentum 0.9 k=16 lr 0.003": lambda s: zo(probe, 0.003, s, momentum=0.9),
        "zo-momentum 0.9 k=16 lr 0.01": lambda s: zo(probe, 0.01, s, momentum=0.9),
        "zo-precond q0.9 k=16 lr 1": lambda s: zo(probe, 1.0, s, basis=preconditioner(probe, 0.9)),
        "zo-pca r16 k=16 lr 10": lambda s: zo(probe, 10.0, s, basis=pca_basis(probe, 16)),
        "zo-pca r32 k=16 lr 10": lambda s: zo(probe, 10.0, s, basis=pca_basis(probe, 32)),
    }
    zero_shot = probe.score(probe.g0)
    results = {}
    for name, run in rows.items():
        started = time.time()
        curves = [run(seed) for seed in range(args.seeds)]
        results[name] = {str(at): [c[at] for c in curves] for at in EVAL_AT}
        print(f"{name}: {results[name]} ({time.time() - started:.0f} s)", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(
        json.dumps(
            {
                "zero_shot": zero_shot,
                "seeds": args.seeds,
                "train_examples": len(probe.ytr),
                "test_examples": len(probe.yte),
                "eval_at_forward_passes": EVAL_AT,
                "rows": results,
            },
            indent=1,
        )
    )
    lines = [
        "# ZO vs first-order on SmolLM2's final-norm scale (576 weights), MR",
        "",
        f"Cached features, {len(probe.ytr)} training and {len(probe.yte)} test sentences, "
        f"{args.seeds} seeds (mean; SE of one score on 1,000 sentences ~0.015). "
        f"Zero-shot {zero_shot:.3f}. Command: `python bench/bench_probe_zo.py`.",
        "",
        "| method | " + " | ".join(f"{at} fwd" for at in EVAL_AT) + " |",
        "|---|" + "---|" * len(EVAL_AT),
    ]
    for name, by_at in results.items():
        cells = [f"{sum(v) / len(v):.3f}" for v in by_at.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
