"""The random number generators' state as one Stateful entry of the training state.

``torch.get_rng_state()`` is a copy taken when it is called: put it in the state once and every
save writes that stale copy, and a restore fills it without ever setting the generators. A
:class:`RNGState` is asked at each save for the generators' current state, and a restore sets them.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class RNGState:
    """torch's CPU generator, each CUDA device's (where CUDA is available), Python's ``random`` and
    numpy's global generator. Put it in the state (``{"rng": tiercheck.RNGState(), ...}``): each
    ``save()`` records the generators as they are then, and ``restore()`` sets them, so a resumed
    run draws the same numbers as an uninterrupted one. Save and restore on the same kind of
    machine (with or without CUDA): a state saved without CUDA device states has none to restore.
    """

    def state_dict(self) -> dict[str, Any]:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": {"kind": str(kind), "keys": keys, "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached)},
        }  # fmt: skip
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        n = state["numpy"]
        keys = np.asarray(n["keys"], dtype=np.uint32)
        np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(state["cuda"]))
