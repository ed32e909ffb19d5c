"""Imported once, by the fork server that ``tests/distributed.py`` forks every rank from: what most ranks would
otherwise import for themselves, each on its own (measured on 2 cores, torch already imported):

- tiercheck's save and restore modules, with zarr, numcodecs and fsspec behind them: ~0.7 s a rank, ~17 s of a
  48-rank test;
- ``torch._dynamo``, which a rank's first optimizer step imports (``torch._disable_dynamo``), as DeepSpeed's
  import does: ~1.5 s a rank;
- ``torch.distributed.checkpoint``, for the DCP, torchtitan and Hugging Face ranks: ~0.3 s more.

The command line and the integrations are left out: a rank that uses one imports it (and its framework) itself.
Nothing here starts a thread, so forking from the server stays safe.
"""

from __future__ import annotations

import importlib
import pkgutil

import torch._dynamo
import torch.distributed.checkpoint  # noqa: F401

import tiercheck

_LEFT_OUT = ("tiercheck.__main__", "tiercheck.cli", "tiercheck.integrations")


def _import_tree(path: list[str], prefix: str) -> None:
    for info in pkgutil.iter_modules(path, prefix):
        if info.name in _LEFT_OUT:
            continue
        module = importlib.import_module(info.name)
        if info.ispkg:
            _import_tree(list(module.__path__), info.name + ".")


_import_tree(list(tiercheck.__path__), "tiercheck.")
