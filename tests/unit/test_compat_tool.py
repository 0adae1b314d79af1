"""tools/dev/compat.py's own logic, without venvs (the full run's table is in
docs/compat.md)."""

import csv
import os
import sys
import types

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools", "dev"))

import compat  # noqa: E402 (tools/dev/ goes on sys.path first)


def test_version_specs_and_summaries():
    assert compat.spec("3.13", "keras") == "keras==3.13.*"
    assert compat.spec("2.19.1", "tensorflow") == "tensorflow==2.19.1"
    out = "....\n=========== 123 passed, 74 deselected in 132.86s (0:02:12) ===========\n"
    assert compat.pytest_summary(0, out) == "123 passed, 74 deselected in 132.86s (0:02:12)"
    assert compat.pytest_summary(None, "..\n[timed out after 5 s]").startswith("timed out")
    refused = (
        "Collecting x\nERROR: Cannot install keras==3.13.* and tensorflow==2.19.* because "
        "these package versions have conflicting dependencies.\n"
    )
    assert compat.pip_reason(refused).startswith("ERROR: Cannot install keras==3.13.*")


def test_results_go_to_csv_markdown_and_between_the_docs_markers(tmp_path):
    docs = tmp_path / "compat.md"
    docs.write_text(f"# title\n{compat.BEGIN}\nold table\n{compat.END}\nafter\n")
    args = types.SimpleNamespace(out=str(tmp_path / "out"), docs=str(docs), smoke="tests/x.py::t")
    rows = [
        {
            "tf": "2.19",
            "keras": "3.13",
            "tf_installed": "2.19.1",
            "keras_installed": "3.13.2",
            "pip": "ok",
            "import": "ok",
            "fast_tier": "123 passed",
            "smoke": "1 passed",
            "result": "pass",
            "seconds": 300,
            "note": "",
        },
        {
            "tf": "2.20",
            "keras": "3.14",
            "pip": "refused",
            "import": "",
            "fast_tier": "",
            "smoke": "",
            "result": "pip refused",
            "note": "ERROR: conflict",
        },
    ]
    compat.write_results(rows, args)
    with open(tmp_path / "out" / "compat.csv") as f:
        got = list(csv.DictReader(f))
    assert [r["result"] for r in got] == ["pass", "pip refused"] and got[0][
        "keras_installed"
    ] == "3.13.2"
    md = (tmp_path / "out" / "compat.md").read_text()
    text = docs.read_text()
    assert "old table" not in text and text.startswith("# title\n") and text.endswith("after\n")
    for out in (md, text):
        assert "| 2.19 | 3.13 | 2.19.1 / 3.13.2 | ok | 123 passed | 1 passed | pass | 300 |" in out
        assert "refused: ERROR: conflict" in out
