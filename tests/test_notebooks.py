"""The capacity-planning notebooks run top to bottom; any failing cell fails the test."""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient

from tests.helpers.repo import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_there_are_at_least_two_notebooks():
    assert len(NOTEBOOKS) >= 2


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path):
    nb = nbformat.read(path, as_version=4)
    # Raises CellExecutionError, naming the cell, on the first cell that fails.
    NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
