"""Property-based fuzzing of every decoder and file loader (harness/fuzz_properties.py says
what each property checks). A few hundred inputs per target keep this file to seconds;
bench/bench_fuzz.py runs the same properties on over a million inputs.

Each test asserts: nothing but Rejected / None / UserError escapes, a UserError is one
line, and nothing invalid is accepted (nor, for the decoders, anything valid refused)."""

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import fuzz_properties as F

FAST = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TARGETS = F.targets()


# The wire decoders stay in the quick path (-m "not slow"); the file loaders run in the full one.
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=() if n.startswith("decode_") else pytest.mark.slow) for n in TARGETS],
)
@FAST
@given(r=st.randoms(use_true_random=False))
def test_target_holds_its_contract(name, r):
    make, check = TARGETS[name]
    assert check(make(r)) in ("accepted", "rejected")


@FAST
@given(data=st.binary(max_size=96), directions=st.sampled_from([None, 1, 4, 16]))
def test_decode_update_on_any_bytes(data, directions):
    F.check_update(data, directions)


@FAST
@given(data=st.binary(max_size=256), max_rows=st.sampled_from([1, 5, 4096]))
def test_reply_and_request_decoders_on_any_bytes(data, max_rows):
    F.check_rows(data, max_rows)
    F.check_digests(data)
    F.check_digest_request(data)
    F.check_fetch_request(data)


@pytest.mark.slow
@FAST
@given(text=st.text(max_size=200))
def test_manifest_and_toml_on_any_text(text):
    F.check_manifest(text)
    F.check_toml(text, daemon=False)
    F.check_toml(text, daemon=True)


_KEYS = F._key_blobs()
_KEY_DIR = Path(tempfile.mkdtemp(prefix="fuzz-keys-"))


@pytest.mark.slow
@FAST
@given(r=st.randoms(use_true_random=False))
def test_identity_key_files(r):
    raw, mode = F.identity_input(r, _KEYS)
    F.check_identity(_KEY_DIR / "identity.key", raw, mode)


def test_known_edges_are_refused():
    """The edges the hardening work found, each checked by the same properties."""
    pack = F.msgpack.packb
    assert F.check_update(pack([True, F.TAG, 1, b"\0<"])) == "rejected"
    assert F.check_digest_request(pack([F.RUN, 64.0])) == "rejected"
    assert F.check_fetch_request(pack([F.RUN, True, b"", 5, True])) == "rejected"
    assert F.check_fetch_request(pack([F.RUN, 0, b"", 5, 64.0])) == "rejected"
    assert F.check_digests(pack([[0, True, b"\0" * 32]])) == "rejected"
    for text in [
        '{"manifest_version": 2, "clip": Infinity}',
        '{"manifest_version": true}',
        '{"manifest_version": 2, "rank": 1' + "0" * 30 + "}",
        '{"manifest_version": 2, "extra": ' + "[" * 5000 + "]" * 5000 + "}",
    ]:
        assert F.check_manifest(text) == "rejected"
    assert F.check_toml("round_deadline = nan\n", daemon=True) == "rejected"
    assert F.check_toml("metrics_port = 70000\n", daemon=True) == "rejected"
    assert F.check_toml("x = " + "[" * 3000 + "]" * 3000, daemon=False) == "rejected"
