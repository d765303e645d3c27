"""The counter-based generator: standard known answers plus this project's golden vectors.

If a golden vector changes, every existing run's directions change with it:
peers on different versions would silently disagree. Change them only with a
new manifest version.
"""

import numpy as np

from seedflood_p2p.algorithm.subcge import layer_basis, message_coordinates
from seedflood_p2p.core.rng import derive_key, philox4x32, random_signs, random_words


def test_philox_matches_random123_known_answers():
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        (
            (0xFFFFFFFF,) * 4,
            (0xFFFFFFFF, 0xFFFFFFFF),
            (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
        ),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for counter, key, expected in cases:
        assert tuple(int(x) for x in philox4x32(np.array([counter]), key)[0]) == expected


def test_per_row_keys_equal_scalar_keys():
    counters = np.array([[i, 1, 2, 3] for i in range(5)])
    keys = (np.array([7, 8, 9, 10, 11]), np.array([1, 1, 1, 1, 1]))
    batched = philox4x32(counters, keys)
    for i in range(5):
        assert (batched[i] == philox4x32(counters[i : i + 1], (7 + i, 1))[0]).all()


def test_golden_vectors():
    assert derive_key("seedflood/test", b"abc", 7) == (196508093, 2780980680)
    assert random_words((1, 2), 3, 6).tolist() == [
        33417707,
        1820879997,
        3397453393,
        1662692749,
        1029380141,
        2265390890,
    ]
    signs = random_signs((5, 6), 0, 40)
    assert signs.dtype == np.float32 and set(signs.tolist()) == {-1.0, 1.0}
    assert signs[:12].astype(int).tolist() == [-1, -1, -1, 1, 1, 1, -1, -1, 1, -1, 1, 1]
    a, b, sign = message_coordinates(bytes(32), [b"peer-1"], [42], 5, 8)
    assert a.tolist() == [[[7, 2, 1, 3, 7]]]
    assert b.tolist() == [[[1, 4, 6, 2, 6]]]
    assert sign.tolist() == [[[1.0, 1.0, 1.0, 1.0, -1.0]]]
    # Direction 0 of a k-direction message is the one-direction message; others differ.
    a3, b3, sign3 = message_coordinates(bytes(32), [b"peer-1"], [42], 5, 8, directions=3)
    assert a3[:, :1].tolist() == a.tolist() and b3[:, :1].tolist() == b.tolist()
    assert sign3[:, :1].tolist() == sign.tolist()
    assert a3[0, 1].tolist() != a3[0, 0].tolist() and a3[0, 2].tolist() != a3[0, 1].tolist()
    assert layer_basis(bytes(32), 3, 2, 3, 2, 4).astype(int).tolist() == [
        [-1, 1, 1, 1],
        [-1, 1, -1, -1],
        [1, -1, -1, -1],
        [1, 1, -1, -1],
        [1, -1, 1, 1],
    ]


def test_streams_are_distinct_and_balanced():
    assert derive_key("a", 1) != derive_key("a", 2) != derive_key("b", 1)
    signs = random_signs(derive_key("balance"), 0, 100_000)
    assert abs(signs.mean()) < 0.02  # a fair coin: 5 standard deviations is 0.016
    a, b, _ = message_coordinates(bytes(32), [b"p"] * 2000, list(range(2000)), 3, 8)
    counts = np.bincount(a.ravel(), minlength=8)
    assert counts.min() > 600  # 750 expected per coordinate
