"""A clone is the whole project: no tracked file points at data next to the checkout, which a user's clone lacks."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The checkout's sibling directory `shared`, written as a relative path or built from a path's parent (the test's own
# examples below are split so that this file does not match).
OUTSIDE_REFERENCE = re.compile(rb"""\.\.[/\\]shared\b|\.parent\s*/\s*["']shared["']""")


def test_no_tracked_file_refers_to_the_shared_directory_outside_the_clone():
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if listing.returncode != 0:
        pytest.skip("not a git checkout")
    paths = [ROOT / name.decode() for name in listing.stdout.split(b"\0") if name]
    assert len(paths) > 100  # the listing is the project, not an empty index
    offending = [str(path.relative_to(ROOT)) for path in paths
                 if path.is_file() and OUTSIDE_REFERENCE.search(path.read_bytes())]
    assert offending == []


def test_the_pattern_finds_both_spellings():
    for text in (b"eval: ../" + b"shared/data/math_eval/math500.jsonl", b"ROOT.parent / " + b'"shared" / "data"'):
        assert OUTSIDE_REFERENCE.search(text), text
    assert not OUTSIDE_REFERENCE.search(b"bundled:math_eval/math500.jsonl")
