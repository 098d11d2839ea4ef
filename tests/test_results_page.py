"""benchmarks/results_page.py: the marked blocks other scripts write survive a regenerated
docs/results.md."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from results_page import kept_blocks, splice  # noqa: E402


def test_every_marked_block_is_kept_and_replaced_in_place():
    doc = splice(splice("# Results\n\nold text\n", "recipes table"), "sizes table", "calib-size")
    assert kept_blocks(doc) == {"recipes": "recipes table", "calib-size": "sizes table"}
    page = "# Results\n\nnew text\n"
    for name, block in kept_blocks(doc).items():
        page = splice(page, block, name)
    assert page.index("new text") < page.index("recipes table") < page.index("sizes table")
    again = splice(page, "sizes table v2", "calib-size")
    assert kept_blocks(again) == {"recipes": "recipes table", "calib-size": "sizes table v2"}
    assert again.count("<!-- calib-size:begin -->") == 1
