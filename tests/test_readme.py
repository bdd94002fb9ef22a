"""The README holds what prose erodes (STYLE rule 17): it stays short (dated
run notes go to docs/results.md, the full status to docs/status.md), it
keeps the two commands that set up a fresh machine, and its links lead
somewhere."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LIMIT = 12 * 1024


def test_readme_stays_short():
    size = len(README.read_bytes())
    assert size <= LIMIT, f"README.md is {size} bytes (limit {LIMIT}): move dated notes to docs/"


def test_readme_keeps_the_two_fresh_machine_commands():
    text = README.read_text()
    assert "bash .ci/setup && python3 examples/kv_transfer.py" in text
    assert "bash .ci/setup && python3 -m pytest -q" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash .ci/setup" in ci and "python3 -m pytest -q" in ci, "CI runs what the README says"


def test_readme_and_status_links_lead_to_files():
    for doc in (README, ROOT / "docs" / "status.md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"
