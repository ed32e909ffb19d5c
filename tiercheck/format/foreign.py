"""Other frameworks' checkpoints lying where a tiercheck step was looked for, recognised by their own
files' names and first bytes (nothing is unpickled or loaded here): so a restore that finds no step of
its own stops instead of starting from scratch over a run's progress (``restore.protocol``), and says
which ``tiercheck import`` command brings it over.

- DCP (``dcp.save``, torchtitan's ``step-N/``): a directory holding ``.metadata``;
- DeepSpeed: ``global_stepN/`` directories, and the one its ``latest`` file names, holding ``torch.save`` files;
- ``torch.save`` files (Lightning's ``.ckpt``, ``.pt``, ``.pth``, ``.bin``): a zip archive or a pickle,
  by their first bytes (a tiercheck Lightning pointer is JSON, and is none of these).
"""


from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from tiercheck.tiers.base import Tier

__all__ = ["DCP_METADATA", "Foreign", "find_foreign", "say_foreign", "step_in_name"]

DCP_METADATA = ".metadata"  # DCP's FileSystemWriter's index of a checkpoint
DEEPSPEED_LATEST = "latest"  # DeepSpeed's file naming a save_dir's newest tag
TORCH_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
_ZIP = b"PK\x03\x04"  # torch.save's archive (the default since torch 1.6)
_PICKLE = b"\x80"  # a pickle's PROTO opcode: torch.save's legacy format
_NUMBER = re.compile(r"([0-9]+)")
_DEEPSPEED_TAG = re.compile(r"global_step([0-9]+)")


@dataclass(frozen=True, slots=True)
class Foreign:
    """One checkpoint of another framework: its kind, its path on the tier, its step where its name says one."""

    kind: str  # "dcp", "deepspeed", "torch"
    path: str  # relative to the tier's root ("" for the root itself)
    step: int | None

    def what(self) -> str:
        return {"dcp": "a DCP checkpoint", "deepspeed": "a DeepSpeed checkpoint", "torch": "a torch.save file"}[
            self.kind
        ]


def find_foreign(tier: Tier) -> list[Foreign]:
    """The other frameworks' checkpoints at ``tier``'s root and directly under it, oldest step first
    (by the number in each name; those with none first)."""
    found: list[Foreign] = []
    if _readable(tier, DCP_METADATA):
        found.append(Foreign("dcp", "", None))
    latest = _latest_tag(tier)  # DeepSpeed's newest tag, whatever its name (save_checkpoint(dir, tag=...))
    for name in tier.list_dir(""):
        m = _DEEPSPEED_TAG.fullmatch(name)
        if (m or name == latest) and _holds_torch_files(tier, name):  # the plugin's own tags hold JSON pointers
            found.append(Foreign("deepspeed", name, int(m.group(1)) if m else step_in_name(name)))
        elif _readable(tier, f"{name}/{DCP_METADATA}"):
            found.append(Foreign("dcp", name, step_in_name(name)))
        elif name.endswith(TORCH_SUFFIXES) and _head(tier, name) in (_ZIP, _PICKLE):
            found.append(Foreign("torch", name, step_in_name(name)))
    return sorted(found, key=lambda f: (f.step is not None, f.step or 0, f.path))


def say_foreign(tier: Tier, found: list[Foreign]) -> str:
    """Why a restore stops at ``found``: what lies where, and the command that imports the newest of it."""
    newest = found[-1]
    names = ", ".join(f.path or "(the directory itself)" for f in found[-8:])
    more = f" and {len(found) - 8} more" if len(found) > 8 else ""
    src = f"{tier.url.rstrip('/')}/{newest.path}" if newest.path else tier.url
    step = f" --step {newest.step}" if newest.step is not None else ""
    head = (
        f"{tier.url} holds no tiercheck step, but holds another framework's checkpoints ({names}{more}; the newest is "
        f"{newest.what()}): tiercheck will not start from scratch over them"
    )
    if newest.kind == "deepspeed":  # the plugin loads its tags as they are, or a tag is imported as a step
        return (
            f"{head}. Load it with DeepSpeed's engine and tiercheck's DeepSpeed plugin (install(engine, ..., "
            f"allow_pickle=True) where its files hold more than DeepSpeed's allow-listed types): "
            f"engine.load_checkpoint({str(tier.url)!r}, tag={newest.path!r}); its next save is a tiercheck step. "
            f"Or import it as a step the plugin restores: `tiercheck import {shlex.quote(tier.url)} --tag "
            f"{shlex.quote(newest.path)} --to {shlex.quote(tier.url)}`; or give this run a directory of its own"
        )
    return (
        f"{head}. Import it into a tiercheck step, then restore: `tiercheck import {shlex.quote(src)} --to "
        f"{shlex.quote(tier.url)}{step}`; or give this run a directory of its own"
    )


def step_in_name(name: str) -> int | None:
    """The last number in a checkpoint's name (``step-10``, ``epoch=1-step=400.ckpt``), if any."""
    numbers = _NUMBER.findall(name)
    return int(numbers[-1]) if numbers else None


def _holds_torch_files(tier: Tier, name: str) -> bool:
    try:
        files = [f for f in tier.list_dir(name) if f.endswith(TORCH_SUFFIXES)]
    except OSError:
        return False
    return any(_head(tier, f"{name}/{f}") in (_ZIP, _PICKLE) for f in files[:4])


def _latest_tag(tier: Tier) -> str | None:
    """The tag DeepSpeed's ``latest`` file names, where it is a short text naming one folder."""
    try:
        if not tier.exists(DEEPSPEED_LATEST):
            return None
        text = bytes(tier.read_range(DEEPSPEED_LATEST, 0, 256)).decode().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if text and "/" not in text and text not in (".", "..") else None


def _readable(tier: Tier, path: str) -> bool:
    try:
        return tier.exists(path)
    except OSError:
        return False


def _head(tier: Tier, name: str) -> bytes:
    """The first bytes of file ``name`` that tell a torch.save file (zip or pickle); b"" where unreadable."""
    try:
        head = bytes(tier.read_range(name, 0, 4))
    except OSError:
        return b""
    return head if head == _ZIP else head[:1]
