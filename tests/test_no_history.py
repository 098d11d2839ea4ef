"""The project speaks of what it does and why, never of the process that produced it: no tracked
text file names a work session, a numbered tracker issue, a helper engineer or a previous time.
A reader cannot look any of those up; a measurement is cited by model, slice, machine and date,
a design choice by its reason. Each pattern below is written so that this file's own source does
not match it (``\\s+`` where the prose would have a plain space)."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HISTORY = [
    r"\bsessions?[\s-]+#?\d",                                    # a numbered work session
    r"\b(last|this|next|previous|same|earlier|later)\s+session\b",
    r"\bsession'?s\s+(cut-?off|budget|worktree|end)\b",
    r"\bissues?\s+#?\d+\b",                                       # a tracker issue by number
    r"\bthe\s+issue'?s\b",
    r"\bhelpers?'s?\s+(session|engineer)s?\b",                    # the people, not a function
    r"\bthe\s+helpers?\s+(stopped|started|ran|measured|found|added)\b",
    r"\blast\s+time\b",
]
PATTERN = re.compile("|".join(f"(?:{p})" for p in HISTORY), re.IGNORECASE)
TEXT = {".py", ".md", ".txt", ".toml", ".cfg", ".yaml", ".yml", ".json", ".sh", ".c", ".h", ""}


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    return [ROOT / n for n in names if n and Path(n).suffix in TEXT and (ROOT / n).is_file()]


def history_lines(text: str) -> list[tuple[int, str]]:
    return [(i, line.strip()) for i, line in enumerate(text.splitlines(), 1)
            if PATTERN.search(line)]


def test_patterns_catch_history_and_spare_code_words():
    caught = ["measured in session" + " 12", "as last" + " session", "Issue #" + "16's target",
              "the issue" + "'s job", "the helper's" + " session", "unlike last" + " time",
              "sessions" + " 12-14", "the session" + "-7 changes", "after the helpers" + " stopped"]
    spared = ["sensitivity.Session runs one pass", "@pytest.fixture(scope='session')",
              "Shared helpers (one of each)", "the vector helpers must inline",
              "the session object streaming writers use", "an issue with the tokenizer"]
    assert [s for s in caught if not PATTERN.search(s)] == []
    assert [s for s in spared if PATTERN.search(s)] == []


def test_no_tracked_file_talks_about_its_own_history():
    files = tracked_text_files()
    assert any(f.name == "README.md" for f in files) and len(files) > 50  # the scan ran
    found = [f"{f.relative_to(ROOT)}:{i}: {line}"
             for f in files for i, line in history_lines(f.read_text(errors="replace"))]
    assert found == [], "history wording (say what the code does and why):\n" + "\n".join(found)
