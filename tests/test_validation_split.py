"""The validation split (issue 47): settings are chosen on it, the test split scores a final
row once. MR's is 1,000 of its training sentences, fixed, disjoint from the test split and
from every training pool a run takes (the first N <= 8,605), with a recorded digest."""

from __future__ import annotations

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.workload.data import (
    VALIDATION_SIZE,
    examples_sha256,
    load_task,
    split_sha256,
)
from seedflood_p2p.workload.tasks import load_run_task

# docs/LEARNING.md ("The validation protocol") quotes these two digests.
MR_VALIDATION_SHA256 = "f66e49d4c767907520d12ca2dc2e52d787ac1949a25a2822f91f872e5d772146"
# examples_sha256 of MR before the split existed: carving it changed no run's data.
MR_EXAMPLES_SHA256 = "1a6784e54b11f460f85cfcc4f83b38a827d3e2b58ddb94eebc39977d419dea5e"


def _keys(examples) -> set[tuple[str, int | None]]:
    return {(e.text, e.label) for e in examples}


def test_mr_validation_is_1000_sentences_disjoint_from_test_and_pools():
    task = load_task("mr")
    assert len(task.validation) == VALIDATION_SIZE == 1000
    assert task.pool_limit == len(task.train) - 1000 == 8605
    assert len(_keys(task.validation)) == 1000  # distinct sentences
    assert not _keys(task.validation) & _keys(task.test)
    assert not _keys(task.validation) & _keys(task.train[: task.pool_limit])  # any pool <= 8605
    assert {e.label for e in task.validation} == {0, 1}
    # carved from the end of train, which keeps it: no run's training data or digest moved
    assert task.train[-1000:] == task.validation
    assert examples_sha256(task) == MR_EXAMPLES_SHA256


def test_mr_validation_is_deterministic_and_its_digest_is_pinned():
    first, again = load_task("mr"), load_task("mr")
    assert first.validation == again.validation
    digest = split_sha256(first.validation, "validation")
    assert digest == split_sha256(list(reversed(again.validation)), "validation")  # order-free
    assert digest == MR_VALIDATION_SHA256
    assert split_sha256(first.validation, "test") != digest  # the split's name counts


def test_a_runs_pool_keeps_the_validation_only_when_disjoint():
    pool = load_run_task(RunConfig(model="tiny-llama", dataset="mr", train_examples=512))
    assert len(pool.train) == 512 and len(pool.validation) == 1000
    assert not _keys(pool.train) & _keys(pool.validation)
    edge = load_run_task(RunConfig(model="tiny-llama", dataset="mr", train_examples=8605))
    assert len(edge.validation) == 1000
    # a pool that reaches into the validation sentences (or all of train) holds none out
    assert (
        load_run_task(RunConfig(model="tiny-llama", dataset="mr", train_examples=8606)).validation
        == []
    )
    assert load_run_task(RunConfig(model="tiny-llama", dataset="mr")).validation == []


def test_files_and_synthetic_tasks_hold_out_a_tenth_of_train(tmp_path):
    rows = ["text,label"] + [f"sentence number {i},{i % 2}" for i in range(300)]
    (tmp_path / "reviews.csv").write_text("\n".join(rows) + "\n")
    task = load_task(str(tmp_path / "reviews.csv"))
    assert (len(task.train), len(task.test), len(task.validation)) == (270, 30, 27)
    assert not _keys(task.validation) & _keys(task.test)
    assert not _keys(task.validation) & _keys(task.train[: task.pool_limit])
    synthetic = load_task("synthetic-sentiment")
    assert len(synthetic.validation) == len(synthetic.train) // 10 == 200
    assert synthetic.validation == synthetic.train[-200:]
