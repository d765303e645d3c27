"""A run's task from its settings: presets for common shapes, and the one loader.

The task settings of `RunConfig` (`task`, `kind`, `template`, `label_words`,
`label_names`, `text_column`, `label_column`, `max_length`) are part of the run id.
A preset fills in what the run does not set; an empty setting means "the preset's"
(or, without a preset, the sentiment prompt of the built-in tasks). docs/TASKS.md
documents each preset with its example file in examples/tasks/.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.workload.data import (
    DEFAULT_LABEL_WORDS,
    DEFAULT_TEMPLATE,
    Task,
    TaskSpec,
    load_task,
)

__all__ = [
    "PRESETS",
    "Preset",
    "check_asset",
    "is_local_path",
    "local_assets",
    "load_run_task",
    "run_sources",
    "task_spec",
]


@dataclass(frozen=True)
class Preset:
    kind: str
    template: str
    label_words: tuple[str, ...] = ()
    label_names: tuple[str, ...] = ()
    label_column: str = ""  # read when the run keeps the default label column ("label")
    example: str = ""  # examples/tasks/<file>
    help: str = ""


PRESETS: dict[str, Preset] = {
    "sentiment": Preset(
        "classification",
        DEFAULT_TEMPLATE,
        DEFAULT_LABEL_WORDS,
        ("negative", "positive"),
        example="sentiment.jsonl",
        help="one text, negative/positive (0/1)",
    ),
    "sentiment3": Preset(
        "classification",
        DEFAULT_TEMPLATE,
        (" terrible", " okay", " great"),
        ("negative", "neutral", "positive"),
        example="sentiment3.csv",
        help="one text, negative/neutral/positive",
    ),
    "nli": Preset(
        "classification",
        "{premise}\nQuestion: {hypothesis}? Yes, Maybe or No?\nAnswer:",
        (" Yes", " Maybe", " No"),
        ("entailment", "neutral", "contradiction"),
        example="nli.csv",
        help="premise and hypothesis, entailment/neutral/contradiction (SuperGLUE CB, RTE)",
    ),
    "yesno": Preset(
        "classification",
        "{passage}\nQuestion: {question}?\nAnswer:",
        (" No", " Yes"),
        ("no", "yes"),
        example="yesno.jsonl",
        help="passage and question, no/yes or false/true (SuperGLUE BoolQ)",
    ),
    "multiple-choice": Preset(
        "classification",
        "{question}\nA. {A}\nB. {B}\nC. {C}\nD. {D}\nAnswer:",
        (" A", " B", " C", " D"),
        ("A", "B", "C", "D"),
        label_column="answer",
        example="multiple_choice.jsonl",
        help="question and four options A-D, the answer's letter",
    ),
    "completion": Preset(
        "completion",
        "{prompt}",
        label_column="answer",
        example="completion.jsonl",
        help="prompt and answer; the loss of the answer's tokens only",
    ),
    "lm": Preset("lm", "{text}", example="lm.jsonl", help="plain text; the loss of every token"),
}


def task_spec(config: RunConfig) -> tuple[TaskSpec, str]:
    """The run's TaskSpec and label column: its own settings over its preset's."""
    preset = Preset("", DEFAULT_TEMPLATE)
    if config.task:
        if config.task not in PRESETS:
            raise UserError(
                f"unknown task preset {config.task!r}: use one of {', '.join(PRESETS)} "
                "(docs/TASKS.md), or leave --task out and set --template and --label-words"
            )
        preset = PRESETS[config.task]
    kind = config.kind or preset.kind
    template = config.template or preset.template
    if not config.template and not config.task and kind in ("lm", "completion"):
        template = "{text}"  # the sentiment prompt is no default for text or answers
    names = tuple(config.label_names) or preset.label_names
    words = tuple(config.label_words)
    if not words:
        if config.label_names:  # a label's word: its name after a space
            words = tuple(" " + n for n in config.label_names)
        else:
            words = preset.label_words or DEFAULT_LABEL_WORDS
    if names and len(names) != len(words):
        raise UserError(
            f"the task has {len(words)} label words ({', '.join(map(repr, words))}) and "
            f"{len(names)} label names ({', '.join(map(repr, names))}): give one of each per "
            "label, in label order (--label-words and --label-names)"
        )
    if kind in ("", "classification") and len(words) < 2:
        raise UserError("a classification task needs at least 2 label words (--label-words)")
    label_column = config.label_column
    if preset.label_column and label_column == "label":
        label_column = preset.label_column
    return TaskSpec(kind, template, words, names), label_column


def load_run_task(config: RunConfig, dataset: str | None = None) -> Task:
    """The run's task, read from `dataset` (default: the run's own `dataset` setting)."""
    spec, label_column = task_spec(config)
    task = load_task(
        dataset or config.dataset,
        text_column=config.text_column,
        label_column=label_column,
        spec=spec,
    )
    if config.train_examples:
        if config.train_examples > len(task.train):
            raise UserError(
                f"train_examples {config.train_examples}: '{task.name}' has "
                f"{len(task.train)} training examples; lower --train-examples (0: all)"
            )
        task.train = task.train[: config.train_examples]
    if task.validation and not 0 < config.train_examples <= task.pool_limit:
        task.validation = []  # the run trains on them: nothing of its train is held out
    if config.calibration:
        if task.kind != "classification":
            raise UserError(
                f"--calibration {config.calibration} needs a classification task; "
                f"'{task.name}' is {task.kind}: leave --calibration out"
            )
        task.calibration = config.calibration
    return task


_LOCAL_SUFFIXES = (".jsonl", ".csv", ".json", ".txt", ".tsv", ".gguf", ".safetensors")


def is_local_path(name: str, builtins: tuple[str, ...] = ()) -> bool:
    """Whether a model or dataset name of a manifest names a file of this machine: a path
    (/, ., ~, \\), a data or weights file name, or anything that exists here. Such a name
    is the organiser's business; a peer never opens it on a manifest's word."""
    if name in builtins:
        return False
    return (
        name.startswith(("/", ".", "~", "\\"))
        or name.lower().endswith(_LOCAL_SUFFIXES)
        or os.path.lexists(name)
    )


def local_assets(config: RunConfig) -> list[str]:
    """The run's assets ("model", "dataset") that it names by a path of the organiser's
    machine, and its activation basis ("basis") when it has one: what joiners get from
    peers by digest (network/transfer/assets.py)."""
    from seedflood_p2p.workload.data import BUILTIN_TASKS
    from seedflood_p2p.workload.models import BUILTIN_MODELS

    kinds = []
    if is_local_path(config.model, BUILTIN_MODELS):
        kinds.append("model")
    if is_local_path(config.dataset, BUILTIN_TASKS):
        kinds.append("dataset")
    if config.basis_sha256:
        kinds.append("basis")
    return kinds


def check_asset(config: RunConfig, kind: str, path: Path) -> str | None:
    """None when `path` holds the run's model (kind "model"), data (kind "dataset") or
    basis artifact (kind "basis"), as the manifest's base_sha256 / dataset_sha256 /
    basis_sha256 say; else why not, in a few words."""
    from seedflood_p2p.workload.data import examples_sha256
    from seedflood_p2p.workload.models import load_model, weights_sha256

    if kind == "basis":  # an artifact is its bytes: the file's own digest
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        if digest == config.basis_sha256:
            return None
        return f"SHA-256 {digest[:16]}..., not {config.basis_sha256[:16]}..."
    expected = config.base_sha256 if kind == "model" else config.dataset_sha256
    if not expected:
        return f"the run's manifest has no digest of its {kind} to check a copy against"
    try:
        if kind == "model":
            digest = weights_sha256(load_model(str(path))[0])
        else:
            digest = examples_sha256(load_run_task(config, str(path)))
    except UserError as exc:
        return str(exc)[:200]
    return None if digest == expected else f"SHA-256 {digest[:16]}..., not {expected[:16]}..."


def run_sources(
    config: RunConfig, model_dir: Path | None = None, dataset_file: Path | None = None
) -> tuple[str, str]:
    """What a peer loads for a run whose manifest came from the network: (model, dataset).

    Built-in names and hub ids are the manifest's; a name that is a local path is never
    opened: this peer's own copy (`model_dir`, `dataset_file`; checked against the
    manifest's digests by the caller) stands in for it, and without one the peer refuses
    with one line saying what to pass."""
    from seedflood_p2p.workload.data import BUILTIN_TASKS
    from seedflood_p2p.workload.models import BUILTIN_MODELS

    model = str(model_dir) if model_dir is not None else config.model
    dataset = str(dataset_file) if dataset_file is not None else config.dataset
    if model_dir is None and is_local_path(config.model, BUILTIN_MODELS):
        raise UserError(
            f"the run's model {config.model!r} is a path on the organiser's machine, and a "
            "peer never opens a path named by a manifest from the network: pass --model-dir "
            f"with your copy of it (checked against the run's base weights SHA-256 "
            f"{config.base_sha256[:16] or '(none)'}...)"
        )
    if dataset_file is None and is_local_path(config.dataset, BUILTIN_TASKS):
        raise UserError(
            f"the run's dataset {config.dataset!r} is a path on the organiser's machine, and "
            "a peer never opens a path named by a manifest from the network: pass "
            f"--dataset-file with your copy of it (checked against the run's dataset_sha256 "
            f"{config.dataset_sha256[:16] or '(none)'}...)"
        )
    return model, dataset
