"""What a rank's reference map (``refs/rank-N.json``) says of its step, checked against the step.

The map is for plain zarr, which reads a step through it; tiercheck reads chunks through the manifest
instead. But the map is a second record of what the rank wrote: it names its step and save (format
5, under ``REFS_STAMP``), and it holds the ``zarr.json`` of every array the rank coordinated, whose
dtype, kind, shape and chunks the rank also wrote to its arrays file (``arrays-N.json``). A manifest
file re-sealed by hand passes its own checksum; where the map says otherwise, the step's files
disagree and the step is damaged: ``verify`` reports it, ``load`` refuses it, and a restore that
would refuse the live state for such a record passes the step over instead (the state fits the
step as written; the record is what changed). An arrays file relabelling float32 as int32 changes
no chunk's size, so nothing else in the step shows it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from tiercheck.errors import CorruptCheckpointError, TiercheckError
from tiercheck.format.codec import STORAGE_DTYPES
from tiercheck.format.manifest import ArrayRecord
from tiercheck.format.paths import FORMAT_NAME, REFS_DIR, refs_file, shard_file, step_dir
from tiercheck.format.saveid import REFS_STAMP, check_save
from tiercheck.format.steps import read_small
from tiercheck.tiers.base import Tier

_DOC = "/zarr.json"


def read_map(tier: Tier, step: int, rank: int, *, where: str) -> dict[str, Any] | None:
    """Saving rank ``rank``'s reference map of ``step``, parsed; None where there is none (a rank
    that wrote nothing). ``CorruptCheckpointError`` (prefixed ``where``, which
    names the map) when it cannot be read or is not a reference map."""
    try:
        data = read_small(tier, f"{step_dir(step)}/{refs_file(rank)}", where=f"{tier.url}: step {step}")
    except FileNotFoundError:
        return None
    except TiercheckError as e:
        raise CorruptCheckpointError(f"{where}: not a reference map ({e})") from None
    return parse_map(data, where=where)


def parse_map(data: bytes, *, where: str) -> dict[str, Any]:
    """A reference map's bytes (``data``), parsed: ``CorruptCheckpointError`` (prefixed ``where``)
    when they are not a reference map."""
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or not isinstance(doc.get("refs"), dict):
            raise ValueError("no refs")
        return doc
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: not a reference map ({e})") from None


def map_owner(path: str) -> int | None:
    """The saving rank whose reference map ``path`` (inside a step) is, or None when it is none."""
    m = _MAP.match(path)
    return int(m.group(1)) if m else None


_MAP = re.compile(rf"^{REFS_DIR}/rank-([0-9]{{6,}})\.json$")


def stamp_problem(doc: Mapping[str, Any], step: int, save: str | None, *, where: str) -> str | None:
    """Why a map (``doc``) is not ``step``'s of save ``save``, or None. A map names both (``save``
    None: not checked); a step directory renamed, its index
    and marker rewritten to match, still holds maps naming the step it was."""
    stamp = doc.get(REFS_STAMP)
    try:
        check_save(stamp, save, where=where)
    except CorruptCheckpointError as e:
        return str(e)
    if save is not None and isinstance(stamp, dict) and stamp.get("step") != step:
        return (
            f"{where}: its {REFS_STAMP}.step is {str(stamp.get('step'))[:40]}, not this step ({step}): a map of "
            "another step (a directory renamed, or a map copied in)"
        )
    return None


def document_problems(
    doc: Mapping[str, Any], rank: int, records: Mapping[str, ArrayRecord], *, where: str
) -> list[str]:
    """Where the ``zarr.json`` documents in saving rank ``rank``'s map (``doc``) disagree with the
    records of their arrays in ``records`` (those of ``arrays-<rank>.json``: a map holds the
    documents of the arrays its rank coordinated), one line each. Arrays the map holds no document
    of, and documents of arrays ``records`` lacks (groups, another node's), are passed by."""
    refs = doc["refs"]
    bad = []
    for path, rec in (records if len(records) <= len(refs) else _documented(refs, records)).items():
        text = refs.get(path + _DOC)
        if text is None:
            continue
        mine, theirs = _disagreement(text, rec)
        if mine:
            bad.append(
                f"{where}: {path + _DOC!r} gives {', '.join(mine)}; the record of {shard_file(rank)} gives "
                f"{', '.join(theirs)} (a record relabelled, or the map's document)"
            )
    return bad


def _documented(refs: Mapping[str, Any], records: Mapping[str, ArrayRecord]) -> dict[str, ArrayRecord]:
    """The records of the arrays a map holds documents of: looked up from the map's side, the smaller one."""
    paths = (key[: -len(_DOC)] for key in refs if key.endswith(_DOC))
    return {p: records[p] for p in paths if p in records}


def _disagreement(text: object, rec: ArrayRecord) -> tuple[list[str], list[str]]:
    """The fields of an array's ``zarr.json`` (``text``) that disagree with its record, as the
    document gives them and as the record does (empty when they agree)."""
    try:
        doc = json.loads(text) if isinstance(text, str) else None
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        return ["no zarr.json document"], [f"dtype {rec.dtype!r}, shape {list(rec.shape)}"]
    attrs = doc.get("attributes")
    ours = attrs.get(FORMAT_NAME) if isinstance(attrs, dict) else None
    ours = ours if isinstance(ours, dict) else {}
    grid = doc.get("chunk_grid")
    config = grid.get("configuration") if isinstance(grid, dict) else None
    stored = STORAGE_DTYPES.get(rec.dtype, (None,))[0]
    fields = [  # (the document's field, its value, the record's field, its value, what the document would hold)
        ("data_type", doc.get("data_type"), "dtype", rec.dtype, stored),
        (f"attributes.{FORMAT_NAME}.dtype", ours.get("dtype"), "dtype", rec.dtype, rec.dtype),
        (f"attributes.{FORMAT_NAME}.kind", ours.get("kind"), "kind", rec.kind, rec.kind),
        ("shape", doc.get("shape"), "shape", list(rec.shape), list(rec.shape)),
        ("chunk_shape", config.get("chunk_shape") if isinstance(config, dict) else None, "chunks",
         list(rec.chunks), list(rec.chunks)),
    ]  # fmt: skip
    mine: list[str] = []
    theirs: list[str] = []
    for field, got, own, value, want in fields:
        if want is not None and got != want:
            mine.append(f"{field} {str(got)[:80] if isinstance(got, list) else repr(got)[:80]}")
            said = f"{own} {value if isinstance(value, list) else repr(value)}"
            if said not in theirs:
                theirs.append(said)
    return mine, theirs


def check_documents(
    tier: Tier, step: int, rank: int, records: Mapping[str, ArrayRecord], *, save: str | None, where: str
) -> None:
    """Saving rank ``rank``'s map of ``step``, where this tier holds it: naming this step and save
    ``save`` (``stamp_problem``), its documents agreeing with ``records`` (``document_problems``).
    ``CorruptCheckpointError`` naming the map, the document and the fields when not. One read of the
    map."""
    at = f"{where}: {refs_file(rank)}"
    doc = read_map(tier, step, rank, where=at)
    if doc is not None:  # verify reports a map missing beside its pack; nothing to compare here
        check_map(doc, step, rank, records, save=save, where=at)


def check_map(
    doc: Mapping[str, Any], step: int, rank: int, records: Mapping[str, ArrayRecord], *, save: str | None, where: str
) -> None:
    """What ``load`` asks of saving rank ``rank``'s map (``doc``, parsed) of ``step``, before it reads
    the step (``check_documents``) and a copy before it commits the map (``transfer.copy_file``): it
    names this step and save ``save``, and its documents agree with ``records``."""
    problem = stamp_problem(doc, step, save, where=where)
    if problem is None:
        problem = next(iter(document_problems(doc, rank, records, where=where)), None)
    if problem is not None:
        raise CorruptCheckpointError(problem)
