"""tests/triton_interp.py: where Triton's interpreter has the index bug of some releases (a runtime
integer used as an index under NumPy 2), the interpreted tests skip, naming the versions; any other
failure still fails them."""
import sys
import types

import pytest

import triton_interp
from triton_interp import index_bug_reason, interpreted

# What the Triton that torch 2.11 bundles raised under NumPy 2 at a kernel's `range(0, K, BLOCK_K)`
# (triton_interp._error_text of it: the InterpreterError, then its cause).
_SEEN = ("InterpreterError: TypeError('only 0-dimensional arrays can be converted to Python scalars')\n"
         "TypeError: only 0-dimensional arrays can be converted to Python scalars")


def test_the_index_bug_and_nothing_else_is_recognised():
    why = index_bug_reason(_SEEN, "3.5.0", "2.3.1")
    assert why.startswith("Triton 3.5.0's interpreter cannot use a runtime integer as an index under NumPy 2.3.1")
    assert "pip install -U triton" in why and "\n" not in why
    for other in ("InterpreterError: TypeError('unsupported operand type(s) for +')\nTypeError: unsupported",
                  "InterpreterError: NameError(\"name 'tl' is not defined\")",
                  "TypeError: only 0-dimensional arrays can be converted to Python scalars",  # not the interpreter's
                  "AssertionError: Tensor-likes are not close!", ""):
        assert index_bug_reason(other, "3.5.0", "2.3.1") is None, other


class InterpreterError(Exception):
    """Stands for triton.runtime.errors.InterpreterError: the probe reads type names and messages."""


def _as_interpreted(monkeypatch, probe_raises):
    """A test wrapped by `interpreted`, run as in the interpreter's process whose probe kernel raises
    `probe_raises` (None: runs): (what the test saw, the test's call)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.5.0"))  # no Triton needed
    monkeypatch.setitem(sys.modules, "numpy", types.SimpleNamespace(__version__="2.3.1"))
    monkeypatch.setattr(triton_interp, "_probed", [])

    def kernel():
        if probe_raises is not None:
            raise probe_raises
        return [3, 3]
    monkeypatch.setattr(triton_interp, "_probe_kernel", kernel)
    ran = []

    @interpreted
    def test_kernel():
        ran.append(True)
        assert False, "the kernel's own check failed"
    return ran, test_kernel


def test_an_interpreter_with_the_index_bug_skips_the_test_naming_it(monkeypatch):
    def interpreter_raise():
        try:
            raise TypeError("only 0-dimensional arrays can be converted to Python scalars")
        except TypeError as e:
            raise InterpreterError(repr(e)) from e
    try:
        interpreter_raise()
    except InterpreterError as e:
        seen = e
    ran, test = _as_interpreted(monkeypatch, seen)
    with pytest.raises(pytest.skip.Exception, match=r"^Triton 3\.5\.0's interpreter cannot use a runtime integer "
                                                    r"as an index under NumPy 2\.3\.1 .*pip install -U triton$"):
        test()
    assert ran == [] and triton_interp._probed == [index_bug_reason(_SEEN, "3.5.0", "2.3.1")]


@pytest.mark.parametrize("probe_raises", [None, InterpreterError("NameError(\"name 'tl' is not defined\")"),
                                          TypeError("only 0-dimensional arrays can be converted to Python scalars")])
def test_any_other_interpreter_runs_the_test_and_it_fails_on_its_own(monkeypatch, probe_raises):
    ran, test = _as_interpreted(monkeypatch, probe_raises)
    with pytest.raises(AssertionError, match="the kernel's own check failed"):
        test()
    assert ran == [True] and triton_interp._probed == [None]


def test_the_probe_kernel_runs_here_and_finds_the_bug_where_put_back(monkeypatch):
    """In the interpreter: the probe kernel loops to its runtime bound (ceil(5 / 2) = 3 rounds in each
    of its 2 lanes), and with Triton 3.5's `__index__` (int() of the 1-element array, no squeeze)
    put back into this Triton's interpreter, the probe finds the bug. In this process: the probe
    kernel is made when called (TRITON_INTERPRET is read then) and uses no jit library function
    (those were compiled for a GPU when Triton was imported without the interpreter), so no fresh
    process is needed."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import numpy
    import triton
    from triton.runtime import interpreter
    why = triton_interp.probe()
    if why is not None:  # this install's Triton has the bug: the probe names exactly it
        assert why == index_bug_reason(_SEEN, triton.__version__, numpy.__version__)
        return
    assert triton_interp._probe_kernel() == [3, 3]
    if int(numpy.__version__.split(".")[0]) < 2 or not hasattr(interpreter, "_patch_lang_tensor"):
        return  # NumPy 1 converts a 1-element array (the bug needs NumPy 2); an interpreter patched otherwise
    patch = interpreter._patch_lang_tensor

    def as_in_triton_3_5(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))
    interpreter._patch_lang_tensor = as_in_triton_3_5
    try:
        why = triton_interp.probe()
    finally:
        interpreter._patch_lang_tensor = patch
    assert why == index_bug_reason(_SEEN, triton.__version__, numpy.__version__)
    assert triton_interp._probe_kernel() == [3, 3]  # put back
