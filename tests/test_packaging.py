"""Packaging promises: every subpackage ships, kernels/ is not a top-level `kernels`."""
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (the package itself supports 3.10)

ROOT = Path(__file__).resolve().parent.parent


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_subpackage_is_listed_in_pyproject():
    listed = set(_pyproject()["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "rltlab").rglob("__init__.py")}
    missing = {name for name in found if name not in listed}
    assert not missing, f"add to [tool.setuptools] packages: {sorted(missing)}"


def test_kernels_and_patches_have_unique_import_paths():
    dirs = _pyproject()["package-dir"]
    assert dirs["rltlab.kernels"] == "kernels"
    assert dirs["rltlab.engine_patches"] == "engine_patches"
    assert "kernels" not in _pyproject()["packages"]
    import rltlab.kernels
    assert Path(rltlab.kernels.__file__).parent.resolve() == (ROOT / "kernels").resolve()
