"""Peers of two rule sets disagree on a ledger, so the rules are tied to the version.

A peer joins only a run of its own major.minor version (peer/join.py `check_version`). That
holds the network together only if every change to what a peer accepts, how it judges, or
how base + ledger becomes the model comes with a new minor version. This test makes such a
change visible: it fingerprints the code of the modules that hold those rules (comments
and docstrings left out) and pins the fingerprint to the minor version.

When it fails: if your change alters a rule (a check, a bound, a default, a digest, the
update's arithmetic), bump the minor version in seedflood_p2p/__init__.py and pyproject.toml
and add a pin for it; if it does not (a rename, a refactor), re-pin the current version.
Either way the reviewer sees the choice in the diff.
"""

from __future__ import annotations

import hashlib
import io
import token
import tokenize
from pathlib import Path

from seedflood_p2p import __version__

ROOT = Path(__file__).resolve().parents[1] / "seedflood_p2p"
RULE_MODULES = [
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "protocol").glob("*.py")),
    "algorithm/audit_rules.py",  # who is judged a cheater, from the ledger
    "algorithm/probation.py",  # who is a newcomer, who vouched
    "algorithm/subcge.py",  # base + ledger -> the model
    "algorithm/replay.py",
    "algorithm/momentum.py",  # momentum: a row's weight by the state's round
    "algorithm/curvature.py",  # curvature: a row's scale by the earlier rounds
    "core/config.py",  # run ids, defaults, bounds
    "core/extra_settings.py",
    "core/rng.py",  # directions from derived seeds
    "network/gossip/admission.py",  # what a peer accepts
    "network/peers/tickets.py",
]
# minor version -> fingerprint of RULE_MODULES at that version
PINNED = {
    # re-pinned for `momentum`: a new setting that 0.2.0 peers refuse as unknown, so no
    # run a 0.2.0 peer can join changes its rules (runs without momentum: the same code)
    # re-pinned again for memory, not rules: decoded scalars are shared float objects and
    # peer ids one bytes object each (protocol/message.py), the same values as before
    # and for packed rows, not rules: held_state.find_missing takes the hash sum and the
    # peers of the old rows a peer keeps packed (peer/applied_rows.py); same answers
    # and for judging cost, not rules: `standing` may take `seen` (who has rows) with only
    # the audited rows as claims, and AuditRule.mismatches is memoized; same answers
    # (tests/test_probation.py: test_judging_reads_only_the_audited_rows_and_who_has_rows)
    # and for ingest cost, not rules: admission reads a batch's held rows in one query and
    # counts verdicts per batch, scalars are packed with struct (numpy's bytes: tests/
    # test_protocol.py test_scalars_pack_and_unpack_as_numpy_does); same verdicts
    # and for `one_sided_passes` and `curvature`: new settings that 0.2.0 peers refuse as
    # unknown (and daemons refuse curvature), so runs without them keep their code and ids;
    # one_sided keeps its estimates on the losses' device (a GPU peer), and momentum and
    # curvature share one split of rows into rounds (`_round_runs`): not rule changes
    # and for a checkpoint offer's meta bound (64 -> 768 KiB, protocol/checkpoint.py): which
    # links a joiner takes, not what the ledger holds; a 0.2.0 joiner refuses a large
    # offer and replays, ending with the same model
    # and for penalties, not acceptance: gossip ahead of a syncing node's window is dropped
    # as before but not held against its sender (`Admission.catching_up`)
    # and for repair cost, not rules: a repair page's held rows are read in one query
    # (`Admission.repair`), the same lookups as one query per row; same verdicts
    # and for repair cost again: rows checked at once share one future, not one each
    # (`Admission._verify_once`); the same checks, each row its own answer; and each
    # check timed without a context manager (`_verify_rows`)
    # and for judging cost at scale, not rules: `_timed` settles members in the order of
    # their times (one pass, not one per step of a chain of establishments), `judge` and
    # `ban_spans` get only the records of accused updates, every span's times share one
    # index of the matches by auditor, the vouchers of an update are
    # found without walking every member, and what a ledger gives the standing is read
    # apart (`ledger_inputs`, so a daemon judges in a thread); the same standing
    # (tests/test_probation.py:
    # test_the_times_settled_in_order_are_those_of_repeated_passes,
    # test_judging_only_the_accused_updates_gives_the_standing_of_all_records,
    # test_the_times_after_fresh_keys_bans_are_those_made_anew: a prefix whose bans add
    # only never-established peers derives its times from the prefix before)
    "0.2": "9a5278bf981c53ef884004d62e9c22ca81296a0a59b0d8ee49a89389e98c91b5",
}


def code_tokens(source: str) -> list[str]:
    """The module's tokens without comments, blank lines and docstrings (a string that is a
    statement of its own), so that only code changes move the fingerprint."""
    out: list[str] = []
    tokens = [
        t
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type not in (tokenize.COMMENT, tokenize.NL)
    ]
    skip_newline = False
    for i, t in enumerate(tokens):
        before = tokens[i - 1].type if i else token.NEWLINE
        after = tokens[i + 1].type if i + 1 < len(tokens) else token.NEWLINE
        if (
            t.type == token.STRING
            and before in (token.NEWLINE, token.INDENT, token.DEDENT)
            and after in (token.NEWLINE, token.ENDMARKER)
        ):
            skip_newline = True  # a docstring (or a bare string statement: no code either way)
            continue
        if skip_newline and t.type == token.NEWLINE:
            skip_newline = False
            continue
        skip_newline = False
        out.append(t.string)
    return out


def rules_fingerprint() -> str:
    digest = hashlib.sha256()
    for name in RULE_MODULES:
        digest.update(name.encode() + b"\0")
        digest.update("\x1f".join(code_tokens((ROOT / name).read_text())).encode() + b"\0")
    return digest.hexdigest()


def test_the_fingerprint_ignores_comments_and_docstrings_but_not_code():
    plain = "def f(x):\n    return x + 1\n"
    noted = '"""A module."""\n\n# why\ndef f(x):  # a note\n    """Doc."""\n    return x + 1\n'
    changed = "def f(x):\n    return x + 2\n"
    assert code_tokens(plain) == code_tokens(noted)
    assert code_tokens(plain) != code_tokens(changed)
    assert code_tokens('X = "a"\n') != code_tokens('X = "b"\n')  # a string value is code


def test_every_rule_module_exists():
    missing = [name for name in RULE_MODULES if not (ROOT / name).exists()]
    assert not missing, f"moved or renamed: update RULE_MODULES in {__file__}: {missing}"


def test_the_rules_are_pinned_to_this_minor_version():
    minor = ".".join(__version__.split(".")[:2])
    now = rules_fingerprint()
    assert minor in PINNED, (
        f"version {__version__} has no pinned rules fingerprint: add {minor!r}: {now!r} to "
        f"PINNED in {__file__}"
    )
    assert PINNED[minor] == now, (
        f"the code of the rule modules changed (fingerprint {now}). If what a peer accepts or "
        f"how it judges changed, bump the minor version past {__version__} and pin it; if "
        f"not, re-pin {minor!r} to {now!r} in {__file__}"
    )
