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


def test_a_run_without_a_bf16_side_reports_the_fp32_ceilings_alone() -> None:
    """The bench measures bf16's ceilings only where a side runs in bf16 (a minute of matmuls
    on a CPU without bf16 instructions); the section then names fp32's alone."""
    import copy
    import json

    sys.path.insert(0, str(ROOT / "bench"))
    import report

    recorded = json.loads((ROOT / "bench" / "results" / "train_throughput.json").read_text())
    # the recorded run may or may not have had a bf16 side: give one copy both ceilings (bf16's
    # made up from fp32's; only their presence matters here) and the other fp32's alone
    both_ceilings = copy.deepcopy(recorded)
    ceiling = both_ceilings["results"]["ceiling"]
    ceiling.setdefault("bf16", {k: v / 2 for k, v in ceiling["fp32"].items()})
    by_kernel = ceiling["decode_matmul_by_kernel"]
    by_kernel.setdefault("bf16", {"F.linear": by_kernel["fp32"]["F.linear"] * 2})
    fp32_only = copy.deepcopy(both_ceilings)
    ceiling = fp32_only["results"]["ceiling"]
    del ceiling["bf16"], ceiling["decode_matmul_by_kernel"]["bf16"]
    fp32_only["results"]["sides"] = {k: v for k, v in fp32_only["results"]["sides"].items()
                                     if "bf16" not in k}  # fmt: skip
    both, alone = report.train_section(both_ceilings), report.train_section(fp32_only)
    assert "GFLOP/s, bf16 " in both and "bf16" not in alone.split("Against the limit")[1]
