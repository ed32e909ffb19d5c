"""The shell scripts that set up an environment (``scripts/test.sh``, the framework demos), run for real in a copy
of ``scripts/`` whose ``.venv/bin/python`` is a stand-in: it records each call, has nothing installed, lets
``pip install`` succeed (with the noise pip prints on a machine with extra indexes) unless told otherwise, and
runs no training. So the tests see what the scripts ask pip for and what they print, without installing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# $FAIL_PIP_IF: a pip install whose arguments contain it fails (unless it names PyTorch's CPU index).
_PYTHON = r"""#!/usr/bin/env bash
printf '%s\n' "$*" >>"$CALLS"
case "$1" in
    -c) exit 1 ;;  # nothing is installed: every "import ..." probe fails
    -m)
        echo "WARNING: pip index noise ($*)"
        if [[ -n ${FAIL_PIP_IF:-} && "$*" == *"$FAIL_PIP_IF"* && "$*" != *download.pytorch.org/whl/cpu* ]]; then
            echo "ERROR: it broke" >&2
            exit 3
        fi
        exit 0 ;;
    *) exit 4 ;;  # a training run: not here
esac
"""


def sandbox(tmp_path: Path, *scripts: str) -> Path:
    """A root holding copies of ``scripts`` and the stand-in ``.venv/bin/python``."""
    root = tmp_path / "root"
    (root / "scripts").mkdir(parents=True)
    for script in scripts:
        shutil.copy(ROOT / "scripts" / script, root / "scripts" / script)
    python = root / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(_PYTHON)
    python.chmod(0o755)
    return root


def run_script(root: Path, script: str, *args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    calls = root / "calls.log"
    done = subprocess.run(
        ["bash", str(root / "scripts" / script), *args],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "CALLS": str(calls), "TMPDIR": str(root), **env},
    )  # fmt: skip
    return done, calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.parametrize(("script", "framework"), [("demo_deepspeed.sh", "deepspeed=="), ("demo_megatron.sh", "megatron-core==")])
def test_framework_demos_install_the_cpu_build_of_torch_first(tmp_path: Path, script: str, framework: str) -> None:
    """They installed plain ``torch==2.13.0``: on Linux, PyPI's CUDA build (~2.5 GB of wheels). The CPU build is
    asked for by name from the configured indexes, then with PyTorch's CPU index added, and before the framework,
    so that it is the torch the framework's requirement finds."""
    root = sandbox(tmp_path, "demo_lib.sh", script)
    for index_has_it in (True, False):
        done, calls = run_script(root, script, "7", **({} if index_has_it else {"FAIL_PIP_IF": "torch=="}))
        pip = [c for c in calls if c.startswith("-m pip install")]
        torch = [c for c in pip if "torch==" in c]
        assert torch and all('torch==2.13.0+cpu' in c.split() for c in torch), pip
        assert [c for c in torch if "--extra-index-url https://download.pytorch.org/whl/cpu" in c] == (
            [] if index_has_it else [torch[-1]]
        ), torch
        assert len(torch) == (1 if index_has_it else 2), torch
        first_framework = next(i for i, c in enumerate(pip) if framework in c)
        assert pip.index(torch[-1]) < first_framework, pip
        # the setup went through: the script stopped at its first training run, the stand-in's exit 4
        assert calls[-1].startswith("-u examples/") and done.returncode != 0, (calls, done.stderr)
        (root / "calls.log").unlink()


def test_test_sh_keeps_setup_output_in_a_log_it_names_when_a_step_fails(tmp_path: Path) -> None:
    """scripts/test.sh printed pip's output (125 lines of index warnings on a machine with extra indexes). Its
    setup steps are quiet; the one that fails shows the end of the log and names the log, which is kept."""
    root = sandbox(tmp_path, "test.sh")
    done, calls = run_script(root, "test.sh", FAIL_PIP_IF="deepspeed==", TIERCHECK_MEGATRON_LANE="0")
    assert done.returncode == 1 and done.stdout == "", done
    assert calls[-1].endswith("deepspeed==0.19.8"), calls  # torch and setuptools went through before it
    [log] = root.glob("tiercheck-setup.*.log")  # kept, and named
    text = log.read_text()
    assert "torch==2.13.0+cpu" in text and "setuptools wheel" in text and "ERROR: it broke" in text, text
    assert "ERROR: it broke" in done.stderr
    assert "scripts/test.sh: this setup step failed: env DS_BUILD_OPS=0 .venv/bin/python -m pip install" in done.stderr
    assert done.stderr.rstrip().endswith(f"its whole output, and the earlier steps': {log}"), done.stderr


def test_test_sh_says_each_setup_step_as_it_starts(tmp_path: Path) -> None:
    """scripts/test.sh printed nothing for ~3 minutes while it installed. Each setup step is named on stderr as
    it starts (stdout stays the checks' and the tests'), in the order the steps run, up to the one that fails."""
    root = sandbox(tmp_path, "test.sh")
    done, calls = run_script(root, "test.sh", FAIL_PIP_IF="torchtitan==", TIERCHECK_MEGATRON_LANE="0")
    assert done.returncode == 1 and done.stdout == "", done
    said = [line for line in done.stderr.splitlines() if line.startswith("==> ")]
    assert said == [
        "==> installing torch 2.13.0 (the CPU build) into .venv",
        "==> installing DeepSpeed 0.19.8 (built from source against that torch, no compiled ops)",
        "==> installing torchtitan 0.3.0 and the modules it needs",
    ], done.stderr
    assert done.stderr.index(said[-1]) < done.stderr.index("ERROR: it broke"), done.stderr
    assert calls[-1].endswith("--no-deps torchtitan==0.3.0"), calls  # the step named last is the one that failed
