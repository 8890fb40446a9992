"""`bench/report.py` writes docs/benchmarks.md from `bench/results/` and keeps its hand-kept last
section, `## Measured by hand`, as written."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmarks.md"
HAND_KEPT = "\n## Measured by hand\n"


def report(doc: Path) -> str:
    """Run the report over the recorded results, writing `doc` (and its chart beside it)."""
    script, png = ROOT / "bench" / "report.py", doc.with_suffix(".png")
    command = [sys.executable, str(script), "--doc", str(doc), "--png", str(png)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return doc.read_text()


def test_the_page_is_what_the_report_writes(tmp_path: Path) -> None:
    doc = Path(shutil.copy(DOC, tmp_path / "benchmarks.md"))
    assert report(doc) == DOC.read_text()  # no hand edit outside the hand-kept section


def test_a_rewrite_keeps_the_hand_kept_section_and_replaces_the_rest(tmp_path: Path) -> None:
    page = DOC.read_text()
    kept = page[page.index(HAND_KEPT) :]
    assert "### " in kept
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nStale generated text.\n" + kept)
    written = report(doc)
    assert "Stale generated text." not in written
    assert written.endswith(kept) and written.count(HAND_KEPT) == 1
