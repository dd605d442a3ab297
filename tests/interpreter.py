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
kernel = pytest.mark.skipif(not (CUDA or INTERPRET), reason="the kernel runs on CUDA or in the Triton interpreter")
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
