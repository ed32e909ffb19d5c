"""Rough edges a new user met (issue 45 item 4): usage errors that exit 2 and name the option, the
``plan`` table, ``ls`` without credentials, errors that derive from ``TiercheckError``, and
``inspect`` showing the state's plain values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import tiercheck
from tiercheck.cli import main
from tiercheck.errors import (
    ClosedError,
    InvalidArgumentError,
    NotADirectoryTierError,
    TiercheckError,
    UnsupportedValueError,
)


def cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


# ------------------------------------------------------------------ numeric options: usage errors


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["gc", "DIR", "--keep-last", "0"], "--keep-last"),
        (["gc", "DIR", "--keep-last", "-1"], "--keep-last"),
        (["gc", "DIR", "--keep-every", "0"], "--keep-every"),
        (["gc", "DIR", "--keep-last", "1", "--grace-hours", "-1"], "--grace-hours"),
        (["gc", "DIR", "--keep-last", "1", "--grace-hours", "nan"], "--grace-hours"),
        (["plan", "--params", "7e9", "--tp", "0"], "--tp"),
        (["plan", "--params", "7e9", "--pp", "-2"], "--pp"),
        (["plan", "--params", "7e9", "--dp", "0"], "--dp"),
        (["plan", "--params", "7e9", "--gpus-per-node", "0"], "--gpus-per-node"),
        (["plan", "--params", "7e9", "--restart-s", "-5"], "--restart-s"),
        (["plan", "--params", "7e9", "--node-mtbf-hours", "0"], "--node-mtbf-hours"),
        (["plan", "--params", "7e9", "--tier", "nvme:-1:1:node"], "--tier"),
        (["plan", "--params", "7e9", "--tier", "nvme:nan:1:node"], "--tier"),
        (["plan", "--layers", "0", "--hidden", "8", "--vocab", "10"], "--layers"),
        (["plan", "--layers", "2", "--hidden", "-8", "--vocab", "10"], "--hidden"),
        (["plan", "--layers", "2", "--hidden", "8", "--vocab", "0"], "--vocab"),
        (["plan", "--layers", "2", "--hidden", "8", "--vocab", "10", "--ffn", "0"], "--ffn"),
        (["plan", "--params", "0"], "--params"),
        (["plan", "--params", "7X"], "--params"),
        (["plan", "--params", "1e400"], "--params"),
        (["export", "DIR", "--to", "OUT", "--max-shard-size", "0"], "--max-shard-size"),
        (["export", "DIR", "--to", "OUT", "--max-shard-size", "lots"], "--max-shard-size"),
        (["--retry-deadline", "0", "ls", "DIR"], "--retry-deadline"),
        (["verify", "DIR", "--threads", "0"], "--threads"),
        (["verify", "DIR", "--step", "-3"], "--step"),
    ],
)
def test_a_numeric_option_out_of_range_is_a_usage_error_naming_it(args: list[str], option: str) -> None:
    """``gc --keep-last 0`` exited 1 with ``RetentionOptions.keep_last must be at least 1``: the
    library's name for it, and the status of a failed run."""
    result = cli(*args)
    assert result.exit_code == 2, (args, result.output)
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"tiercheck: error: Invalid value for '{option}'"), line


# ------------------------------------------------------------------------------------- plan


@pytest.mark.parametrize(
    ("text", "count"),
    [("7B", 7_000_000_000), ("7b", 7_000_000_000), ("70e9", 70_000_000_000), ("1.5T", 1_500_000_000_000),
     ("350M", 350_000_000), ("125k", 125_000), ("6738415616", 6_738_415_616), ("1_000", 1000)],
)  # fmt: skip
def test_plan_takes_a_parameter_count_as_people_write_it(text: str, count: int) -> None:
    result = cli("plan", "--params", text, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model"]["n_params"] == count


def test_plan_prints_one_unit_per_column_and_counts_in_words() -> None:
    result = cli("plan", "--params", "7B")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].endswith("TP=1 PP=1 DP=1 on 1 GPU, 1 node"), lines[0]
    header = next(line for line in lines if line.startswith("tier "))
    for heading in ("write (GB/s)", "read (GB/s)", "save (s)", "restore (s)", "lost work (%)"):
        assert heading in header, header
    rows = lines[lines.index(header) + 1 : lines.index(header) + 4]
    for row in rows:  # units live in the headings: a cell is a number
        _, scope, *cells = row.replace("per node", "per-node").split()
        assert scope in ("per-node", "shared"), row
        assert all(cell.replace(".", "").isdigit() for cell in cells), row
    gpt3 = cli("plan", "--layers", "96", "--hidden", "12288", "--vocab", "50257", "--tp", "8", "--pp", "16", "--dp", "8")
    assert "on 1024 GPUs, 128 nodes" in gpt3.stdout and "async interval (min)" in gpt3.stdout, gpt3.stdout


# --------------------------------------------------------------------------------------- ls


def test_ls_without_credentials_names_the_bucket_the_prefix_and_where_it_looked(tmp_path: Path) -> None:
    """``tiercheck ls s3://no-such-bucket/run`` said ``listing /: NoCredentialsError``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    missing = str(tmp_path / "none")
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_SHARED_CREDENTIALS_FILE=missing, AWS_CONFIG_FILE=missing)
    secret = "AKIDNOTTOBESHOWN"
    for options in ([], ["-o", f"key={secret}"]):
        proc = subprocess.run(
            [sys.executable, "-m", "tiercheck", "--retry-deadline", "5", "ls", "s3://no-such-bucket/run", *options],
            capture_output=True, text=True, env=env, timeout=120, check=False,
        )  # fmt: skip
        assert proc.returncode == 1, proc.stderr
        [line] = proc.stderr.strip().splitlines()
        assert line.startswith(
            "tiercheck: error: s3://no-such-bucket/run: listing bucket 'no-such-bucket' prefix 'run': no credentials"
        ), line
        assert "AWS_ACCESS_KEY_ID" in line and "~/.aws/credentials" in line and "-o KEY=VALUE" in line, line
        assert ("key given" in line) == bool(options), line
        assert "AWS_CONFIG_FILE set" in line and secret not in line, line


# ----------------------------------------------------------------------------------- errors


def test_bad_arguments_raise_tiercheck_errors_that_keep_the_builtin_base(tmp_path: Path) -> None:
    """The README says every error derives from TiercheckError; ``save("epoch-3")`` raised a plain
    ValueError and ``local=`` a file a plain NotADirectoryError."""
    state = {"w": torch.zeros(2)}
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(NotADirectoryTierError, match="exists and is not a directory") as e:
        tiercheck.Checkpointer(state, local=afile)
    assert isinstance(e.value, NotADirectoryError) and isinstance(e.value, TiercheckError)
    with pytest.raises(UnsupportedValueError, match="must be a mapping") as t:
        tiercheck.Checkpointer([torch.zeros(2)], local=tmp_path / "ck")  # type: ignore[arg-type]
    assert isinstance(t.value, TypeError)
    for options in (lambda: tiercheck.RetentionOptions(keep_last=0), lambda: tiercheck.WriteOptions(io_threads=0)):
        with pytest.raises(InvalidArgumentError) as v:
            options()
        assert isinstance(v.value, ValueError)
    ck = tiercheck.Checkpointer(state, local=tmp_path / "ck")
    for step in ("epoch-3", -1, 3.0, True):
        with pytest.raises(InvalidArgumentError, match="step must be a non-negative int") as s:
            ck.save(step)  # type: ignore[arg-type]
        assert isinstance(s.value, ValueError)
    with pytest.raises(InvalidArgumentError, match="no remote tier"):
        ck.drain()
    ck.close()
    with pytest.raises(ClosedError, match="closed") as c:
        ck.save(1)
    assert isinstance(c.value, RuntimeError)
    with pytest.raises(InvalidArgumentError, match="does not fit"):
        tiercheck.Shard(torch.zeros(2), global_shape=(2,), offsets=(1,))


# ---------------------------------------------------------------------------------- inspect


class Opaque:
    """A value only pickle stores."""


def test_inspect_shows_the_plain_values_and_never_unpickles(tmp_path: Path) -> None:
    """``inspect`` listed tensors and metadata only: a progress dict or the learning rate saved
    in the state did not show, even with --json."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()  # momentum buffers: the optimizer's state holds tensors, its param_groups plain values
    state = {"model": model, "optim": opt, "progress": {"epoch": 3, "batch": 120, "loss": float("nan")},
             "lr": 1e-3, "betas": (0.9, 0.999), "ids": {0: "a"}, "opaque": Opaque()}  # fmt: skip
    with tiercheck.Checkpointer(state, local=tmp_path / "ck", allow_pickle=True) as ck:
        ck.save(7)
    result = cli("inspect", str(tmp_path / "ck"))
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "this tier holds the files of rank 0" in text and "1 rank on 1 node" in text, text
    for line in ("progress = {'epoch': 3, 'batch': 120, 'loss': nan}", "lr = 0.001", "betas = (0.9, 0.999)",
                 "ids = {0: 'a'}", "opaque = <a pickled object: not unpickled>", "optim/param_groups = [{'lr': 0.5"):
        assert f"    {line}" in text, (line, text)  # fmt: skip
    doc = json.loads(cli("inspect", str(tmp_path / "ck"), "--json").stdout)
    assert doc["values_of_rank"] == 0
    values = doc["values"]
    assert values["progress"] == {"epoch": 3, "batch": 120, "loss": {"$float": "nan"}}
    assert values["lr"] == 1e-3 and values["betas"] == {"$tuple": [0.9, 0.999]}
    assert list(values["opaque"]) == ["$pickle"]  # as stored: never unpickled
    assert not any(path.startswith("model") for path in values)  # tensors are in "arrays"


# ------------------------------------------------------------------------- scripts and examples

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script", ["demo_deepspeed.sh", "demo_megatron.sh"])
def test_framework_demos_install_the_cpu_build_of_torch(script: str) -> None:
    """They installed plain ``torch==2.13.0``: on Linux, PyPI's CUDA build (~2.5 GB of wheels)."""
    text = (ROOT / "scripts" / script).read_text()
    pip_lines = [line for line in text.splitlines() if "pip install" in line]
    assert pip_lines and not any("torch==" in line for line in pip_lines), pip_lines
    assert "install_cpu_torch &&" in text
    lib = (ROOT / "scripts" / "demo_lib.sh").read_text()
    assert '"torch==2.13.0+cpu" ||' in lib and "--extra-index-url https://download.pytorch.org/whl/cpu" in lib


def test_test_sh_keeps_setup_output_in_a_log_it_names_when_a_step_fails(tmp_path: Path) -> None:
    """scripts/test.sh printed pip's output (125 lines of index warnings on a machine with extra indexes)."""
    text = (ROOT / "scripts" / "test.sh").read_text()
    for line in text.splitlines():
        if "pip install" in line and not line.lstrip().startswith("#"):
            assert "quietly" in line or '>>"$setup_log"' in line or line.lstrip().startswith("pip_install()"), line
    helpers = text[text.index("setup_log=") : text.index("pip_install()")]
    snippet = helpers + 'quietly echo "a quiet step"\nquietly sh -c "echo WARNING: index; echo ERROR: it broke >&2; exit 3"\n'
    proc = subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + snippet], capture_output=True, text=True, env={**os.environ,
        "TMPDIR": str(tmp_path)}, check=False,
    )  # fmt: skip
    assert proc.returncode == 1 and proc.stdout == "", proc
    [log] = tmp_path.glob("tiercheck-setup.*.log")  # kept, and named
    assert "a quiet step" in log.read_text() and "ERROR: it broke" in proc.stderr
    assert f"its whole output, and the earlier steps': {log}" in proc.stderr


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
