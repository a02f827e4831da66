"""kernels.interpreter_problem: which Triton / NumPy pairs the interpreter cannot run the kernels
with (Triton before 3.7 with NumPy 2.4 or later), and what the message tells the user."""
import pytest

from rltlab.kernels import interpreter_problem


@pytest.mark.parametrize("triton_version, numpy_version", [
    ("3.6.0", "2.4.0"), ("3.6.0", "2.4.6"), ("3.5.1", "3.0.0")])
def test_triton_before_3_7_with_numpy_2_4_is_refused_with_the_fix(triton_version, numpy_version):
    message = interpreter_problem(triton_version, numpy_version)
    assert message is not None
    assert triton_version in message and numpy_version in message
    assert "numpy<2.4" in message and "triton>=3.7" in message
    assert "TRITON_INTERPRET=0" in message   # the way to run the other tests as they are


@pytest.mark.parametrize("triton_version, numpy_version", [
    ("3.7.0", "2.4.6"), ("3.9.0", "2.4.6"), ("3.6.0", "2.3.5"), ("3.7.0rc1", "2.4.0"),
    ("3.6.0", "1.26.4")])
def test_working_pairs_pass(triton_version, numpy_version):
    assert interpreter_problem(triton_version, numpy_version) is None


def test_the_installed_versions_are_read_by_default():
    from importlib.metadata import version
    assert interpreter_problem() == interpreter_problem(version("triton"), version("numpy"))
