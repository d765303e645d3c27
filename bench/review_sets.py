"""Two sentiment data sets beside MR, for checking that the demo's defaults carry (issue 47).

The VADER paper's sdist (the pinned `vaderSentiment==3.3.2` that MR already comes from)
also ships crowd-rated Amazon product-review sentences and tweets, each with the mean of
20 raters' scores on -4..+4. This writes each as a `text,label` CSV an organiser could
bring (`seedflood demo --dataset FILE.csv`): label 1 for a mean of at least +0.5, 0 for
at most -0.5, the lukewarm middle and repeated sentences left out. A CSV is split by
the hash of each row (workload/data.py): a tenth is test, a tenth of the rest validation.

    python bench/review_sets.py            # -> ~/.cache/seedflood/reviews/{amazon,tweets}.csv
"""

from __future__ import annotations

import argparse
import csv
import hashlib
from pathlib import Path

from seedflood_p2p.workload import assets
from seedflood_p2p.workload.data import read_vader_file

SETS = {
    "amazon": "hutto_ICWSM_2014/amazonReviewSnippets_GroundTruth.txt",
    "tweets": "hutto_ICWSM_2014/tweets_GroundTruth.txt",
}
MARGIN = 0.5  # |mean rating| below this is neither side


def rows_of(text: str) -> list[tuple[str, int]]:
    """(sentence, label) for each line `id<TAB>mean rating<TAB>sentence` clear of MARGIN."""
    seen: set[str] = set()
    rows = []
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) != 3:
            continue
        score, sentence = float(parts[1]), " ".join(parts[2].split())
        if abs(score) < MARGIN or not sentence or sentence in seen:
            continue
        seen.add(sentence)
        rows.append((sentence, int(score > 0)))
    return rows


def write_sets(out: Path) -> dict[str, dict]:
    sdist = assets.fetch(assets.VADER_SDIST)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, member in SETS.items():
        rows = rows_of(read_vader_file(sdist, member).decode("utf-8", errors="replace"))
        path = out / f"{name}.csv"
        with open(path, "w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh)
            writer.writerow(["text", "label"])
            writer.writerows(rows)
        written[name] = {
            "path": str(path),
            "rows": len(rows),
            "positive": sum(label for _, label in rows),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        }
        print(f"{path}: {len(rows)} sentences, {written[name]['positive']} positive", flush=True)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=assets.cache_dir() / "reviews")
    write_sets(parser.parse_args().out)


if __name__ == "__main__":
    main()
