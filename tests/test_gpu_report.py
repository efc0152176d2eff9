"""The device script runs where there is no GPU: `bench/gpu_report.py --quick` writes its report,
each check's command and outcome in it, and on this machine the identity fixtures' MTP and
pipelined plain output equal plain's."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_report_quick_runs_on_cpu_and_reports_identity(tmp_path):
    out = tmp_path / "report.md"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_report.py"), "--quick", "--sections", "env", "identity",
                        "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    report = out.read_text()
    assert "## env" in report and "device: Device(cpu" in report
    assert "`python bench/gpu_report.py --identity" in report and "exit 0" in report
    rows = [line for line in report.splitlines() if line.startswith("| qwen3_5 |")]
    assert len(rows) == 2  # the fp32 and 4-bit bodies of --quick
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")][2:-1]  # past family and body, before seconds
        assert cells and all(c.startswith("yes") for c in cells), row
        assert "yes; yes;" in cells[-1] and not cells[-1].endswith(" 0/0"), row  # MTP drafted, alone and batched
