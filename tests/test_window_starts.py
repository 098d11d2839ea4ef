"""benchmarks/studies/window_starts.py: both ways of cutting a document into windows score
every token once, within the context, and only the served way opens each with the BOS."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "studies"))

import window_starts as ws  # noqa: E402


@pytest.mark.parametrize("n,length", [(10, 4), (4, 4), (3, 8), (2049, 2048)])
def test_windows_score_each_token_once(n, length):
    ids, bos = list(range(10, 10 + n)), 1
    wins = ws.windows(ids, bos, length)
    for way in ("rolling", "bos-each"):
        mine = [w for w in wins if w[0].startswith(way)]
        assert [t for w in mine for t in w[2]] == ids
        for _, x, y in mine:
            assert len(x) <= length and len(y) <= len(x)
            # each target is the token after its position: x's last len(y) positions
            full = x + [y[-1]]
            assert full[-len(y):] == y
    assert all(w[1][0] == bos for w in wins if w[0] == "bos-each")
    later = [w for w in wins if w[0] == "rolling-later"]
    assert all(bos not in w[1] for w in later)
    assert len(later) == max(0, -(-(n - length) // length))


def test_deltas_per_kind():
    wins = [("rolling-first", [1, 5], [5, 6]), ("rolling-later", [6, 7], [7, 8]),
            ("bos-each", [1, 5, 6], [5, 6, 7]), ("bos-each", [1, 7], [8])]
    res = {"float": [2.0, 4.0, 5.0, 1.0], "q": [2.0, 4.4, 5.0, 1.0]}
    table = ws.deltas(wins, res)
    assert table["rolling-first"]["q"] == pytest.approx(0.0)
    assert table["rolling-later"]["q"] > 0 and table["bos-each"]["q"] == pytest.approx(0.0)
    assert table["rolling (all)"]["tokens"] == 4 == table["bos-each"]["tokens"]
