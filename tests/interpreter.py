"""Triton kernel tests run on a GPU, or on the CPU in Triton's interpreter. The
interpreter is chosen when triton is first imported (TRITON_INTERPRET=1), so a CPU-only
run (CI) reaches it through a subprocess: `run_interpreted`."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
_kernel_runs = pytest.mark.skipif(not (CUDA or INTERPRET), reason="the kernel runs on CUDA or in the Triton interpreter")


def kernel(test):
    """A kernel test: on a GPU one of the device suite's (`-m gpu`); on the CPU it runs
    only in the interpreter, where a file's `run_interpreted` picks it."""
    return pytest.mark.gpu(_kernel_runs(test))


spawns_interpreter = pytest.mark.skipif(CUDA or INTERPRET, reason="runs the kernel tests itself")


def run_interpreted(test_file: str, select: str, passed: int, timeout: int = 300) -> None:
    """Run the tests of `test_file` that pytest's -k `select` picks in the interpreter:
    all `passed` of them must pass."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", select],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert re.search(rf"\b{passed} passed", proc.stdout), proc.stdout[-2000:]


def skip_repatching_inside_launches() -> None:
    """Triton 3.6's interpreter patches triton.language again at every call of one jit
    function from another (inspect.getmembers over the language: ~30% of the CI's
    interpreter time). Inside a launch, whose own patch already covers the modules a
    callee sees, that patches nothing new, so it is skipped; the launch's patch is
    undone when it ends, as before. Only for the Triton these tests pin: another one
    keeps its own behaviour."""
    import triton
    if triton.__version__ != "3.6.0":
        return
    import triton.language as tl
    from triton.runtime import interpreter

    patch, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    patched: set[int] = set()  # ids of the language modules the running launch patched

    def languages(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_once(fn):
        wanted = languages(fn)
        if patched and wanted <= patched:
            return None  # a callee's call: InterpretedFunction.__call__ drops the scope anyway
        scope = patch(fn)
        patched.update(wanted)
        return scope

    def launch_and_forget(self, *args, **kwargs):
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch_and_forget
