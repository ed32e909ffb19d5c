from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.servers import azure_container, azurite_server, s3_bucket, s3_server  # noqa: F401  (fixtures)
from tests.shm import private_shm

_BUILT_EXTENSIONS = "tiercheck-torch-extensions"  # the pytest cache's directory of finished builds
_PRIVATE_EXTENSIONS = pytest.StashKey[str]()  # this run's own TORCH_EXTENSIONS_DIR, when it made one


def pytest_configure(config: pytest.Config) -> None:
    """Compiled torch extensions (DeepSpeed's shared-memory op) go to a directory of this run's
    own: a test killed mid-compile leaves its lock file there, never in the shared
    ``~/.cache/torch_extensions`` where it would hang every later DeepSpeed use on the machine.
    Set before any rank or fork server starts, so they inherit it; removed when the run ends.

    It starts as a copy of the last finished build kept in pytest's cache (``keep_built_extensions``;
    none with ``-p no:cacheprovider`` or ``--cache-clear``): torch's loader runs ninja on it, which
    compiles again only what its sources, headers or flags changed, so the op's ~1 min of g++ is
    paid by the first run only."""
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        private = tempfile.mkdtemp(prefix="tiercheck-torch-extensions-")
        cache = getattr(config, "cache", None)
        kept = cache.mkdir(_BUILT_EXTENSIONS) if cache is not None else None
        if kept is not None:
            shutil.copytree(kept, private, dirs_exist_ok=True, ignore=shutil.ignore_patterns("lock"))
        os.environ["TORCH_EXTENSIONS_DIR"] = config.stash[_PRIVATE_EXTENSIONS] = private
        config.add_cleanup(lambda: shutil.rmtree(private, ignore_errors=True))


def keep_built_extensions(config: pytest.Config) -> None:
    """Keep this run's finished builds (see ``pytest_configure``) in pytest's cache for the next runs: copied
    beside the kept ones, then swapped in by renames, so a run killed meanwhile leaves no half copy."""
    cache, private = getattr(config, "cache", None), config.stash.get(_PRIVATE_EXTENSIONS, None)
    if cache is None or private is None:
        return
    kept = cache.mkdir(_BUILT_EXTENSIONS)
    fresh = Path(tempfile.mkdtemp(prefix=f"{_BUILT_EXTENSIONS}-", dir=kept.parent))
    old = kept.with_name(f"{fresh.name}-old")
    try:
        shutil.copytree(private, fresh, dirs_exist_ok=True, ignore=shutil.ignore_patterns("lock"))
        kept.rename(old)
        fresh.rename(kept)
    except OSError:  # another run swapping at the same time, a full disk: the next run compiles, as without
        pass
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


@pytest.fixture(autouse=True)
def _tiercheck_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tiercheck")


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MiB tmpfs (a container's /dev/shm is 64 MiB), mounted for the test."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.fixture
def shm() -> Iterator[Path]:
    """A directory of its own on the real /dev/shm (a tmpfs: the memory tier's), removed after the test."""
    with private_shm() as path:
        yield path


def seeded_tensors(seed: int, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """A state's tensors: float32 normals of ``shapes`` (name -> shape), drawn in that order from a
    generator seeded with ``seed``, so a seed gives the same values on every run and two seeds differ
    with the same layout. A test adds its plain entries (``| {"step": seed}``) or nests it."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=g) for name, shape in shapes.items()}


def assert_identical(a: Any, b: Any, where: str = "state", *, any_order: bool = False) -> None:
    """Bit-identical equality for nested states (NaNs compare equal to themselves); ``any_order``:
    a mapping's keys may come in another order (a state rebuilt by a framework from its own plan)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: {type(b)} is not a tensor"
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        )
        assert a.device == b.device or b.device.type == "cpu", where
        ua, ub = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
        assert torch.equal(ua.reshape(-1).view(torch.uint8), ub.reshape(-1).view(torch.uint8)), f"{where}: bytes differ"
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, where
        assert a.tobytes() == b.tobytes(), f"{where}: bytes differ"
    elif isinstance(a, dict):
        same = set(a) == set(b) if any_order else list(a) == list(b)
        assert isinstance(b, dict) and same, f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_identical(a[k], b[k], f"{where}/{k}", any_order=any_order)
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}/{i}", any_order=any_order)
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, where
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} vs {b!r}"


@contextlib.contextmanager
def tiercheck_said(level: int = logging.WARNING) -> Iterator[list[str]]:
    """The messages tiercheck logs at ``level`` or above while inside, in order (in a rank's process,
    where pytest's ``caplog`` does not reach)."""
    said: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("tiercheck")
    before = log.level
    log.addHandler(handler)
    if level < log.getEffectiveLevel():
        log.setLevel(level)
    try:
        yield said
    finally:
        log.removeHandler(handler)
        log.setLevel(before)
