"""The recipe in docs/format.md for reading a step with plain zarr and fsspec, no tiercheck involved.

Kept as docs/format.md gives it, so the tests prove the recipe users copy.
"""

from __future__ import annotations

import json
import re
from typing import Any

import fsspec
import zarr


def open_step(url: str, protocol: str = "file", **options: Any) -> zarr.Group:
    """A committed tiercheck step as a read-only zarr group."""
    fs = fsspec.filesystem(protocol, **options)
    refs: dict[str, Any] = {}
    for f in sorted(fs.glob(f"{url}/refs/*.json")):  # one map per saving rank
        for key, ref in json.loads(fs.cat_file(f))["refs"].items():
            if not isinstance(ref, str) and not re.fullmatch(r"\{\{u\}\}/packs/rank-[0-9]{6,}\.bin", str(ref[0])):
                raise ValueError(f"{f}: {key} points outside the step: {ref[0]!r}")  # ranges: tiercheck verify
            refs[key] = ref
    store = zarr.storage.FsspecStore.from_url(
        "reference://",
        storage_options={
            "fo": {"version": 1, "templates": {"u": url}, "refs": refs},
            "remote_protocol": protocol,
            "remote_options": {**options, "asynchronous": True},  # as zarr opens the reference fs
        },
        read_only=True,
    )
    return zarr.open_group(store, mode="r")
