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
from dataclasses import dataclass
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
    "load_task",
]

BUILTIN_TASKS = ("mr", "synthetic-sentiment", "synthetic-lm")

_COLUMN_FLAGS = "--text-column/--label-column"
log = logging.getLogger("seedflood.data")


@dataclass(frozen=True)
class Example:
    text: str
    label: int | None = None


@dataclass
class Task:
    """A named task with its train and test examples.

    For ``kind == "classification"`` label ``i`` is predicted by
    ``label_words[i]`` following ``template``; by default 0 = negative
    (" terrible") and 1 = positive (" great").
    """

    name: str
    kind: Literal["classification", "lm"]
    train: list[Example]
    test: list[Example]
    template: str = "{text}\nIt was"
    label_words: tuple[str, ...] = (" terrible", " great")

    @property
    def num_labels(self) -> int:
        return len(self.label_words) if self.kind == "classification" else 0


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


def _extract_mr(sdist: Path) -> bytes:
    try:
        with tarfile.open(sdist, "r:gz") as outer:
            inner_member = next(m for m in outer.getmembers() if m.name.endswith(_MR_INNER_TAR))
            inner_fh = outer.extractfile(inner_member)
            assert inner_fh is not None
            with tarfile.open(fileobj=io.BytesIO(inner_fh.read()), mode="r:gz") as inner:
                fh = inner.extractfile(inner.getmember(_MR_FILE))
                assert fh is not None
                return fh.read()
    except (tarfile.TarError, StopIteration, KeyError, OSError) as e:
        raise UserError(
            f"cannot read {_MR_FILE} from {sdist}: {e or type(e).__name__}. Delete that file "
            "so it is downloaded again"
        ) from None


def _mr_rows() -> list[dict[str, Any]]:
    root = assets.cache_dir() / "mr"
    cached = root / f"mr-v{_MR_VERSION}.jsonl"
    if not cached.is_file():
        with assets.file_lock(root / ".lock"):
            if not cached.is_file():
                sdist = assets.fetch(assets.VADER_SDIST)
                rows = _parse_mr(_extract_mr(sdist))
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
    return Task("mr", "classification", train=examples[n_test:], test=examples[:n_test])


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
        ((_digest(f"{e.label}\0{e.text}"), i) for i, e in enumerate(examples)),
        key=lambda k: k,
    )
    order = [examples[i] for _, i in keyed]
    return order[n_test:], order[:n_test]


def _parse_label(value: Any, where: str, num_labels: int) -> int:
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
        raise UserError(
            f"{where}: label {value!r} is not one of 0..{num_labels - 1}. Labels must be "
            "integers (0 = negative, 1 = positive); convert the label column, or pick another "
            f"with {_COLUMN_FLAGS}"
        )
    return label


def _rows_to_examples(
    rows: Iterable[tuple[str, Mapping[str, Any]]],
    source: str,
    text_column: str,
    label_column: str,
    num_labels: int,
) -> tuple[list[Example], bool]:
    """Turn ``(where, row)`` pairs into examples; labelled if the first row has the label."""
    examples: list[Example] = []
    labelled: bool | None = None
    for where, row in rows:
        if not isinstance(row, Mapping):
            raise UserError(
                f"{where}: expected an object with a '{text_column}' field, got "
                f"{type(row).__name__}. Each row must be one JSON object"
            )
        if labelled is None:
            columns = list(row.keys())
            if text_column not in row:
                raise UserError(
                    f"{source} has no column '{text_column}' (columns: "
                    f"{', '.join(map(str, columns)) or 'none'}). Choose the text and label "
                    f"columns with {_COLUMN_FLAGS}"
                )
            labelled = label_column in row and row[label_column] not in (None, "")
            if not labelled:  # say so: a mistyped --label-column would train the wrong thing
                log.warning(
                    "%s: no '%s' column in its first row: training as language modelling "
                    "(set %s for classification)",
                    source,
                    label_column,
                    _COLUMN_FLAGS,
                )
        text = row.get(text_column)
        if not isinstance(text, str):
            what = "missing" if text is None else f"a {type(text).__name__}, not text"
            raise UserError(f"{where}: column '{text_column}' is {what}. Fix or remove that row")
        if not text.strip():
            raise UserError(f"{where}: column '{text_column}' is empty. Fix or remove that row")
        label = None
        if labelled:
            value = row.get(label_column)
            if value is None or value == "":
                raise UserError(
                    f"{where}: column '{label_column}' is missing, but earlier rows have it. "
                    "Give every row a label, or none"
                )
            label = _parse_label(value, where, num_labels)
        examples.append(Example(text, label))
    if not examples:
        raise UserError(f"{source} has no rows. Give a file with at least 2 rows")
    return examples, bool(labelled)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8-sig") as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}, line {n}", json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{path}, line {n}: not valid JSON ({e.msg}). Each line must be one JSON object"
                ) from None


def _csv_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8-sig", newline="") as fh:
        reader = csv.DictReader(fh)
        if reader.fieldnames is None:
            return
        width = len(reader.fieldnames)
        try:
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
    path: Path, text_column: str, label_column: str, test_size: int | None, num_labels: int
) -> Task:
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".csv"):
        raise UserError(f"{path}: unsupported file type '{suffix}'. Give a .jsonl or .csv file")
    if not path.is_file():
        raise UserError(f"data file {path} does not exist. Check the path")
    if path.stat().st_size == 0:
        raise UserError(f"data file {path} is empty. Give a file with at least 2 rows")
    rows = _jsonl_rows(path) if suffix == ".jsonl" else _csv_rows(path)
    try:
        examples, labelled = _rows_to_examples(
            rows, str(path), text_column, label_column, num_labels
        )
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason}). Save it as UTF-8") from None
    train, test = _split(examples, test_size, str(path))
    return Task(path.name, "classification" if labelled else "lm", train=train, test=test)


def _load_hub(
    name: str, text_column: str, label_column: str, test_size: int | None, num_labels: int
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

    train, labelled = _rows_to_examples(
        rows_of("train"), f"dataset '{name}'", text_column, label_column, num_labels
    )
    test_split = next((s for s in ("test", "validation") if s in splits), None)
    if test_split is not None and test_size is None and len(splits[test_split]) > 0:
        first = splits[test_split][0]
        # Some hub test splits hide their labels (-1): then split train instead.
        if labelled and first.get(label_column) in (None, "", -1):
            test_split = None
    else:
        test_split = None
    if test_split is not None:
        test, _ = _rows_to_examples(
            rows_of(test_split), f"dataset '{name}'", text_column, label_column, num_labels
        )
    else:
        train, test = _split(train, test_size, f"dataset '{name}'")
    return Task(name, "classification" if labelled else "lm", train=train, test=test)


def load_task(
    name_or_path: str,
    *,
    text_column: str = "text",
    label_column: str = "label",
    test_size: int | None = None,
) -> Task:
    """Load a task by built-in name, local ``.jsonl``/``.csv`` path or hub dataset name.

    ``test_size`` is the number of test examples (default: 1000 for ``mr``,
    10% for files, the hub dataset's own test split when it has one).
    Raises :class:`UserError` for anything the user can fix.
    """
    name = str(name_or_path)
    num_labels = len(Task.label_words)  # the default label words: 0 = negative, 1 = positive
    if name == "mr":
        return _load_mr(test_size)
    if name == "synthetic-sentiment":
        task = _synthetic_sentiment()
    elif name == "synthetic-lm":
        task = _synthetic_lm()
    else:
        path = Path(name).expanduser()
        if path.suffix.lower() in (".jsonl", ".csv", ".json", ".txt", ".tsv") or path.exists():
            return _load_file(path, text_column, label_column, test_size, num_labels)
        return _load_hub(name, text_column, label_column, test_size, num_labels)
    if test_size is not None:
        train, test = _split(task.train + task.test, test_size, name)
        task = Task(task.name, task.kind, train=train, test=test)
    return task
