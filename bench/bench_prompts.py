#!/usr/bin/env python
"""Prompt template and label words for MR, chosen on validation (issue 47, item 3(a)).

Zero-shot accuracy and macro-F1 of the base model for every (template, label-word pair,
calibration) on the fixed validation split (docs/LEARNING.md, "The validation protocol"),
through a run's own scoring path: the rows of `batching.calibrated`, `make_batch`,
`objective.label_word_logits`, `objective.calibrate` (content-free calibration as a run
reads it) and `trainer.macro_f1`, with the run's `max_length` and `batch_size`. One forward
pass per template reads the logits of every label word at once (each pair's first
differing token, `batching.label_token_ids`); each pair is scored from its two columns,
with and without calibration (the content-free row rides in every batch; uncalibrated
scores ignore it). Then only the chosen row and today's default are scored, once, on the
1,000 test sentences; the top 3 are checked on the other binary sentiment tasks the repo
ships (their validation splits).

    python bench/bench_prompts.py                   # SmolLM2 on MR -> results/prompts-mr.*
    python bench/bench_prompts.py --render          # .md from .json

Batches are formed from the examples sorted by length (less padding: ~2x faster on the
CPU); a run's `evaluate_metrics` takes them in order. Right padding leaves every row's
logits the same up to float rounding, and the results record a check: the default and
the chosen row scored by `evaluate_metrics` itself on the first --check-examples
validation sentences. `--run-order` batches in the run's order instead.

Resumable: each template's logits are cached in $SEEDFLOOD_BENCH_CACHE/prompts/ and the
results file is rewritten after each template.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
CACHE_DIR = Path(os.environ.get("SEEDFLOOD_BENCH_CACHE", "/tmp/seedflood-bench-cache"))
REPO = Path(__file__).resolve().parents[1]

DEFAULT_TEMPLATE = "{text}\nIt was"
DEFAULT_WORDS = (" terrible", " great")
TEMPLATES = [
    DEFAULT_TEMPLATE,
    "Review: {text}\nSentiment:",
    "{text} All in all, the movie was",
    "Movie review: {text}\nThe review is",
    "{text}\nOverall, it was",
    "Q: Is this review positive or negative?\n{text}\nA:",
    "{text} It was",
    "Review: {text}\nThe movie was",
    "{text}\nIn summary, the film is",
    "Here is a movie review: {text}\nThe reviewer thinks the movie is",
]
PAIRS = [  # (negative, positive): label 0, label 1
    DEFAULT_WORDS,
    (" bad", " good"),
    (" negative", " positive"),
    (" awful", " excellent"),
    (" boring", " wonderful"),
    (" bad", " great"),
    (" terrible", " good"),
    (" awful", " amazing"),
    (" poor", " excellent"),
    (" horrible", " fantastic"),
]
CALIBRATIONS = ("", "content-free")
# Other binary sentiment tasks the repo ships (the top 3 are checked on their validation):
# name -> (dataset, label names or (), the task's own label words).
OTHER_TASKS = [  # (name, dataset, label names, the task's own label words, split)
    ("synthetic-sentiment", "synthetic-sentiment", (), DEFAULT_WORDS, "validation"),
    (
        "sentiment.jsonl",
        str(REPO / "examples" / "tasks" / "sentiment.jsonl"),
        ("negative", "positive"),
        DEFAULT_WORDS,  # the `sentiment` preset's
        "validation",
    ),
    (  # its validation split is 4 rows: all 48 as well (nothing is chosen on this file)
        "sentiment.jsonl",
        str(REPO / "examples" / "tasks" / "sentiment.jsonl"),
        ("negative", "positive"),
        DEFAULT_WORDS,
        "all",
    ),
]


# ---------------------------------------------------------------------------- scoring


def pair_groups(tokenizer, pairs: list[tuple[str, ...]]) -> list[dict]:
    """Pairs that share a prompt: each pair's common token prefix goes at the end of every
    prompt (`label_token_ids`), so one forward pass serves every pair of one prefix. Each
    group: its prefix, pairs, the union of their label tokens and each pair's columns."""
    from seedflood_p2p.workload.batching import label_token_ids

    groups: dict[tuple[int, ...], dict] = {}
    for pair in pairs:
        prefix, ids = label_token_ids(tokenizer, pair)
        group = groups.setdefault(tuple(prefix), {"pairs": [], "ids": [], "cols": []})
        cols = []
        for token in ids:
            if token not in group["ids"]:
                group["ids"].append(token)
            cols.append(group["ids"].index(token))
        group["pairs"].append(tuple(pair))
        group["cols"].append(cols)
    return list(groups.values())


@torch.no_grad()
def pass_logits(model, tokenizer, task, examples, group: dict, config, order: str = "length"):
    """One forward pass over `examples` for one template (`task.template`) and one group of
    pairs: (label-word logits as they are [n, U], calibrated [n, U], labels [n]), rows in
    the order of `examples`, columns `group["ids"]`. Each batch is `calibrated`'s rows (a
    chunk of config.batch_size examples closed by the content-free prompt), as a run's
    evaluation builds them."""
    from seedflood_p2p.algorithm.objective import calibrate, label_word_logits
    from seedflood_p2p.workload.batching import Batcher, calibrated

    cal_task = replace(task, label_words=group["pairs"][0], calibration="content-free")
    batcher = Batcher(cal_task, tokenizer, config.max_length)
    index = list(range(len(examples)))
    if order == "length":  # less padding; each row's logits are its own either way
        index.sort(key=lambda i: len(examples[i].text))
    ids = torch.tensor(group["ids"], dtype=torch.long)
    raw_out = torch.empty(len(examples), len(ids))
    cal_out = torch.empty(len(examples), len(ids))
    labels = torch.empty(len(examples), dtype=torch.long)
    for start in range(0, len(index), config.batch_size):
        chunk = index[start : start + config.batch_size]
        rows = calibrated(cal_task, [examples[i] for i in chunk])
        batch = batcher(rows)
        batch["label_word_ids"] = ids
        group_size = batch.pop("calibration_group")
        logits = label_word_logits(model, batch).cpu()  # every row, the content-free one too
        keep = [i for i, row in enumerate(rows) if not row.content_free]
        raw_out[chunk] = logits[keep]
        cal_out[chunk] = calibrate(logits, group_size)
        labels[chunk] = batch["labels"]
    return raw_out, cal_out, labels


def score(logits: torch.Tensor, labels: torch.Tensor, cols: list[int]) -> dict[str, float]:
    """evaluate_metrics' figures of one pair: its label words' columns of `logits`."""
    from seedflood_p2p.algorithm.trainer import macro_f1

    pair = logits[:, cols]
    predicted = pair.argmax(dim=-1).tolist()
    truth = labels.tolist()
    n = len(truth)
    accuracy = sum(p == t for p, t in zip(predicted, truth, strict=True)) / n
    return {
        "accuracy": accuracy,
        "macro_f1": macro_f1(predicted, truth, len(cols)),
        "loss": torch.nn.functional.cross_entropy(pair, labels).item(),
        "n": n,
        "sampling_se": math.sqrt(accuracy * (1 - accuracy) / n),
        "predicted_positive": sum(predicted) / n,
    }


def score_template(
    model, tokenizer, task, examples, template, pairs, config, order, cache_key, limit=None
):
    """Rows (template, words, calibration, figures) of every pair for one template, one
    forward pass per prefix group; logits cached on disk under `cache_key`. `limit`: score
    the first `limit` examples only (from the same pass)."""
    task = replace(task, template=template)
    rows, passes, wall, cpu = [], 0, 0.0, 0.0
    for group in pair_groups(tokenizer, pairs):
        key = json.dumps(
            [cache_key, template, group["ids"], config.max_length, config.batch_size, order]
        )
        path = CACHE_DIR / "prompts" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".pt")
        if path.exists():
            saved = torch.load(path)
        else:
            w0, c0 = time.time(), time.process_time()
            raw, cal, labels = pass_logits(model, tokenizer, task, examples, group, config, order)
            saved = {
                "raw": raw,
                "cal": cal,
                "labels": labels,
                "wall_s": time.time() - w0,
                "cpu_s": time.process_time() - c0,
            }
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(saved, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
        passes += 1
        wall, cpu = wall + saved["wall_s"], cpu + saved["cpu_s"]
        for pair, cols in zip(group["pairs"], group["cols"], strict=True):
            for calibration in CALIBRATIONS:
                logits = saved["cal"] if calibration else saved["raw"]
                rows.append(
                    {
                        "template": template,
                        "label_words": list(pair),
                        "calibration": calibration,
                        **score(logits[:limit], saved["labels"][:limit], cols),
                    }
                )
    return rows, {"passes": passes, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}


def rank_key(row: dict) -> tuple:
    return (-row["accuracy"], -row["macro_f1"], row["loss"])


def combo(row: dict) -> tuple:
    return row["template"], tuple(row["label_words"]), row["calibration"]


# ------------------------------------------------------------------------------- main


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def save(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False))
    os.replace(tmp, path)
    path.with_suffix(".md").write_text(render(data))


def run_check(model, tokenizer, task, config, rows_by_combo, which, n) -> list[dict]:
    """`evaluate_metrics` itself (a run's evaluation, in its order) on validation[:n] for
    each combo of `which`, beside this bench's figures for the same sentences."""
    from seedflood_p2p.algorithm.trainer import evaluate_metrics
    from seedflood_p2p.core.config import RunConfig

    out = []
    for template, words, calibration in which:
        run_task = replace(
            task,
            template=template,
            label_words=tuple(words),
            calibration=calibration,
            test=task.validation[:n],
        )
        run_config = replace(config, calibration=calibration)
        assert isinstance(run_config, RunConfig)
        metrics = evaluate_metrics(model, tokenizer, run_task, run_config, n)
        mine = rows_by_combo[(template, tuple(words), calibration)]
        out.append(
            {
                "template": template,
                "label_words": list(words),
                "calibration": calibration,
                "n": n,
                "evaluate_metrics": metrics,
                "bench": mine,
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--task", default="mr")
    parser.add_argument("--out", default="prompts-mr")
    parser.add_argument("--templates", type=int, default=len(TEMPLATES), help="the first N")
    parser.add_argument("--check-examples", type=int, default=160)
    parser.add_argument("--run-order", action="store_true", help="batch in the run's order")
    parser.add_argument("--skip-test", action="store_true")
    parser.add_argument("--render", action="store_true")
    args = parser.parse_args(argv)
    path = RESULTS / f"{args.out}.json"
    if args.render:
        path.with_suffix(".md").write_text(render(load(path)))
        return
    torch.set_num_threads(1)
    # Every module the scoring uses, imported now: a tree others edit may not import later.
    import seedflood_p2p.algorithm.objective
    import seedflood_p2p.algorithm.trainer
    import seedflood_p2p.workload.batching  # noqa: F401
    from seedflood_p2p.core.config import RunConfig
    from seedflood_p2p.workload.data import TaskSpec, load_task, split_sha256
    from seedflood_p2p.workload.models import load_model

    order = "run" if args.run_order else "length"
    config = RunConfig(model=args.model, dataset=args.task)  # a run's max_length, batch size
    task = load_task(args.task)
    if not task.validation:
        raise SystemExit(f"error: {args.task} has no validation split")
    model, tokenizer = load_model(args.model)
    val_sha = split_sha256(task.validation, "validation")
    templates = TEMPLATES[: args.templates]
    data = load(path)
    if data.get("meta", {}).get("validation_sha256") not in (None, val_sha):
        raise SystemExit(f"error: {path} was scored on other validation sentences")
    data["meta"] = {
        "command": " ".join(
            ["python bench/bench_prompts.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "model": args.model,
        "task": args.task,
        "validation_examples": len(task.validation),
        "validation_sha256": val_sha,
        "test_examples": len(task.test),
        "test_sha256": split_sha256(task.test, "test"),
        "max_length": config.max_length,
        "batch_size": config.batch_size,
        "order": order,
        "templates": templates,
        "pairs": [list(p) for p in PAIRS],
        "calibrations": list(CALIBRATIONS),
        "threads": torch.get_num_threads(),
        "chosen_on": "validation",
        "default": {"template": DEFAULT_TEMPLATE, "label_words": list(DEFAULT_WORDS)},
    }
    data.setdefault("validation", {})
    data.setdefault("timing", {})
    cache_key = [args.model, args.task, "validation", val_sha]
    for template in templates:
        if template in data["validation"]:
            continue
        rows, timing = score_template(
            model, tokenizer, task, task.validation, template, PAIRS, config, order, cache_key
        )
        data["validation"][template] = rows
        data["timing"][template] = timing
        best = min(rows, key=rank_key)
        print(
            f"{template!r}: {timing['passes']} pass(es), {timing['wall_s']} s; best "
            f"{best['label_words']} {best['calibration'] or 'uncalibrated'} "
            f"{best['accuracy']:.3f}",
            flush=True,
        )
        save(path, data)
    rows = sorted((r for t in templates for r in data["validation"][t]), key=rank_key)
    by_combo = {combo(r): r for r in rows}
    chosen = rows[0]
    data["chosen"] = {k: chosen[k] for k in ("template", "label_words", "calibration")}
    defaults = [(DEFAULT_TEMPLATE, DEFAULT_WORDS, c) for c in CALIBRATIONS]
    # Agreement with a run's own evaluation (its order, its batches) on the first sentences.
    check_of = [*defaults, combo(chosen)]
    check_of = list(dict.fromkeys((t, tuple(w), c) for t, w, c in check_of))
    if args.check_examples and "check" not in data:
        sub = {}
        for t, w, c in check_of:  # the first sentences' rows of the same cached pass
            sub_rows, _ = score_template(
                model,
                tokenizer,
                task,
                task.validation,
                t,
                PAIRS,
                config,
                order,
                cache_key,
                limit=args.check_examples,
            )
            sub[(t, w, c)] = next(r for r in sub_rows if combo(r) == (t, w, c))
        data["check"] = run_check(
            model, tokenizer, task, config, sub, check_of, args.check_examples
        )
        save(path, data)
    # Scored on test once: the chosen row and today's default, and nothing else.
    if not args.skip_test and "test" not in data:
        test_sha = split_sha256(task.test, "test")
        scored: list[dict] = []
        wanted: dict[str, list[tuple[tuple[str, ...], str]]] = {}
        for t, w, c in [combo(chosen), *defaults]:
            wanted.setdefault(t, []).append((tuple(w), c))
        timing = {}
        for t, want in wanted.items():
            pairs = list(dict.fromkeys(w for w, _ in want))
            test_rows, timing[t] = score_template(
                model,
                tokenizer,
                task,
                task.test,
                t,
                pairs,
                config,
                order,
                [args.model, args.task, "test", test_sha],
            )
            for r in test_rows:
                if (tuple(r["label_words"]), r["calibration"]) in want:
                    roles = ["chosen"] if combo(r) == combo(chosen) else []
                    if combo(r) in defaults:
                        roles.append(
                            "default, calibrated (the demo's)"
                            if r["calibration"]
                            else "default (RunConfig's, uncalibrated)"
                        )
                    r["role"] = " = ".join(roles)
                    r["validation_accuracy"] = by_combo[combo(r)]["accuracy"]
                    scored.append(r)
        data["test"] = {
            "rows": scored,
            "timing": timing,
            "scored_on": "test",
            "chosen_on": "validation",
        }
        save(path, data)
    # Does the choice carry? The top 3 (and the default) on other sentiment tasks' validation.
    if "carry" not in data:
        top = [combo(r) for r in rows[:3]]
        carry = []
        candidates = list(dict.fromkeys([*top, *defaults]))
        for name, dataset, names, own_words, split in OTHER_TASKS:
            spec = TaskSpec("classification", DEFAULT_TEMPLATE, DEFAULT_WORDS, names)
            other = load_task(dataset, spec=spec)
            examples = other.validation if split == "validation" else other.train + other.test
            if not examples:
                continue
            sha = split_sha256(examples, split)
            for t, w, c in candidates:
                pairs = list(dict.fromkeys([tuple(w), tuple(own_words)]))
                other_rows, _ = score_template(
                    model,
                    tokenizer,
                    other,
                    examples,
                    t,
                    pairs,
                    config,
                    order,
                    [args.model, dataset, split, sha],
                )
                for r in other_rows:
                    own = tuple(r["label_words"]) == tuple(own_words)
                    if r["calibration"] != c or (tuple(r["label_words"]) != tuple(w) and not own):
                        continue
                    r["task"] = name
                    r["split"] = split
                    mr_rank = top.index((t, w, c)) + 1 if (t, w, c) in top else None
                    r["mr_rank"] = mr_rank or "default"
                    r["words_from"] = "the task's own" if own else "the MR combo's"
                    r["mr_validation_accuracy"] = by_combo[(t, tuple(w), c)]["accuracy"]
                    carry.append(r)
        data["carry"] = carry
        save(path, data)
    save(path, data)
    print(f"wrote {path} and {path.with_suffix('.md')}")


# ----------------------------------------------------------------------------- render


def _words(words: list[str]) -> str:
    return " / ".join(json.dumps(w) for w in words)


def _template(template: str) -> str:
    return "`" + json.dumps(template)[1:-1] + "`"


def _cell(r: dict) -> str:
    return f"{r['accuracy']:.3f} [{r['sampling_se']:.3f}]"


def render(data: dict) -> str:
    meta = data.get("meta", {})
    if not meta:
        return "# Prompt search\n\n(no results yet)\n"
    templates = [t for t in meta["templates"] if t in data.get("validation", {})]
    rows = sorted((r for t in templates for r in data["validation"][t]), key=rank_key)
    lines = [
        f"# Prompt template and label words: {meta['model']} on {meta['task']}, zero-shot",
        "",
        f"Command: `{meta['command']}`",
        "",
        "**Chosen on validation, scored on test**: every (template, label words, "
        f"calibration) below is scored on the fixed validation split ({meta['validation_examples']}"
        f" of {meta['task']}'s training sentences, sha256 "
        f"`{meta['validation_sha256'][:16]}...`); only the "
        f"best of them and today's default are scored on the {meta['test_examples']} test "
        "sentences, once. The base model, a run's scoring path (`batching.calibrated`, "
        "`make_batch`, `objective.label_word_logits` / `calibrate`, `trainer.macro_f1`), "
        f"max_length {meta['max_length']}, batches of {meta['batch_size']} "
        f"({'sorted by length' if meta['order'] == 'length' else 'in the run order'}): a "
        "round-0 evaluation's figures. One forward pass per template scores every label-word "
        "pair (each pair's columns of the same next-token logits), with and without "
        "content-free calibration. Cells: accuracy [sampling SE sqrt(p(1-p)/n)].",
        "",
        f"{len(templates)} templates x {len(meta['pairs'])} label-word pairs x "
        f"{len(meta['calibrations'])} = {len(rows)} combinations on validation. The best of "
        f"{len(rows)} on {meta['validation_examples']} sentences is biased upwards (a winner's "
        "curse of a few SE); its "
        "test score is the unbiased figure.",
        "",
    ]
    if "test" in data:
        lines += [
            "## On test (scored once)",
            "",
            "| role | template | label words | calibration | validation acc | test acc "
            "[SE] | test macro-F1 | test loss |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in data["test"]["rows"]:
            lines.append(
                f"| {r['role']} | {_template(r['template'])} | {_words(r['label_words'])} | "
                f"{r['calibration'] or 'none'} | {r['validation_accuracy']:.3f} | {_cell(r)} | "
                f"{r['macro_f1']:.3f} | {r['loss']:.3f} |"
            )
        lines.append("")
    if data.get("chosen"):
        c = data["chosen"]
        words = " ".join(json.dumps(w) for w in c["label_words"])
        toml_words = ", ".join(json.dumps(w) for w in c["label_words"])
        lines += [
            "## The chosen setting in a run",
            "",
            f"Flags (bash; `$'...'` makes the \\n a newline): `--template "
            f"$'{json.dumps(c['template'])[1:-1]}' --label-words {words}"
            + (f" --calibration {c['calibration']}`" if c["calibration"] else "`")
            + ". In a settings TOML / the manifest (RunConfig fields, part of the run id, left "
            "out of the manifest only at their defaults): "
            f"`template = {json.dumps(c['template'])}`, `label_words = [{toml_words}]`"
            + (f', `calibration = "{c["calibration"]}"`' if c["calibration"] else "")
            + ".",
            "",
        ]
    top_n = 25
    lines += [
        f"## Validation: the top {min(top_n, len(rows))} of {len(rows)}",
        "",
        "| # | template | label words | calibration | accuracy [SE] | macro-F1 | loss | "
        "predicted positive |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows[:top_n], 1):
        lines.append(
            f"| {i} | {_template(r['template'])} | {_words(r['label_words'])} | "
            f"{r['calibration'] or 'none'} | {_cell(r)} | {r['macro_f1']:.3f} | "
            f"{r['loss']:.3f} | {r['predicted_positive']:.2f} |"
        )
    default = [
        (i, r)
        for i, r in enumerate(rows, 1)
        if r["template"] == DEFAULT_TEMPLATE and tuple(r["label_words"]) == DEFAULT_WORDS
    ]
    lines += [
        "",
        "Today's default on validation: "
        + "; ".join(
            f"{r['calibration'] or 'uncalibrated'} {_cell(r)}, macro-F1 {r['macro_f1']:.3f} "
            f"(rank {i})"
            for i, r in default
        )
        + ".",
        "",
    ]
    lines += [
        "## Validation: each template's best (all pairs, both calibrations)",
        "",
        "| template | best words | calibration | accuracy [SE] | macro-F1 | its best "
        "uncalibrated | forward passes | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in sorted(templates, key=lambda t: rank_key(min(data["validation"][t], key=rank_key))):
        best = min(data["validation"][t], key=rank_key)
        unc = min((r for r in data["validation"][t] if not r["calibration"]), key=rank_key)
        timing = data["timing"].get(t, {})
        lines.append(
            f"| {_template(t)} | {_words(best['label_words'])} | "
            f"{best['calibration'] or 'none'} | {_cell(best)} | {best['macro_f1']:.3f} | "
            f"{_cell(unc)} {_words(unc['label_words'])} | {timing.get('passes', '')} | "
            f"{timing.get('wall_s', '')} |"
        )
    lines += [
        "",
        "## Validation: each label-word pair's best",
        "",
        "| label words | template | calibration | accuracy [SE] | mean accuracy over "
        "templates, calibrated / not |",
        "|---|---|---|---|---|",
    ]
    pairs = [tuple(p) for p in meta["pairs"]]
    for p in sorted(
        pairs,
        key=lambda p: rank_key(
            min((r for r in rows if tuple(r["label_words"]) == p), key=rank_key)
        ),
    ):
        mine = [r for r in rows if tuple(r["label_words"]) == p]
        best = min(mine, key=rank_key)
        means = [
            sum(r["accuracy"] for r in mine if r["calibration"] == c)
            / max(1, sum(r["calibration"] == c for r in mine))
            for c in ("content-free", "")
        ]
        lines.append(
            f"| {_words(list(p))} | {_template(best['template'])} | "
            f"{best['calibration'] or 'none'} | {_cell(best)} | {means[0]:.3f} / {means[1]:.3f} |"
        )
    if data.get("check"):
        lines += [
            "",
            "## Check: a run's `evaluate_metrics` on the same sentences",
            "",
            f"The first {data['check'][0]['n']} validation sentences, scored by "
            "`trainer.evaluate_metrics` (the run's order and batches, one pair per task) and "
            "by this bench (one pass, every pair's columns):",
            "",
            "| template | label words | calibration | evaluate_metrics acc / F1 / loss | "
            "bench acc / F1 / loss |",
            "|---|---|---|---|---|",
        ]
        for c in data["check"]:
            e, b = c["evaluate_metrics"], c["bench"]
            lines.append(
                f"| {_template(c['template'])} | {_words(c['label_words'])} | "
                f"{c['calibration'] or 'none'} | {e['accuracy']:.4f} / {e['macro_f1']:.4f} / "
                f"{e['loss']:.5f} | {b['accuracy']:.4f} / {b['macro_f1']:.4f} / "
                f"{b['loss']:.5f} |"
            )
    if data.get("carry"):
        lines += [
            "",
            "## Does the choice carry? MR's top 3 on the other sentiment tasks' validation",
            "",
            "The repo's other binary sentiment tasks: `synthetic-sentiment` (generated "
            "sentences, each with one polar word) and `examples/tasks/sentiment.jsonl` (the "
            "`sentiment` preset's 48-row example; its validation split is a tenth of its "
            "training rows, 4 negative sentences, so it is scored on all 48 rows as well: "
            "nothing is chosen on it). MR's top 3 and today's default, each with its own "
            "words and with the "
            'task\'s own (the preset\'s " terrible" / " great").',
            "",
            "| task | split | MR rank | template | label words | words from | calibration | "
            "MR val acc | acc [SE] | macro-F1 | n |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in data["carry"]:
            lines.append(
                f"| {r['task']} | {r['split']} | {r['mr_rank']} | {_template(r['template'])} | "
                f"{_words(r['label_words'])} | {r['words_from']} | {r['calibration'] or 'none'} "
                f"| {r['mr_validation_accuracy']:.3f} | {_cell(r)} | {r['macro_f1']:.3f} | "
                f"{r['n']} |"
            )
    lines += [f"Note: {note}" for note in data.get("notes", [])]
    wall = sum(t.get("wall_s", 0) for t in data.get("timing", {}).values())
    test_wall = sum(t.get("wall_s", 0) for t in data.get("test", {}).get("timing", {}).values())
    lines += [
        "",
        f"Timing: {wall:.0f} s of forward passes for the {len(templates)} templates on "
        f"validation ({len(templates)} passes of {meta['validation_examples']} sentences + "
        f"their content-free rows; {meta['threads']} thread, one core of a loaded 2-core "
        f"machine), {test_wall:.0f} s on test.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
