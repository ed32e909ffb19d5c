"""The training loop the README and the getting-started page show is ``examples/quickstart.py``, and
it works: it runs as written, and a step it saves is restored bit-identically. The quick start's demo
(``examples/demo.py``) restarts a killed run from the memory tier."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch

import tiercheck

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.py"


def quickstart() -> ModuleType:
    spec = importlib.util.spec_from_file_location("quickstart", QUICKSTART)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def loop_section() -> str:
    """The lines between the file's ``--8<-- [start:loop]`` and ``[end:loop]`` markers, dedented."""
    text = QUICKSTART.read_text()
    body = text.split("# --8<-- [start:loop]\n", 1)[1].split("# --8<-- [end:loop]", 1)[0]
    return textwrap.dedent(body.rstrip() + "\n").strip("\n")


def test_the_quickstart_runs_as_written(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(QUICKSTART)], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from step 50: every parameter bit-identical" in proc.stdout
    assert list(tmp_path.iterdir()) == [], "the quickstart wrote outside its temporary directory"


def test_a_step_the_quickstart_saves_is_restored_bit_identically(tmp_path: Path) -> None:
    qs = quickstart()
    torch.manual_seed(0)  # as train() does: the weights before any step
    initial = qs.MyModel().state_dict()
    restored, saved = qs.train(tmp_path, 51)  # its last step, 50, is saved after its optimizer step
    assert restored is None
    assert tiercheck.load(tmp_path)["progress"] == {"epoch": 0, "samples_seen": 51 * qs.BATCH}
    restored, again = qs.train(tmp_path, 51)  # nothing left to train: the model is what the restore put there
    assert restored == 50
    before, after = saved.state_dict(), again.state_dict()
    assert list(before) == list(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name
        assert not torch.equal(before[name], initial[name]), f"{name} was never trained"


def test_the_readme_shows_the_quickstart_loop_as_it_is() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Using it\n", 1)[1]
    block = re.search(r"```python\n(.*?)\n```", section, flags=re.S)
    assert block is not None, "README's 'Using it' has no python block"
    assert block.group(1) == loop_section(), "README's loop differs from examples/quickstart.py's: copy it from there"
    assert "examples/quickstart.py" in section.split("\n## ", 1)[0]


def test_the_getting_started_page_includes_the_quickstart() -> None:
    page = (ROOT / "docs" / "getting-started.md").read_text()
    assert '--8<-- "examples/quickstart.py"' in page


def test_the_demo_kills_the_run_and_it_restarts_from_memory_bit_identical(tmp_path: Path) -> None:
    """examples/demo.py (``bash scripts/demo.sh``'s run), short: the killed run restarts from the memory tier,
    the step the kill left there, says how long that took against the local directory, and ends bit-identical."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm tmpfs on this machine: the demo runs without the memory tier")
    before = set(Path("/dev/shm").glob("tiercheck-demo-*"))
    cmd = [sys.executable, str(ROOT / "examples" / "demo.py"), "--steps", "24", "--every", "4", "--seed", "5"]
    proc = subprocess.run([*cmd, "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=300, check=False)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "PASS: killed at step" in out and "(from memory), and finished bit-identical" in out, out
    restart = re.search(r"\[run 2, resumed\] restart: step (\d+) restored from memory in [\d.]+ ms", out)
    assert restart is not None, out
    # the step restored is the newest one the kill left in memory, newer than any on disk unless both hold it
    in_memory = [int(s) for s in re.findall(r"step-(\d+)/ .* in memory .* committed", out)]
    on_disk = [int(s) for s in re.findall(r"step-(\d+)/ .* on disk .* committed", out)]
    assert in_memory and int(restart.group(1)) == max(in_memory) >= max(on_disk, default=-1), out
    step = restart.group(1)
    assert re.search(rf"\[disk restore\] restart: step {step} restored from the local directory in [\d.]+ ms", out)
    assert re.search(r"from memory +[\d.]+ ms .*\n +from the local directory +[\d.]+ ms", out), out
    # each run says at start where its checkpoints go: the memory tier named
    assert re.search(r"\[run 2, resumed\] checkpoints: .*, memory tier under /dev/shm/tiercheck-demo-", out), out
    assert re.search(r"the restart from memory took [\d.]+x the restart from the local directory, end to end", out), out
    assert set(Path("/dev/shm").glob("tiercheck-demo-*")) == before, "the demo left its memory tier behind"
