"""bench_rounds.py under the validation protocol (issue 47): candidates are scored on the
validation split, the best is run again and scored once on test, and every results file
says which split chose a row and which scored it, with both standard errors."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_rounds.py"
ROW = "rank:8,directions:4,step_rule:round_mean,n_ref:2,basis:activation,basis_refresh:0"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_rounds_protocol", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_main(bench, monkeypatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_rounds.py", *argv])
    bench.main()


def common(results: Path, out: str) -> list[str]:
    return [
        "--model", "tiny-llama", "--task", "synthetic-sentiment", "--train-only", "",
        "--no-cache-prefix", "--peers", "2", "--seeds", "2", "--rounds", "2",
        "--eval-at", "0,2", "--eval-examples", "24", "--train-examples", "400",
        "--out", out, "--results-dir", str(results),
    ]  # fmt: skip


def test_choose_on_validation_then_score_the_chosen_row_on_test(tmp_path, monkeypatch):
    from seedflood_p2p.workload.data import load_task, split_sha256

    bench = load_bench()
    task = load_task("synthetic-sentiment")
    bench_main(
        bench,
        monkeypatch,
        *common(tmp_path, "sweep-val"),
        "--eval-split", "validation", "--rows", "",
        "--row", f"lo={ROW},lr:0.001", "--row", f"hi={ROW},lr:0.05",
        "--row", "adam-lo=method:adam,lr:0.0001", "--row", "adam-hi=method:adam,lr:0.001",
    )  # fmt: skip
    val = json.loads((tmp_path / "sweep-val.json").read_text())
    assert len(val["runs"]) == 8  # 4 rows x 2 seeds, each written as it finished
    assert val["meta"]["validation_sha256"] == split_sha256(task.validation, "validation")
    assert val["meta"]["validation_examples"] == 200
    for run in val["runs"]:
        assert (run["chosen_on"], run["scored_on"], run["eval_examples"]) == (
            "validation",
            "validation",
            24,
        )
        assert run["scored_sha256"] == split_sha256(task.validation[:24], "validation")

    def final(row: str) -> float:
        return sum(r["curve"]["2"]["accuracy"] for r in val["runs"] if r["row"] == row) / 2

    bench_main(bench, monkeypatch, *common(tmp_path, "sweep-test"), "--choose-from", "sweep-val")
    test = json.loads((tmp_path / "sweep-test.json").read_text())
    rows = {r["row"] for r in test["runs"]}
    assert rows == {max(("lo", "hi"), key=final), max(("adam-lo", "adam-hi"), key=final)}
    assert len(test["runs"]) == 4  # the two chosen rows x 2 seeds, nothing else scored on test
    for run in test["runs"]:
        assert (run["chosen_on"], run["scored_on"]) == ("validation", "test")
        assert run["chosen_from"] == "sweep-val"
        assert run["scored_sha256"] == split_sha256(task.test[:24], "test")
        # the last evaluation's per-sentence record, for paired SEs: one mark a sentence,
        # agreeing with the accuracy it scored
        for r in ("0", "2"):  # every evaluation
            bits = run["correct"][r]
            assert len(bits) == 24 and set(bits) <= {"0", "1"}
            assert bits.count("1") / 24 == pytest.approx(run["curve"][r]["accuracy"])
    md = (tmp_path / "sweep-test.md").read_text()
    assert "| chosen on | scored on |" in md and "| validation | test |" in md
    assert "sqrt(p(1-p)/n)" in md
    cell = next(line for line in md.splitlines() if line.startswith("| adam")).split("|")[6]
    assert "+-" in cell and "[" in cell  # SE over seeds and the sampling SE side by side

    # resumable: the same command again finds every run there and runs nothing
    monkeypatch.setattr(bench, "run_one", lambda *a: pytest.fail("ran a finished run again"))
    bench_main(bench, monkeypatch, *common(tmp_path, "sweep-test"), "--choose-from", "sweep-val")


def test_a_validation_run_refuses_a_pool_that_meets_the_validation_split(tmp_path, monkeypatch):
    bench = load_bench()
    argv = common(tmp_path, "overlap")
    argv[argv.index("--train-examples") + 1] = "0"  # all of train: it holds the validation
    with pytest.raises(SystemExit, match="would train on validation sentences"):
        bench_main(
            bench, monkeypatch, *argv, "--eval-split", "validation", "--rows", "",
            "--row", f"lo={ROW},lr:0.001",
        )  # fmt: skip


def test_core_adam_is_adam_on_the_subspace_core_and_stays_in_the_subspace():
    """The `adam-core` row's step (bench_rounds.CoreAdam): the projected gradient
    U^T (dL/dW) V is the gradient of the core C in W = W0 + U C V^T, so its steps are
    Adam's on C by autograd, and the weights never leave W0 + span(U) x span(V)."""
    import torch

    from seedflood_p2p.algorithm.trainable import TrainableMatrix

    bench = load_bench()
    torch.manual_seed(0)
    layer = torch.nn.Linear(6, 5, bias=False)
    u, v = torch.randn(5, 2), torch.randn(6, 3)  # a basis need not be orthonormal
    w0 = layer.weight.detach().clone()
    x = torch.randn(8, 6)
    target = torch.randn(8, 5)
    core = torch.zeros(2, 3, requires_grad=True)  # the reference: Adam on C by autograd
    reference = torch.optim.Adam([core], lr=0.05)
    stepped = bench.CoreAdam(
        [TrainableMatrix("w", layer.weight, [layer], "linear")], [(u, v)], lr=0.05
    )
    for _ in range(4):
        reference.zero_grad()
        ((x @ (w0 + u @ core @ v.T).T - target) ** 2).mean().backward()
        reference.step()
        stepped.zero_grad()
        ((layer(x) - target) ** 2).mean().backward()
        stepped.step()
    delta = layer.weight.detach() - w0
    assert delta.abs().max() > 1e-3  # it moved
    torch.testing.assert_close(stepped.cores[0].detach(), core.detach())
    torch.testing.assert_close(delta, (u @ core @ v.T).detach())
    # in the subspace: projecting the move onto span(U) x span(V) leaves it as it is
    pu, pv = u @ torch.linalg.pinv(u), v @ torch.linalg.pinv(v)
    torch.testing.assert_close(pu @ delta @ pv, delta, atol=1e-5, rtol=1e-4)
