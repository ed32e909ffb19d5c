"""The formats before the current one that this library still reads, asked by what they hold, so
that no reader compares version numbers:

| format | the step's manifest                                  | chunks                   |
|--------|------------------------------------------------------|--------------------------|
| 1, 2   | one document, ``manifest.json``                      | a file each              |
| 3      | ``manifest.json`` an index; a part per saving rank   | a file each              |
| 4      | as 3, plus owners and reference maps                 | one pack per saving rank |
| 5      | as 4, every file naming the save that wrote it       | as 4                     |

Before format 5 a step's files name no save: a rank part and pack of another step or run of the
same layout, put in a step's directory, pass for that step's, and a resumed copy cannot tell a
file it already holds from another save's of the same size.

Each predicate takes the ``format_version`` a step's ``manifest.json`` states (checked on parsing:
``manifest.parse_manifest_doc``)."""

from __future__ import annotations

from tiercheck.format.manifest import JSON, Manifest, ManifestIndex
from tiercheck.format.paths import WHOLE_FORMAT
from tiercheck.format.saveid import SAVE_ID_FORMAT


def whole_manifest(version: int) -> bool:
    """Whether ``manifest.json`` is the whole manifest (formats 1 and 2), not an index of parts."""
    return version <= WHOLE_FORMAT


def has_packs(version: int) -> bool:
    """Whether each saving rank's chunks are in its pack (format 4), not a file per chunk."""
    return version >= 4


def chunk_files_with_parts(version: int) -> bool:
    """Whether chunks are files of their own whose checksums are in the ranks' parts (format 3)."""
    return not whole_manifest(version) and not has_packs(version)


def binds_files_to_save(version: int) -> bool:
    """Whether every file of a step names the save that wrote it (format 5): see ``manifest.check_save``."""
    return version >= SAVE_ID_FORMAT


def saving_world_size(doc: dict[str, JSON], index: bytes, *, where: str) -> int:
    """The saving job's world size from a parsed ``manifest.json`` (``doc``, as stored: ``index``)."""
    if whole_manifest(doc["format_version"]):
        return Manifest.from_bytes(index, where=where).world_size
    return ManifestIndex.from_doc(doc, where=where).world_size
