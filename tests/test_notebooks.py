"""The notebooks (notebooks/*.ipynb): each one runs top to bottom without a cell error, and
each is kept in git with its outputs stripped.

Execution: nbclient with the `python3` kernel of this interpreter (the venv's ipykernel), in
the notebooks folder, on a copy (the files are never rewritten). The kernel inherits this
process's environment (CPU, 8 fake devices, the tests' XLA flags) plus the tests' persistent
compilation cache and matplotlib's Agg backend.
"""

import pathlib

import nbclient
import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Executing each takes over 60 s on the shared 2-core machine from a cold compilation cache
# (quickstart ~40 s warm, 80-130 s cold; the study 65 s warm, ~5 min cold), so both are heavy.
HEAVY = {"quickstart.ipynb", "speculative_study.ipynb"}
CELL_TIMEOUT_S = 600


def params():
    return [pytest.param(p, id=p.name, marks=[pytest.mark.heavy] if p.name in HEAVY else [])
            for p in NOTEBOOKS]


def test_notebooks_exist():
    names = {p.name for p in NOTEBOOKS}
    assert {"quickstart.ipynb", "speculative_study.ipynb"} <= names, names
    assert HEAVY <= names, HEAVY - names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_outputs_stripped(path):
    """No outputs, no execution counts, valid nbformat 4, a python3 kernelspec."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", nb.metadata
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        assert cell.get("outputs") == [], f"{path.name} cell {i} has outputs"
        assert cell.get("execution_count") is None, f"{path.name} cell {i} has an execution count"


@pytest.mark.parametrize("path", params())
def test_notebook_runs(path, monkeypatch):
    """Every cell runs; a cell error fails with the cell's traceback."""
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".jax_cache"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.delenv("DEEPINFER_DEBUG", raising=False)
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name}: {e}", pytrace=False)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors, errors
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)
    if any("plt." in c.source for c in code):   # plots render (inline PNGs)
        assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs), path.name


def strip(path: pathlib.Path) -> bool:
    """Clears a notebook's outputs and execution counts in place; True if it changed."""
    nb = nbformat.read(path, as_version=4)
    before = nbformat.writes(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    if nbformat.writes(nb) == before:
        return False
    nbformat.write(nb, path)
    return True


if __name__ == "__main__":      # python tests/test_notebooks.py --strip [paths]: clear outputs
    import sys
    if sys.argv[1:2] != ["--strip"]:
        sys.exit("usage: python tests/test_notebooks.py --strip [notebook ...]")
    for p in [pathlib.Path(a) for a in sys.argv[2:]] or NOTEBOOKS:
        print(f"{p}: {'stripped' if strip(p) else 'already clean'}")
