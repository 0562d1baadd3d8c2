"""Post-processing workers: `from postproc import PostprocWorker, PostprocParams` (the reference API's names), and the
user hook API (`PostProcessorHook`, `Terminate`). Loaded on first use: `postproc.worker` imports transformers, which
`postproc.pipes` alone does not need."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "PostprocWorker": "postproc.worker",
    "PostprocParams": "postproc.worker",
    "PostProcessorHook": "postproc.hooks",
    "Terminate": "postproc.hooks",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'postproc' has no attribute {name!r}")
