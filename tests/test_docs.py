"""The documentation keeps up with the code: every public name and every option field is in the API
reference, the keys ``stats()`` and ``SaveHandle.timings`` report are documented, the README's quick
start is on its first screen, and (where MkDocs is installed: the ``docs`` extra) the site builds
with ``--strict`` and its reference page shows every name.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import itertools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tiercheck
from tests.shm import private_shm
from tiercheck import options

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference.md"
OPTIONS = [cls for _, cls in inspect.getmembers(options, inspect.isclass) if dataclasses.is_dataclass(cls)]


def directives() -> set[str]:
    """The objects the reference page renders (``::: tiercheck.X`` lines)."""
    return set(re.findall(r"^::: (\S+)$", REFERENCE.read_text(), flags=re.M))


def documented_attributes(cls: type) -> set[str]:
    """The names in the ``Attributes:`` section of a class's docstring (Google style)."""
    doc = inspect.getdoc(cls) or ""
    section = doc.split("Attributes:\n", 1)[1] if "Attributes:\n" in doc else ""
    section = section.split("\n\n", 1)[0] if not section.startswith("    ") else section
    return set(re.findall(r"^    (\w+)(?: \([^)]*\))?:", section, flags=re.M))


def test_every_public_name_is_in_the_reference() -> None:
    rendered = directives()
    missing = []
    for name in tiercheck.__all__:
        obj = getattr(tiercheck, name)
        if name == "__version__":
            ok = "__version__" in REFERENCE.read_text()
        elif inspect.ismodule(obj):
            ok = obj.__name__ in rendered
        else:  # by its public name, or as a member of a module the page renders whole (tiercheck.errors)
            ok = f"tiercheck.{name}" in rendered or obj.__module__ in rendered
        if not ok:
            missing.append(name)
    assert not missing, f"docs/reference.md renders no entry for {missing}"


@pytest.mark.parametrize("cls", OPTIONS, ids=lambda c: c.__name__)
def test_every_option_field_is_documented(cls: type) -> None:
    assert f"tiercheck.{cls.__name__}" in directives()
    fields = {f.name for f in dataclasses.fields(cls)}
    documented = documented_attributes(cls)
    assert fields == documented, (
        f"{cls.__name__}'s docstring (Attributes:) lacks {sorted(fields - documented)}, "
        f"names what is no field: {sorted(documented - fields)}"
    )


def test_every_parameter_of_the_entry_points_is_documented() -> None:
    init = inspect.signature(tiercheck.Checkpointer.__init__).parameters
    doc = inspect.getdoc(tiercheck.Checkpointer) or ""
    args = doc.split("Args:\n", 1)[1]
    assert [p for p in init if p != "self" and not re.search(rf"^    {p}:", args, flags=re.M)] == []
    for fn in (tiercheck.Checkpointer.restore, tiercheck.Checkpointer.close, tiercheck.load):
        doc = inspect.getdoc(fn) or ""
        params = [p for p in inspect.signature(fn).parameters if p not in ("self", "io_threads")]
        documented = [p for p in params if f"``{p}" in doc or f"{p}=" in doc or re.search(rf"^    {p}:", doc, re.M)]
        assert documented == params, fn.__qualname__


def test_stats_and_timings_keys_are_documented(tmp_path: Path) -> None:
    """Keys appear as a Checkpointer saves and restores; each is named in the stats page, and the
    save's timings in ``SaveHandle``'s docstring."""
    import torch

    stats_doc = (ROOT / "docs" / "concepts" / "stats.md").read_text()
    handle_doc = inspect.getdoc(tiercheck.SaveHandle) or ""
    state = {"w": torch.arange(8.0)}
    with tiercheck.Checkpointer(state, local=tmp_path, staging=tiercheck.StagingOptions(prefault=False)) as ck:
        keys = set(ck.stats())
        handle = ck.save(1)
        handle.wait()
        keys |= set(ck.stats())
        assert ck.restore() == 1
        keys |= set(ck.stats())
    assert sorted(k for k in keys if f"`{k}`" not in stats_doc) == []
    timings = set(handle.timings) | {"hook_blocked_s"}  # the last only when a step waited for the copy
    assert sorted(k for k in timings if k not in handle_doc) == []


def test_the_readme_is_short_and_starts_with_the_quick_start() -> None:
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines: move detail into docs/"
    first_screen = "\n".join(lines[:40])
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh"):
        assert command in first_screen, f"{command!r} is not on the README's first screen"
        assert (ROOT / command.split()[1]).is_file()
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), f"README links to {link}, which does not exist"


def test_the_plots_draw_from_committed_json() -> None:
    spec = importlib.util.spec_from_file_location("plots", ROOT / "docs" / "plots.py")
    assert spec is not None and spec.loader is not None
    plots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plots)
    for source in plots.SOURCES:
        assert source.is_file(), source
    if shutil.which("git") and (ROOT / ".git").exists():
        rel = [str(s.relative_to(ROOT)) for s in plots.SOURCES]
        tracked = subprocess.run(["git", "ls-files", "--", *rel], cwd=ROOT, capture_output=True, text=True).stdout
        assert sorted(tracked.split()) == sorted(rel), "docs/plots.py reads benchmark JSON that git does not track"


def _pages() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md"))


def test_the_docs_speak_of_the_project_only() -> None:
    """docs/performance.md said whether a device was lent to the session that wrote it, and which issue a change
    came with: how the docs came to be written, not what the project is or does."""
    how_written = re.compile(r"\bissue \d+|\bsession\b|\blent\b|\bthis benchmark was written\b", re.I)
    said = [f"{page.relative_to(ROOT)}: {m.group(0)!r}" for page in _pages() for m in how_written.finditer(page.read_text())]
    assert said == []


def test_the_home_page_links_every_page_of_the_site() -> None:
    """docs/index.md, the map of the site, left out the Lightning and torchtitan pages."""
    nav = re.findall(r"^\s*-\s+(?:[^:]+:\s+)?([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    assert "frameworks/lightning.md" in nav and "frameworks/torchtitan.md" in nav, nav
    linked = set(re.findall(r"\]\(([\w/.-]+\.md)(?:#[\w-]*)?\)", (ROOT / "docs" / "index.md").read_text()))
    assert [page for page in nav if page != "index.md" and page not in linked] == []


def test_the_site_loads_no_script_from_another_host() -> None:
    """The tier diagram was a Mermaid block, which Material for MkDocs draws with a script it loads from a CDN
    when the page is opened: no diagram offline, and a third party on every visit. Diagrams are static."""
    fences = [str(page.relative_to(ROOT)) for page in _pages() if re.search(r"^```mermaid", page.read_text(), re.M)]
    assert fences == []
    assert "mermaid" not in (ROOT / "mkdocs.yml").read_text()
    assert "extra_javascript" not in (ROOT / "mkdocs.yml").read_text()


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="MkDocs not installed (the docs extra)")
def test_the_site_builds_strict_and_shows_every_name(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    page = (site / "reference" / "index.html").read_text()
    ids = set(re.findall(r'id="(tiercheck\.[\w.]+)"', page))
    for name in tiercheck.__all__:
        obj = getattr(tiercheck, name)
        if name == "__version__" or inspect.ismodule(obj):
            continue
        assert {f"tiercheck.{name}", f"{obj.__module__}.{name}"} & ids, f"{name} has no entry on the reference page"
    for cls in OPTIONS:
        section = page.split(f'id="tiercheck.{cls.__name__}"', 1)[1].split('id="tiercheck.', 1)[0]
        for f in dataclasses.fields(cls):
            assert f'title="tiercheck.{cls.__name__}.{f.name}"' in section, (
                f"{cls.__name__}.{f.name} is not in its entry"
            )
    for png in ("gpu-stall.png", "gpu-durable.png", "gpu-restore.png", "remote.png"):
        assert (site / "img" / png).stat().st_size > 1000


def test_the_dcp_example_recipe_writes_into_a_temporary_directory() -> None:
    """The recipe in examples/dcp_train.py's docstring wrote a.pt and b.pt into the repository root."""
    doc = (ROOT / "examples" / "dcp_train.py").read_text().split('"""')[1]
    commands = [line.strip() for line in doc.splitlines() if line.strip().startswith("python examples/")]
    assert len(commands) == 3 and "d=$(mktemp -d)" in doc
    for command in commands:
        words = command.split()
        for flag in ("--ckpt-dir", "--out"):
            if flag in words:
                assert words[words.index(flag) + 1].startswith("$d/"), command


def test_the_tiers_table_holds_the_memory_row() -> None:
    """A blank line before the memory row ended the table there: the row rendered as a paragraph of pipes."""
    lines = (ROOT / "docs" / "concepts" / "tiers.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| tier |"))
    table = list(itertools.takewhile(lambda line: line.startswith("|"), lines[start:]))
    assert [row.split("|")[1].strip() for row in table[2:]] == ["host", "memory (opt-in)", "local", "peer", "remote"]
    assert not [line for line in lines[start + len(table):] if line.startswith("| ")], "a row outside the table"


def test_the_memory_pages_example_runs_and_a_restart_resumes_from_it(tmp_path: Path) -> None:
    """docs/concepts/memory.md's Checkpointer(..., memory=MemoryOptions(...)) example, as written but for its two
    paths (a temporary directory, a private directory on the real /dev/shm): it trains and saves 200 steps, and
    run again it resumes at step 200."""
    page = (ROOT / "docs" / "concepts" / "memory.md").read_text()
    code = re.search(r"```python\n(.*?)\n```", page, flags=re.S)
    assert code is not None and "memory=memory" in code.group(1)
    with private_shm() as shm:
        source = code.group(1).replace('"/dev/shm/run1"', repr(str(shm))).replace('"/nvme/ckpt/run1"', repr(str(tmp_path)))
        first: dict[str, object] = {}
        exec(compile(source, "docs/concepts/memory.md", "exec"), first)
        assert first["start"] is None and first["state"]["progress"] == {"step": 200}  # type: ignore[index]
        again: dict[str, object] = {}
        exec(compile(source, "docs/concepts/memory.md", "exec"), again)
        assert again["start"] == 200
