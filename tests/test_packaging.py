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


@pytest.mark.slow
def test_the_checkout_root_on_sys_path_does_not_shadow_hugging_faces_kernels():
    """`python -c` / `python -m` from the checkout put its root first on sys.path, where
    kernels/ would pass for Hugging Face's `kernels` package; transformers (>= 5) imports that
    package, so `import peft` used to fail there. kernels/__init__ hands the name over."""
    import importlib.metadata
    import subprocess
    import sys
    code = ("import peft, transformers.integrations.hub_kernels, kernels; "
            "print(kernels.__file__); print(hasattr(kernels, 'paged_decode_attention'))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    where, ours = run.stdout.split()
    assert ours == "False"     # never this checkout's kernels under the top-level name
    try:
        importlib.metadata.version("kernels")
        assert Path(where).resolve().parent != (ROOT / "kernels").resolve()
    except importlib.metadata.PackageNotFoundError:
        pass                   # no such package installed: the empty shell stays
    check = subprocess.run([sys.executable, "-c", "import rltlab.kernels as k; "
                            "print(k.triton_available('cpu') in (True, False))"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert check.stdout.strip() == "True", check.stderr[-2000:]
