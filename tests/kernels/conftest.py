"""Kernel tests: Triton runs in its CPU interpreter unless a GPU is present.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at collection time.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
