"""Kernel tests run the Triton kernels on CPU through the interpreter when there is no GPU.

The interpreter needs TRITON_INTERPRET in the environment before triton is first imported in the
process. Importing `kernels.*` never imports triton (kernels/_triton.py binds it at first launch), so
setting it here (and in tests/conftest.py) is enough unless some earlier module imported triton itself;
then kernel launches raise a RuntimeError that says so.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    """Where kernel inputs live: CUDA when present, else CPU (interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
