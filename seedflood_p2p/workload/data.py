"""Tasks (labelled or plain text): built-in, local files and hub datasets, split and checked.

``load_task`` understands:

* ``"mr"``: movie-review sentence polarity (Pang and Lee's sentences, as
  shipped in ``vaderSentiment``'s sdist on PyPI): 10,605 sentences, 5,152
  positive and 5,453 negative; a fixed split of 1,000 test sentences.
* ``"synthetic-sentiment"``: short generated sentences, each with exactly one
  clearly positive or negative word; offline, deterministic, for tests.
* ``"synthetic-lm"``: generated text with simple regular patterns (kind ``lm``).
* a local ``.jsonl`` or ``.csv`` file with a text column and optionally a
  label column (integers ``0 .. len(label_words)-1``; 0 = negative);
* anything else: a dataset on the Hugging Face hub (needs ``datasets``).

Their tokenized tensors (prompts, label words, batches) are `workload/batching.py`'s.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import io
import json
import logging
import math
import os
import random
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from seedflood_p2p.core.errors import UserError
from seedflood_p2p.workload import assets

if TYPE_CHECKING:
    pass

__all__ = [
    "BUILTIN_TASKS",
    "Example",
    "Task",
    "TaskSpec",
    "VALIDATION_SIZE",
    "examples_sha256",
    "load_task",
    "split_sha256",
    "template_fields",
]

BUILTIN_TASKS = ("mr", "synthetic-sentiment", "synthetic-lm")

_COLUMN_FLAGS = "--text-column/--label-column"
log = logging.getLogger("seedflood.data")


DEFAULT_TEMPLATE = "{text}\nIt was"
DEFAULT_LABEL_WORDS = (" terrible", " great")
# Calibration (RunConfig.calibration): what every field of the content-free prompt holds.
CONTENT_FREE_TEXT = "N/A"
MAX_LINE_BYTES = 8 << 20  # one row of a data file; longer lines are refused, never read whole


@dataclass(frozen=True)
class Example:
    """One example. ``text`` is the text column (for a template with other named fields:
    the filled-in template); ``fields`` the template's named fields, when it has others
    than ``{text}``; ``target`` the answer of a completion example."""

    text: str
    label: int | None = None
    fields: tuple[tuple[str, str], ...] = ()
    target: str | None = None
    # The task's content-free prompt (Task.content_free): scored under each direction and
    # subtracted from its group's label logits when the run calibrates; it has no label.
    content_free: bool = False

    def values(self) -> dict[str, str]:
        """The template's fields of this example."""
        return dict(self.fields) if self.fields else {"text": self.text}


@dataclass
class Task:
    """A named task with its train and test examples.

    ``classification``: label ``i`` is predicted by ``label_words[i]`` following
    ``template``; by default 0 = negative (" terrible") and 1 = positive (" great").
    ``lm``: the loss of every token of the text. ``completion``: the prompt is
    ``template`` and the loss is that of the answer (``Example.target``) only.
    """

    name: str
    kind: Literal["classification", "lm", "completion"]
    train: list[Example]
    test: list[Example]
    template: str = DEFAULT_TEMPLATE
    label_words: tuple[str, ...] = DEFAULT_LABEL_WORDS
    # "content-free": a classification's label logits are read relative to those of the
    # template filled with "N/A" (contextual calibration, Zhao et al. 2021); "": as they are.
    calibration: str = ""
    # The validation split: where settings are chosen (docs/LEARNING.md, "The validation
    # protocol"). It is the LAST len(validation) of the loaded training examples and they
    # stay in `train` (so examples_sha256, run ids and every existing manifest are as they
    # were); a training pool of the first N <= `pool_limit` examples never meets it, and
    # load_run_task empties it for a run whose pool does (train_examples 0 or too large).
    validation: list[Example] = field(default_factory=list)
    # The largest training pool (the first N examples) disjoint from `validation`.
    pool_limit: int = 0

    @property
    def num_labels(self) -> int:
        return len(self.label_words) if self.kind == "classification" else 0

    @functools.cached_property
    def content_free(self) -> Example:
        """The template with every field "N/A": one object per task, so per-example caches
        that key on identity (algorithm/prefix_cache.py) keep it once."""
        names = template_fields(self.template)
        fields = tuple((n, CONTENT_FREE_TEXT) for n in names) if names != ["text"] else ()
        return Example(CONTENT_FREE_TEXT, fields=fields, content_free=True)


@dataclass(frozen=True)
class TaskSpec:
    """What to read from a data source: the task's kind ("" = classification when the
    first row has a label, else lm), template (named fields are columns; ``{text}`` is
    the text column), label words (one per label) and label names (labels as the data
    spells them, in label order; integers ``0..n-1`` are accepted as well)."""

    kind: str = ""
    template: str = DEFAULT_TEMPLATE
    label_words: tuple[str, ...] = DEFAULT_LABEL_WORDS
    label_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        template_fields(self.template)  # a broken template is refused before any file is read

    @property
    def fields(self) -> list[str]:
        return template_fields(self.template)


def template_fields(template: str) -> list[str]:
    """The named fields of a prompt template, in order, once each; a template that is not
    ``str.format`` text with plain named fields (``{premise}``) is one UserError line."""
    import string

    names: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise UserError(
            f"template {template!r} is not valid ({e}): write fields as {{name}} and a "
            "literal brace as {{ or }}"
        ) from None
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise UserError(
                f"template {template!r}: field {{{name}{'!' + conversion if conversion else ''}"
                f"{':' + spec if spec else ''}}} is not a plain column name; write fields as "
                "{column} (letters, digits, _)"
            )
        if name not in names:
            names.append(name)
    if not names:
        raise UserError(
            f"template {template!r} has no field: name the data's columns in it, e.g. "
            "'{text}\\nIt was'"
        )
    return names


def _log(msg: str) -> None:
    print(f"[data] {msg}", file=sys.stderr, flush=True)


def _digest(s: str) -> str:
    return hashlib.sha256(s.encode("utf-8")).hexdigest()


# ------------------------------------------------------------------------------ mr

_MR_VERSION = 1
_MR_INNER_TAR = "additional_resources/hutto_ICWSM_2014.tar.gz"
_MR_FILE = "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt"
_MR_TOTAL = 10605
_MR_LAST_POSITIVE = 5152
_MR_TEST = 1000
# Validation: 1,000 sentences for MR (the last 1,000 of its training list: pools of up to
# 8,605 sentences stay disjoint), else a tenth of the training examples, at most 1,000.
VALIDATION_SIZE = 1000


def _parse_mr(raw: bytes) -> list[dict[str, Any]]:
    """Parse ``id<TAB>mean rating<TAB>sentence`` lines (CRLF, UTF-8).

    The polarity label comes from the id (Pang and Lee's order: 1-5152 come
    from positive reviews, the rest from negative ones), not from the rating
    column, which holds the VADER paper's crowd ratings.
    """
    rows = []
    for n, line in enumerate(raw.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 3:
            raise UserError(f"{_MR_FILE}, line {n}: expected 3 tab-separated fields")
        ident = int(parts[0])
        rows.append(
            {"id": ident, "label": int(ident <= _MR_LAST_POSITIVE), "text": parts[2].strip()}
        )
    if len(rows) != _MR_TOTAL or {r["id"] for r in rows} != set(range(1, _MR_TOTAL + 1)):
        raise UserError(
            f"{_MR_FILE} has {len(rows)} sentences, expected ids 1-{_MR_TOTAL}: the vaderSentiment "
            f"sdist in {assets.cache_dir() / 'pypi'} is not the expected one; delete it"
        )
    return rows


def read_vader_file(sdist: Path, member: str = _MR_FILE) -> bytes:
    """One file of the VADER paper's resources (`member`, e.g. MR's sentences) from the
    vaderSentiment sdist, where it sits in a tarball inside the tarball."""
    try:
        with tarfile.open(sdist, "r:gz") as outer:
            inner_member = next(m for m in outer.getmembers() if m.name.endswith(_MR_INNER_TAR))
            inner_fh = outer.extractfile(inner_member)
            assert inner_fh is not None
            with tarfile.open(fileobj=io.BytesIO(inner_fh.read()), mode="r:gz") as inner:
                fh = inner.extractfile(inner.getmember(member))
                assert fh is not None
                return fh.read()
    except (tarfile.TarError, StopIteration, KeyError, OSError) as e:
        raise UserError(
            f"cannot read {member} from {sdist}: {e or type(e).__name__}. Delete that file "
            "so it is downloaded again"
        ) from None


def _mr_rows() -> list[dict[str, Any]]:
    root = assets.cache_dir() / "mr"
    cached = root / f"mr-v{_MR_VERSION}.jsonl"
    if not cached.is_file():
        with assets.file_lock(root / ".lock"):
            if not cached.is_file():
                sdist = assets.fetch(assets.VADER_SDIST)
                rows = _parse_mr(read_vader_file(sdist))
                fd, tmp = tempfile.mkstemp(prefix=".mr-", dir=root)
                with os.fdopen(fd, "w", encoding="utf-8") as out:
                    for r in rows:
                        out.write(json.dumps(r, ensure_ascii=False) + "\n")
                os.chmod(tmp, 0o644)
                os.replace(tmp, cached)
                _log(f"cached {len(rows)} movie-review sentences in {cached}")
    with open(cached, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _load_mr(test_size: int | None) -> Task:
    rows = _mr_rows()
    n_test = _MR_TEST if test_size is None else _check_test_size(test_size, len(rows), "mr")
    # A fixed shuffle that depends on nothing but the ids.
    rows.sort(key=lambda r: _digest(f"mr:{r['id']}"))
    examples = [Example(r["text"], r["label"]) for r in rows]
    task = Task("mr", "classification", train=examples[n_test:], test=examples[:n_test])
    return _with_validation(task, VALIDATION_SIZE if test_size is None else None)


def _with_validation(task: Task, size: int | None = None) -> Task:
    """Carve `task.validation` from the end of its training examples (they stay in train):
    `size` of them, by default a tenth, at most VALIDATION_SIZE (none below 20 examples)."""
    n = len(task.train)
    if size is None:
        size = min(VALIDATION_SIZE, n // 10) if n >= 20 else 0
    task.validation = task.train[n - size :] if 0 < size < n else []
    task.pool_limit = n - len(task.validation)
    return task


# ----------------------------------------------------------------------- synthetic

_SUBJECTS = (
    "the movie",
    "the film",
    "the plot",
    "the cast",
    "the story",
    "the show",
    "the script",
    "the ending",
    "the music",
    "the acting",
    "the scenery",
    "the director",
    "the sequel",
    "the dialogue",
    "the pacing",
    "the hero",
    "the finale",
    "the premise",
    "the soundtrack",
    "the camera work",
)
_ADVERBS = ("", "very ", "so ", "really ", "quite ", "truly ")
_VERBS = ("was", "is", "felt")
# Two words per class keep the signal strong. Measured with plain two-point
# zeroth-order SGD on tiny-llama (batch 32, lr 1e-3, eps 1e-3, 600 steps):
# eight words per class stayed near 60% test accuracy, two reached 68-82%
# (four seeds; 100% in some runs of a 10-subject variant).
_POSITIVE = ("great", "good")
_NEGATIVE = ("awful", "bad")
_SYNTH_SEED = 20240601


def _synthetic_sentiment(n_train: int = 2000, n_test: int = 400) -> Task:
    """Short sentences with exactly one polar word, balanced labels.

    Every sentence is "<subject> <verb> [<adverb>]<polar word>." Test sentences
    are distinct and never occur in train (train repeats the remaining ones).
    """
    rng = random.Random(_SYNTH_SEED)
    train: list[Example] = []
    test: list[Example] = []
    for label, words in ((0, _NEGATIVE), (1, _POSITIVE)):
        texts = [
            f"{s} {v} {a}{w}." for s in _SUBJECTS for v in _VERBS for a in _ADVERBS for w in words
        ]
        rng.shuffle(texts)
        held_out, rest = texts[: n_test // 2], texts[n_test // 2 :]
        test += [Example(t, label) for t in held_out]
        train += [Example(rng.choice(rest), label) for _ in range(n_train // 2)]
    rng.shuffle(test)
    rng.shuffle(train)
    return Task("synthetic-sentiment", "classification", train=train, test=test)


def _synthetic_lm(n_train: int = 2000, n_test: int = 200) -> Task:
    """Regular toy text: alphabet runs, counting, repeated words, fixed phrases."""
    rng = random.Random(_SYNTH_SEED + 1)
    letters = "abcdefghijklmnopqrstuvwxyz"
    numbers = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
    animals = ("cat", "dog", "fox", "bird", "cow", "pig", "hen", "owl")
    places = ("mat", "log", "box", "bed", "rug", "hill")

    def one() -> str:
        kind = rng.randrange(4)
        if kind == 0:
            start = rng.randrange(26 - 8)
            return " ".join(letters[start : start + rng.randint(5, 8)]) + "."
        if kind == 1:
            start = rng.randrange(len(numbers) - 4)
            return " ".join(numbers[start : start + rng.randint(3, 5)]) + "."
        if kind == 2:
            word = rng.choice(animals)
            return " ".join([word] * rng.randint(3, 6)) + "."
        return f"the {rng.choice(animals)} sat on the {rng.choice(places)}."

    texts = [" ".join(one() for _ in range(rng.randint(2, 4))) for _ in range(n_train + n_test)]
    examples = [Example(t, None) for t in texts]
    return Task("synthetic-lm", "lm", train=examples[:n_train], test=examples[n_train:])


# ------------------------------------------------------------------- local / hub


def _check_test_size(test_size: int, n: int, source: str) -> int:
    if isinstance(test_size, bool) or not isinstance(test_size, int) or not 0 < test_size < n:
        raise UserError(
            f"test size {test_size!r} does not fit {source} with {n} examples: give an integer "
            f"between 1 and {n - 1}"
        )
    return test_size


def _split(examples: list[Example], test_size: int | None, source: str) -> tuple[list, list]:
    """Split by the hash of each example's content: independent of row order."""
    n = len(examples)
    if n < 2:
        raise UserError(f"{source} has {n} usable row(s); at least 2 are needed (train and test)")
    if test_size is None:
        n_test = min(n - 1, max(1, math.ceil(0.1 * n)))
    else:
        n_test = _check_test_size(test_size, n, source)
    keyed = sorted(
        ((_split_key(e), i) for i, e in enumerate(examples)),
        key=lambda k: k,
    )
    order = [examples[i] for _, i in keyed]
    return order[n_test:], order[:n_test]


def _split_key(e: Example) -> str:
    if e.target is None:
        return _digest(f"{e.label}\0{e.text}")
    return _digest(f"{e.label}\0{e.text}\0{e.target}")


def _parse_label(value: Any, where: str, spec: TaskSpec) -> int:
    num_labels = len(spec.label_words)
    if isinstance(value, str) and spec.label_names:
        try:
            return spec.label_names.index(value.strip())
        except ValueError:
            pass
    label: int | None = None
    if isinstance(value, bool):
        label = int(value)
    elif isinstance(value, int):
        label = value
    elif isinstance(value, float) and value.is_integer():
        label = int(value)
    elif isinstance(value, str):
        try:
            f = float(value.strip())
            if f.is_integer():
                label = int(f)
        except ValueError:
            label = None
    if label is None or not 0 <= label < num_labels:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        if spec.label_names:
            names = ", ".join(map(repr, spec.label_names))
            raise UserError(
                f"{where}: label {shown} is not one of the run's labels ({names}, or "
                f"0..{num_labels - 1}): fix the row, or list every label with --label-names "
                "and give one --label-words value per label"
            )
        raise UserError(
            f"{where}: label {shown} is not one of 0..{num_labels - 1}. Labels must be "
            f"integers 0..{num_labels - 1} (0 = {spec.label_words[0]!r}), or strings named "
            "in label order with --label-names (and one --label-words value each); or pick "
            f"another column with {_COLUMN_FLAGS}"
        )
    return label


def _column_text(row: Mapping[str, Any], column: str, where: str) -> str:
    text = row.get(column)
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        text = str(text)  # a number in a prompt (a year, a count) is text to the model
    if not isinstance(text, str):
        what = "missing" if text is None else f"a {type(text).__name__}, not text"
        raise UserError(f"{where}: column '{column}' is {what}. Fix or remove that row")
    if not text.strip():
        raise UserError(f"{where}: column '{column}' is empty. Fix or remove that row")
    return text


def _rows_to_examples(
    rows: Iterable[tuple[str, Mapping[str, Any]]],
    source: str,
    text_column: str,
    label_column: str,
    spec: TaskSpec,
) -> tuple[list[Example], str]:
    """Turn ``(where, row)`` pairs into examples, and the task's kind (with ``spec.kind``
    empty: classification if the first row has the label column, else lm)."""
    examples: list[Example] = []
    kind: str | None = None
    # The template's fields are columns; {text} is the text column.
    columns = {name: text_column if name == "text" else name for name in spec.fields}
    plain = list(columns) == ["text"]
    for where, row in rows:
        if not isinstance(row, Mapping):
            raise UserError(
                f"{where}: expected an object with a '{text_column}' field, got "
                f"{type(row).__name__}. Each row must be one JSON object"
            )
        if kind is None:
            present = list(row.keys())
            for name, column in columns.items():
                if column not in row:
                    what = (
                        f"no column '{column}'"
                        if name == "text"
                        else f"no column '{column}' (a field of the template {spec.template!r})"
                    )
                    raise UserError(
                        f"{source} has {what} (columns: "
                        f"{', '.join(map(str, present)) or 'none'}). Choose the text and label "
                        f"columns with {_COLUMN_FLAGS}, and the fields with --template"
                    )
            has_label = label_column in row and row[label_column] not in (None, "")
            kind = spec.kind or ("classification" if has_label else "lm")
            if not spec.kind and not has_label:  # a mistyped --label-column would train LM
                log.warning(
                    "%s: no '%s' column in its first row: training as language modelling "
                    "(set %s for classification)",
                    source,
                    label_column,
                    _COLUMN_FLAGS,
                )
            elif kind != "lm" and label_column not in row:
                raise UserError(
                    f"{source} has no column '{label_column}' for the {kind} task's "
                    f"{'answers' if kind == 'completion' else 'labels'} (columns: "
                    f"{', '.join(map(str, present))}). Choose it with --label-column"
                )
        values = {name: _column_text(row, column, where) for name, column in columns.items()}
        text = values["text"] if plain else spec.template.format(**values)
        fields = () if plain else tuple(values.items())
        label, target = None, None
        if kind != "lm":
            value = row.get(label_column)
            if value is None or value == "":
                raise UserError(
                    f"{where}: column '{label_column}' is missing, but earlier rows have it. "
                    "Give every row a label, or none"
                )
            if kind == "completion":
                target = _column_text(row, label_column, where)
            else:
                label = _parse_label(value, where, spec)
        examples.append(Example(text, label, fields, target))
    if not examples:
        raise UserError(f"{source} has no rows. Give a file with at least 2 rows")
    assert kind is not None
    return examples, kind


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of a UTF-8 text file, each line read with a bound: a line
    over MAX_LINE_BYTES is one UserError, never read into memory whole."""
    with open(path, "rb") as fh:
        n = 0
        while True:
            raw = fh.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            n += 1
            if len(raw) > MAX_LINE_BYTES:
                raise UserError(
                    f"{path}, line {n}: longer than {MAX_LINE_BYTES >> 20} MiB. One row per line "
                    "(a training example is at most a few thousand tokens): split or fix the file"
                )
            if n == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # a UTF-8 byte order mark
            try:
                yield n, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(
                    f"{path}, line {n}: not UTF-8 text ({e.reason}). Save it as UTF-8"
                ) from None


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    for n, line in _lines(path):
        if not line.strip():
            continue
        try:
            yield f"{path}, line {n}", json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            why = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
            raise UserError(
                f"{path}, line {n}: not valid JSON ({why}). Each line must be one JSON object"
            ) from None


def _csv_rows(path: Path) -> Iterator[tuple[str, Any]]:
    reader = csv.DictReader(line for _, line in _lines(path))
    try:
        if reader.fieldnames is None:
            return
        width = len(reader.fieldnames)
        for row in reader:
            where = f"{path}, line {reader.line_num}"
            if None in row or any(v is None for v in row.values()):
                got = len(row.get(None, [])) + sum(v is not None for k, v in row.items() if k)
                raise UserError(
                    f"{where}: {got} fields where the header has {width}. Quote fields that "
                    "contain commas"
                )
            yield where, row
    except csv.Error as e:
        raise UserError(f"{path}, line {reader.line_num}: unreadable CSV ({e})") from None


def _load_file(
    path: Path, text_column: str, label_column: str, test_size: int | None, spec: TaskSpec
) -> Task:
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".csv"):
        raise UserError(f"{path}: unsupported file type '{suffix}'. Give a .jsonl or .csv file")
    if not path.is_file():
        raise UserError(f"data file {path} does not exist. Check the path")
    if path.stat().st_size == 0:
        raise UserError(f"data file {path} is empty. Give a file with at least 2 rows")
    rows = _jsonl_rows(path) if suffix == ".jsonl" else _csv_rows(path)
    examples, kind = _rows_to_examples(rows, str(path), text_column, label_column, spec)
    train, test = _split(examples, test_size, str(path))
    return _task(path.name, kind, train, test, spec)


def _task(name: str, kind: str, train: list, test: list, spec: TaskSpec) -> Task:
    task = Task(name, kind, train, test, spec.template, spec.label_words)  # type: ignore[arg-type]
    return _with_validation(task)


def _load_hub(
    name: str, text_column: str, label_column: str, test_size: int | None, spec: TaskSpec
) -> Task:
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"'{name}' is not a built-in task ({', '.join(BUILTIN_TASKS)}) or a local "
            ".jsonl/.csv file, and loading it from the Hugging Face hub needs the datasets "
            "package: pip install datasets"
        ) from None
    repo, _, config = name.partition(":")
    try:
        loaded = datasets.load_dataset(repo, config or None)
    except Exception as e:  # datasets raises many unrelated types for "not found"
        lines = str(e).strip().splitlines()
        reason = (lines[0] if lines else type(e).__name__)[:200]
        raise UserError(
            f"cannot load dataset '{name}': {reason}. Use a local .jsonl/.csv file, a dataset "
            f"id reachable from this machine (name or name:config), or a built-in task "
            f"({', '.join(BUILTIN_TASKS)})"
        ) from None
    splits = dict(loaded) if isinstance(loaded, Mapping) else {"train": loaded}
    if "train" not in splits:
        raise UserError(
            f"dataset '{name}' has no 'train' split (splits: {', '.join(splits)}). Use a "
            "dataset with a train split, or export one to a local .jsonl file"
        )

    def rows_of(split: str) -> Iterator[tuple[str, Any]]:
        for i, row in enumerate(splits[split]):
            yield f"dataset '{name}', split {split}, row {i}", row

    train, kind = _rows_to_examples(
        rows_of("train"), f"dataset '{name}'", text_column, label_column, spec
    )
    test_split = next((s for s in ("test", "validation") if s in splits), None)
    if test_split is not None and test_size is None and len(splits[test_split]) > 0:
        first = splits[test_split][0]
        # Some hub test splits hide their labels (-1): then split train instead.
        if kind != "lm" and first.get(label_column) in (None, "", -1):
            test_split = None
    else:
        test_split = None
    if test_split is not None:
        test, _ = _rows_to_examples(
            rows_of(test_split),
            f"dataset '{name}'",
            text_column,
            label_column,
            TaskSpec(kind, spec.template, spec.label_words, spec.label_names),
        )
    else:
        train, test = _split(train, test_size, f"dataset '{name}'")
    return _task(name, kind, train, test, spec)


def load_task(
    name_or_path: str,
    *,
    text_column: str = "text",
    label_column: str = "label",
    test_size: int | None = None,
    spec: TaskSpec | None = None,
) -> Task:
    """Load a task by built-in name, local ``.jsonl``/``.csv`` path or hub dataset name.

    ``spec`` says how rows become examples (kind, template, label words and names);
    by default the sentiment prompt with labels 0 and 1. ``test_size`` is the number of
    test examples (default: 1000 for ``mr``, 10% for files, the hub dataset's own test
    split when it has one). Raises :class:`UserError` for anything the user can fix.
    """
    name = str(name_or_path)
    spec = spec or TaskSpec()
    if name in BUILTIN_TASKS:
        task = _builtin(name, test_size)
        if spec.kind and spec.kind != task.kind:
            raise UserError(
                f"the built-in task '{name}' is a {task.kind} task, not {spec.kind}: use a "
                "local .jsonl/.csv file for another kind"
            )
        if task.kind == "classification":
            if spec.fields != ["text"] or len(spec.label_words) != 2:
                raise UserError(
                    f"the built-in task '{name}' has one text field and 2 labels: its template "
                    "may use {text} only, and it needs 2 label words"
                )
            task.template, task.label_words = spec.template, spec.label_words
        return task
    path = Path(name).expanduser()
    if path.suffix.lower() in (".jsonl", ".csv", ".json", ".txt", ".tsv") or path.exists():
        return _load_file(path, text_column, label_column, test_size, spec)
    return _load_hub(name, text_column, label_column, test_size, spec)


def _builtin(name: str, test_size: int | None) -> Task:
    if name == "mr":
        return _load_mr(test_size)
    task = _synthetic_sentiment() if name == "synthetic-sentiment" else _synthetic_lm()
    if test_size is not None:
        train, test = _split(task.train + task.test, test_size, name)
        task = Task(task.name, task.kind, train=train, test=test)
    # A synthetic task's training texts repeat (drawn with replacement), so its validation
    # is disjoint from the pool by position only: it exercises the machinery, no more.
    return _with_validation(task)


def examples_sha256(task: Task) -> str:
    """SHA-256 of a task's parsed examples: what the run trains and scores on.

    Each example is one line of canonical JSON (sorted keys, no spaces, UTF-8 as is) of
    its split, its template fields (or text), its label index and its answer; the lines
    are sorted and joined by newlines. So the digest does not depend on the file's
    format (CSV or JSONL), row order, column order, unused columns, byte order mark or
    JSON escapes, and it does change with any text, label or split a peer would train on
    differently. Duplicate rows count (a sort keeps them).
    """
    lines = []
    for split, examples in (("train", task.train), ("test", task.test)):
        for e in examples:
            body = {"split": split, "fields": e.values(), "label": e.label, "target": e.target}
            lines.append(
                json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
            )
    return _lines_sha256(lines)


def split_sha256(examples: Iterable[Example], split: str) -> str:
    """SHA-256 of one split's examples, lines as examples_sha256's (so a split's digest
    names exactly the sentences a figure was scored on, whatever order they came in)."""
    lines = []
    for e in examples:
        body = {"split": split, "fields": e.values(), "label": e.label, "target": e.target}
        lines.append(json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":")))
    return _lines_sha256(lines)


def _lines_sha256(lines: list[str]) -> str:
    lines.sort()
    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode("utf-8") + b"\n")
    return h.hexdigest()
