"""``install()``: the process's one Megatron backend, made on every rank before the first save or load.

On megatron-core 0.16 it also registers the backend's strategies as ``("tiercheck", 1)``; ``installed()``
returns it to code far from where it was installed.
"""


from __future__ import annotations

import os
from typing import Any

from tiercheck.errors import TiercheckError
from tiercheck.integrations.megatron.backend import TiercheckBackend
from tiercheck.integrations.megatron.compat import HAS_STRATEGY_REGISTRY, strategy_registry
from tiercheck.integrations.megatron.files import BACKEND, VERSION

__all__ = ["install", "installed"]


_installed: TiercheckBackend | None = None


def install(
    local: str | os.PathLike[str] | None = None, remote: str | None = None, **checkpointer_options: Any
) -> TiercheckBackend:
    """Make tiercheck's save and load strategies; call it on every rank, before the first save or load.

    megatron-core 0.16: also registers them as backend ``("tiercheck", 1)``; save with
    ``dist_checkpointing.save(..., sharded_strategy=("tiercheck", 1))`` (or ``backend.save_strategy``), and
    ``dist_checkpointing.load`` picks tiercheck from the checkpoint's ``metadata.json``. 0.17+ has no registry:
    pass ``backend.save_strategy`` to ``save`` and ``backend.load_strategy`` to ``load``.

    Calling it again replaces the previous backend and closes its Checkpointers. Close the returned backend at
    the end of training (it waits for in-flight saves and drains).
    """
    global _installed
    backend = TiercheckBackend(local=local, remote=remote, **checkpointer_options)
    if HAS_STRATEGY_REGISTRY:
        action = strategy_registry.StrategyAction
        strategy_registry.register_default_strategy(action.SAVE_SHARDED, BACKEND, VERSION, backend.save_strategy)
        strategy_registry.register_default_strategy(action.LOAD_SHARDED, BACKEND, VERSION, backend.load_strategy)
    previous, _installed = _installed, backend
    if previous is not None:
        previous.close()
    return backend


def installed() -> TiercheckBackend:
    """The backend the last ``install()`` of this process made (for code far from where it was installed,
    such as Megatron-LM's loader)."""
    if _installed is None:
        raise TiercheckError("tiercheck's Megatron plugin is not installed: call install() on every rank first")
    return _installed
