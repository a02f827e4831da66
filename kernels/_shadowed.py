"""Handing the top-level name `kernels` to the installed package of that name (see __init__)."""
import importlib.machinery
import importlib.util
import os
import sys


def hand_over(init_file: str) -> None:
    """Load the `kernels` package found on sys.path without this checkout's root, and make it
    sys.modules["kernels"] (the import statement that got here returns that). Without one,
    `kernels` stays this folder's empty shell: no version, none of its kernels, so
    transformers' probe finds no usable `kernels` package, as without this folder."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(init_file)))
    path = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    sys.modules.pop(__name__, None)
    if spec is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)
