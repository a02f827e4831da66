"""Whether the Triton interpreter (TRITON_INTERPRET=1, the CPU tests' way to run the kernels)
can run them with the installed Triton and NumPy.

Triton before 3.7 turns a loaded scalar (a 1-element array in the interpreter) into a Python int
with int(array). NumPy 2.4 refuses that ("only 0-dimensional arrays can be converted to Python
scalars"), so with Triton 3.6 (torch 2.11's pin) and NumPy 2.4 most kernels fail inside the
interpreter (47 of 56 kernel tests did).
Triton fixed it in 3.7 (triton-lang/triton issue 9171). Compiled kernels on a GPU are not
affected.
"""
from __future__ import annotations

from importlib.metadata import version

from packaging.version import Version


def interpreter_problem(triton_version: str | None = None,
                        numpy_version: str | None = None) -> str | None:
    """Why the Triton interpreter cannot run the kernels with these versions (the installed ones
    by default), as a message that says what to install; None if it can."""
    triton_version = triton_version or version("triton")
    numpy_version = numpy_version or version("numpy")
    if Version(triton_version).release < (3, 7) and Version(numpy_version).release >= (2, 4):
        return (f"The Triton interpreter (TRITON_INTERPRET=1) cannot run rltlab's kernels with "
                f"triton {triton_version} and numpy {numpy_version}: Triton before 3.7 "
                f"converts 1-element arrays to Python ints, which NumPy 2.4 refuses (TypeError: "
                f"only 0-dimensional arrays can be converted to Python scalars; "
                f"triton-lang/triton issue 9171). Install 'numpy<2.4', or triton>=3.7 where "
                f"your torch allows it; or set TRITON_INTERPRET=0 to run the other tests on a "
                f"CPU (the kernel tests then skip).")
    return None
