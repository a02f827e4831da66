"""Every `rltlab run NOTEBOOK -p KEY VALUE ...` command in README.md and docs/**/*.md names a
notebook that exists and parameters it has (values are not checked: paths are placeholders and
docs/reliability.md shows refused values on purpose). README recipe 1 once passed TASKS to
notebook 10, which has no such parameter: the first command a researcher with their own model
would copy failed."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from rltlab.workbench.notebook_params import notebook_parameters
from rltlab.workbench.runs import resolve_notebook

ROOT = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"rltlab run (\d\d\w*|notebooks/\S+\.ipynb)"
                     r"((?: +-p +[A-Z_0-9]+ +(?:\"[^\"]*\"|[^\s`]+))+)")


def documented_runs() -> list[tuple[str, str, dict[str, str]]]:
    runs = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for match in COMMAND.finditer(path.read_text()):
            words = shlex.split(match.group(2))
            params = {words[i + 1]: words[i + 2] for i in range(0, len(words), 3)}
            runs.append((path.relative_to(ROOT).as_posix(), match.group(1), params))
    return runs


def test_the_docs_show_runs_with_parameters():
    assert len(documented_runs()) >= 5


@pytest.mark.parametrize("where, notebook, params", documented_runs(),
                         ids=lambda v: v if isinstance(v, str) else None)
def test_every_documented_run_uses_parameters_its_notebook_has(where, notebook, params):
    unknown = set(params) - set(notebook_parameters(resolve_notebook(notebook)))
    assert not unknown, f"{where}: rltlab run {notebook} has no parameter(s) {sorted(unknown)}"
