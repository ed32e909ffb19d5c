"""The ``tiercheck`` command against a local directory and the real S3 server, run in-process (``tests/cli.py``)
except where the process is the point: ``python -m tiercheck``, a copy killed with SIGKILL, imports."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tests.cli import run, s3_args
from tests.conftest import assert_identical, seeded_tensors
from tests.ondisk import flip_chunk_byte
from tests.servers import SeaweedS3
from tiercheck.format.paths import step_dir
from tiercheck.format.steps import list_steps
from tiercheck.tiers.remote import open_tier


def make_state(seed: int) -> dict[str, Any]:
    return {"model": seeded_tensors(seed, {f"layer{i}": (128, 96) for i in range(8)}), "step": seed}


def save_steps(local: Path, steps: list[int], remote: str | None = None, **kw: Any) -> None:
    state = make_state(0)
    retention = tiercheck.RetentionOptions(keep_last=None)
    with tiercheck.Checkpointer(state, local=local, remote=remote, retention=retention, **kw) as ck:
        for s in steps:
            state.update(make_state(s))
            ck.save(s, metadata={"loss": s / 10})


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    local = tmp_path / "local"
    save_steps(local, [10, 20, 30])
    return local


def test_help_lists_every_subcommand() -> None:
    # ``python -m tiercheck``, in a process of its own, is this same command (under the name it was called by)
    done = subprocess.run([sys.executable, "-m", "tiercheck", "--help"], capture_output=True, text=True, check=False)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith("Usage: python -m tiercheck [OPTIONS] COMMAND [ARGS]...")
    for text in (run("--help").stdout, done.stdout):
        for sub in ("ls", "inspect", "verify", "restore", "drain", "gc", "plan"):
            assert f"  {sub} " in text, sub
    assert "Pre-stage" in run("restore", "--help").stdout


def test_ls_and_inspect_a_local_directory(saved: Path) -> None:
    listing = json.loads(run("ls", str(saved), "--json").stdout)
    assert [s["step"] for s in listing["steps"]] == [10, 20, 30]
    assert all(s["tiers"][str(saved)]["status"] == "committed" for s in listing["steps"])
    doc = json.loads(run("inspect", str(saved), "--step", "20", "--json").stdout)
    assert doc["step"] == 20 and doc["metadata"] == {"loss": 2.0}
    assert {a["path"]: a["shape"] for a in doc["arrays"]} == {f"model/layer{i}": [128, 96] for i in range(8)}
    assert doc["bytes"] == 8 * 128 * 96 * 4
    table = run("ls", str(saved)).stdout
    assert "committed" in table and "384.0 KiB" in table
    assert "committed: COMMIT, manifest and pack sizes agree (`tiercheck verify` re-reads every chunk)" in table


def test_verify_catches_a_flipped_byte_and_names_the_array(saved: Path) -> None:
    assert run("verify", str(saved), "--all").stdout.startswith("ok: steps 10, 20, 30 intact")
    flip_chunk_byte(saved / step_dir(20), "model/layer3", "c.0.0", 100)
    proc = run("verify", str(saved), "--all", check=False)
    assert proc.returncode == 1
    assert "damaged: step 20: array 'model/layer3' chunk c.0" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"tiercheck: error: 1 damaged chunk in step 20 of {saved}"
    assert proc.stdout.strip() == "intact: steps 10, 30"
    assert run("verify", str(saved), "--step", "30").stdout.startswith("ok: step 30 intact")


def test_verify_a_broken_manifest_says_the_manifest(saved: Path) -> None:
    """A damaged manifest.json is named once, as a damaged manifest, not as "1 damaged chunk(s)", with the tier
    and step said once (they were twice: "step 20: DIR: step 20: manifest.json is damaged")."""
    (saved / step_dir(20) / "manifest.json").write_text("{broken")
    proc = run("verify", str(saved), "--step", "20", check=False)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("damaged: step 20: manifest.json is damaged"), lines
    assert lines[0].count("step 20") == 1 and str(saved) not in lines[0]
    assert lines[-1] == f"tiercheck: error: 1 damaged manifest in step 20 of {saved}"


def test_cli_usage_edges() -> None:
    """No arguments show the help (exit 0); ``verify --step N --all`` and ``--threads 0`` are refused; ``size``
    points to ``plan``; a parameter count below a billion is not "0.00 B"."""
    proc = run(check=False)
    assert proc.returncode == 0 and proc.stdout.startswith("Usage:") and "Commands:" in proc.stdout
    assert proc.stderr == ""
    for args, message in (
        (["verify", "DIR", "--step", "3", "--all"], "--step and --all exclude each other"),
        (["verify", "DIR", "--threads", "0"], "'--threads': 0 is not in the range 1<=x<=1024"),
        (["restore", "DIR", "--to", "X", "--threads", "0"], "'--threads': 0 is not in the range"),
        (["drain", "DIR", "--to", "X", "--threads", "0"], "'--threads': 0 is not in the range"),
        (["size"], "No such command 'size'. Did you mean 'plan'?"),
    ):
        proc = run(*args, check=False)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)
    text = run("plan", "--params", "1234567").stdout
    assert text.startswith("model: 1.23 million parameters,") and "checkpoint: 16.5 MiB in all" in text, text


def test_ls_shows_a_truncated_pack_as_damaged(saved: Path) -> None:
    """A pack cut short (here to 100 bytes) made no difference to ``ls``, which said "committed" from the
    marker alone; it now compares each pack's size with where its chunks end (one listing, no chunk read)."""
    os.truncate(saved / step_dir(20) / "packs" / "rank-000000.bin", 100)
    proc = run("ls", str(saved))
    rows = {line.split()[0]: line.split()[1] for line in proc.stdout.splitlines()[1:4]}
    assert rows == {"10": "committed", "20": "damaged", "30": "committed"}, proc.stdout
    assert "damaged: " in proc.stderr and "packs/rank-000000.bin holds 100 bytes, its chunks end at byte" in proc.stderr
    steps = {s["step"]: s["tiers"][str(saved)]["status"] for s in json.loads(run("ls", str(saved), "--json").stdout)["steps"]}
    assert steps == {10: "committed", 20: "damaged", 30: "committed"}


def test_inspect_sorts_numbered_names_by_number(tmp_path: Path) -> None:
    state = {"optim": {"state": {i: torch.zeros(2) for i in range(12)}}}
    with tiercheck.Checkpointer(state, local=tmp_path) as ck:
        ck.save(1)
    doc = json.loads(run("inspect", str(tmp_path), "--json").stdout)
    assert [a["path"] for a in doc["arrays"]] == [f"optim/state/{i}" for i in range(12)]
    text = run("inspect", str(tmp_path)).stdout
    assert text.index("optim/state/2 ") < text.index("optim/state/10 ")


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
    result = run("inspect", str(tmp_path / "ck"))
    assert result.returncode == 0, result.stdout + result.stderr
    text = result.stdout
    assert "this tier holds the files of rank 0" in text and "1 rank on 1 node" in text, text
    for line in ("progress = {'epoch': 3, 'batch': 120, 'loss': nan}", "lr = 0.001", "betas = (0.9, 0.999)",
                 "ids = {0: 'a'}", "opaque = <a pickled object: not unpickled>", "optim/param_groups = [{'lr': 0.5"):
        assert f"    {line}" in text, (line, text)  # fmt: skip
    doc = json.loads(run("inspect", str(tmp_path / "ck"), "--json").stdout)
    assert doc["values_of_rank"] == 0
    values = doc["values"]
    assert values["progress"] == {"epoch": 3, "batch": 120, "loss": {"$float": "nan"}}
    assert values["lr"] == 1e-3 and values["betas"] == {"$tuple": [0.9, 0.999]}
    assert list(values["opaque"]) == ["$pickle"]  # as stored: never unpickled
    assert not any(path.startswith("model") for path in values)  # tensors are in "arrays"


def test_gc_dry_run_changes_nothing_and_gc_keeps_the_newest(saved: Path) -> None:
    before = sorted(p.relative_to(saved) for p in saved.rglob("*"))
    text = run("gc", str(saved), "--keep-last", "1", "--dry-run").stdout
    assert "would remove committed step 10" in text and "would remove committed step 20" in text
    assert sorted(p.relative_to(saved) for p in saved.rglob("*")) == before
    (saved / step_dir(5)).mkdir()  # an abandoned partial step, older than the newest committed one
    run("gc", str(saved), "--keep-last", "1", "--grace-hours", "0")
    assert list_steps(open_tier(str(saved))).committed == [30]
    assert not (saved / step_dir(5)).exists()
    assert_identical(tiercheck.load(saved), make_state(30))


def test_gc_refuses_a_directory_a_live_job_holds(saved: Path) -> None:
    """As restore and persist do: a running job's Checkpointer holds the directory's lock, and gc deletes nothing
    under it (it once withdrew steps 10 and 20 while the job ran)."""
    with tiercheck.Checkpointer(make_state(0), local=saved):
        proc = run("gc", str(saved), "--keep-last", "1", check=False)
    assert proc.returncode == 1 and "in use by another tiercheck writer" in proc.stderr, proc.stderr
    assert "removed" not in proc.stdout
    assert list_steps(open_tier(str(saved))).committed == [10, 20, 30]
    assert "removed committed step 10" in run("gc", str(saved), "--keep-last", "1").stdout  # the job has ended


def test_gc_of_a_directory_that_is_no_checkpoint_is_an_error(tmp_path: Path) -> None:
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("x")
    proc = run("gc", str(other), "--keep-last", "1", check=False)
    assert proc.returncode == 1, proc
    assert f"{other} is not a checkpoint directory (it holds todo.txt): nothing removed" in proc.stderr, proc.stderr
    assert sorted(p.name for p in other.iterdir()) == ["todo.txt"], "not even a lock file is left there"
    empty = tmp_path / "empty"  # a new run's directory, nothing in it yet: nothing to do, no error
    empty.mkdir()
    assert "kept committed step(s): none" in run("gc", str(empty), "--keep-last", "1").stdout


def test_ls_of_two_lineages_warns(saved: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    save_steps(other, [10])  # another run: its own lineage, and a step 10 of its own
    proc = run("ls", str(saved), str(other))
    assert "warning: the locations belong to different lineages" in proc.stderr, proc.stderr
    assert str(saved) in proc.stderr and str(other) in proc.stderr
    assert "10" in proc.stdout, "still listed"
    copy = tmp_path / "copy"
    run("restore", str(saved), "--to", str(copy))  # the same lineage: no warning
    assert run("ls", str(saved), str(copy)).stderr == ""


def test_plan_without_a_model_is_a_usage_error() -> None:
    proc = run("plan", check=False)
    assert proc.returncode == 2, proc
    assert "give --params, or --layers, --hidden and --vocab" in proc.stderr, proc.stderr
    assert run("plan", "--layers", "4", check=False).returncode == 2


def test_gc_deletes_only_steps_under_their_own_name(saved: Path) -> None:
    """Aliases of step 30 (``step-000000030`` half-written, ``step-000000040`` a committed copy)
    once made gc keep "step 40" and delete step 30 twice over: every real step gone."""
    half, copy = saved / "step-000000030", saved / "step-000000040"
    half.mkdir()
    (half / "stray").write_bytes(b"x")
    shutil.copytree(saved / step_dir(30), copy)
    proc = run("gc", str(saved), "--keep-last", "1", "--grace-hours", "0")
    assert "removed committed step 10" in proc.stdout and "removed committed step 20" in proc.stdout
    assert "committed step 30" not in proc.stdout and "partial step 30" not in proc.stdout
    assert "kept committed step(s): 30" in proc.stdout
    assert "step-000000030" in proc.stderr and "step-000000040" in proc.stderr
    assert list_steps(open_tier(str(saved))).committed == [30]
    assert (half / "stray").exists() and (copy / "COMMIT").exists()
    assert_identical(tiercheck.load(saved), make_state(30))


@pytest.mark.parametrize("damage", ["garbage COMMIT", "rotted pack"])
def test_gc_keeps_the_newest_whole_step_when_the_newest_step_is_damaged(saved: Path, damage: str) -> None:
    """``--keep-last 1`` with step 30 damaged once deleted steps 10 and 20 and kept 30: nothing
    was left to restore. A damaged step does not count toward keep-last, and is kept."""
    if damage == "garbage COMMIT":
        (saved / step_dir(30) / "COMMIT").write_bytes(b"{not json")
    else:
        flip_chunk_byte(saved / step_dir(30), "model/layer3", "c.0.0", 100)
    proc = run("gc", str(saved), "--keep-last", "1")
    assert "removed committed step 10" in proc.stdout and "step 20" not in proc.stdout
    assert "damaged: step 30: " in proc.stderr and "not counted toward --keep-last" in proc.stderr
    assert sorted(p.name for p in saved.glob("step-*")) == [step_dir(20), step_dir(30)]
    state = make_state(0)
    with tiercheck.Checkpointer(state, local=saved) as ck:
        assert ck.restore() == 20
    assert_identical(state, make_state(20))


def test_a_committed_copy_under_another_name_is_no_step(saved: Path, caplog: pytest.LogCaptureFixture) -> None:
    alias = saved / "step-000000040"
    shutil.copytree(saved / step_dir(20), alias)
    proc = run("ls", str(saved), "--json")
    assert [s["step"] for s in json.loads(proc.stdout)["steps"]] == [10, 20, 30]
    assert "ignoring step-000000040" in proc.stderr
    caplog.clear()  # the command ran in this process: what follows is the library's own warning, not its echo
    state = make_state(0)
    with tiercheck.Checkpointer(state, local=saved) as ck:
        assert ck.steps() == [10, 20, 30] and ck.restore() == 30
    assert_identical(state, make_state(30))
    assert any(r.levelname == "WARNING" and "step-000000040" in r.getMessage() for r in caplog.records)
    assert (alias / "COMMIT").exists()


def test_bad_input_gives_one_line_and_a_nonzero_exit(tmp_path: Path, saved: Path) -> None:
    cases = [
        (["ls", "s3x://bucket/x"], "s3x://bucket/x: no s3x:// here; tiercheck stores checkpoints in a local directory"),
        (["inspect", str(saved), "--step", "7"], "step 7 is not committed"),
        (["ls", str(tmp_path / "nope")], "no such directory"),
        (["restore", str(tmp_path / "nope"), "--to", str(tmp_path / "x")], "no such directory"),
    ]
    for args, message in cases:
        proc = run(*args, check=False)
        assert proc.returncode == 1, args
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("tiercheck: error: "), proc.stderr
        assert message in proc.stderr


def test_restore_prestages_from_s3_and_the_job_then_reads_locally(
    tmp_path: Path, s3_server: SeaweedS3, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/run"
    save_steps(tmp_path / "old-node", [1, 2], remote=url, remote_options=s3_server.storage_options())
    listing = json.loads(run(*s3_args(s3_server), "ls", url, "--json").stdout)
    assert [s["step"] for s in listing["steps"]] == [1, 2]
    new_node = tmp_path / "new-node"
    text = run(*s3_args(s3_server), "restore", url, "--to", str(new_node), "--verify").stdout
    assert "restored step 2" in text and "0 already there" in text and "ok: step 2 intact" in text
    state = make_state(0)
    with tiercheck.Checkpointer(state, local=new_node, remote=url, remote_options=s3_server.storage_options()) as ck:
        assert ck.restore() == 2
        assert ck.stats()["restore_remote_reads"] == 0
    assert_identical(state, make_state(2))


# A ``tiercheck restore`` whose copy into a local directory stops, for good, at a given point: once the
# pack's stream has yielded its first piece (its temporary is on disk, the pack is not), or once the pack is
# whole (renamed into place) and before the step is committed. It says so on stdout, and is killed there.
_HELD_COPY = """
import sys, threading
from tiercheck.cli import main
from tiercheck.tiers.local import LocalTier

write_stream = LocalTier.write_stream

def hold(what):
    print(what, flush=True)
    threading.Event().wait()

def held_write_stream(self, path, pieces, *, size=None):
    if "/packs/" not in path:
        return write_stream(self, path, pieces, size=size)
    if sys.argv[1] == "half-written pack":
        def first_then_hold():
            for piece in pieces():
                yield piece
                hold("held")
        return write_stream(self, path, first_then_hold, size=size)
    write_stream(self, path, pieces, size=size)
    hold("held")

LocalTier.write_stream = held_write_stream
main(sys.argv[2:], prog_name="tiercheck")
"""


@pytest.mark.parametrize(("cut", "kept"), [("half-written pack", 0), ("whole pack", 1)])
def test_an_interrupted_restore_resumes(
    tmp_path: Path, s3_server: SeaweedS3, s3_bucket: str, cut: str, kept: int
) -> None:
    """Killed with SIGKILL mid-copy, the step is not committed; run again, the copy finishes bit-identical, keeping
    a whole pack the kill left (read back and checked) and never a half-written one, whose temporary goes."""
    url = f"s3://{s3_bucket}/run"
    save_steps(tmp_path / "old-node", [1], remote=url, remote_options=s3_server.storage_options())
    new_node = tmp_path / "new-node"
    restore = [*s3_args(s3_server), "restore", url, "--to", str(new_node), "--threads", "1"]
    with subprocess.Popen([sys.executable, "-c", _HELD_COPY, cut, *restore], stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == "held\n", "the copy ended before the point it was to be held at"
            packs = new_node / step_dir(1) / "packs"
            assert list_steps(open_tier(str(new_node))).committed == []  # incomplete: not committed
            assert list_steps(open_tier(str(new_node))).partial == [1]
            assert (packs / "rank-000000.bin").exists() == (cut == "whole pack")
            assert bool(list(packs.glob(".rank-000000.bin.tmp-*"))) == (cut == "half-written pack")
        finally:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    text = run(*restore).stdout
    assert "restored step 1" in text
    already = re.search(r" files copied \([^)]*\), (\d+) already there", text)
    assert already is not None and already[1] == str(kept), text
    assert not list(new_node.rglob(".*.tmp-*"))  # the killed copy's temporary is gone
    assert_identical(tiercheck.load(new_node), make_state(1))


def test_drain_finishes_what_a_job_left_and_restore_of_a_node_share(
    tmp_path: Path, s3_server: SeaweedS3, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/run"
    local = tmp_path / "local"
    save_steps(local, [1, 2])  # the job ended before any drain
    text = run(*s3_args(s3_server), "drain", str(local), "--to", url).stdout
    assert "step 1 -> " in text and "step 2 -> " in text and text.count("committed") == 2
    assert "nothing to drain" in run(*s3_args(s3_server), "drain", str(local), "--to", url).stdout
    opts = s3_server.storage_options()
    assert list_steps(open_tier(url, storage_options=opts)).committed == [1, 2]
    assert_identical(tiercheck.load(url, storage_options=opts), make_state(2))
    # --ranks: only the files rank 0 wrote (all of them here: one rank saved this step).
    share = tmp_path / "share"
    run(*s3_args(s3_server), "restore", url, "--to", str(share), "--ranks", "0")
    marker = json.loads((share / step_dir(2) / "COMMIT").read_text())
    assert marker["ranks"] == [0]
    proc = run(*s3_args(s3_server), "restore", url, "--to", str(share), "--ranks", "0-3", check=False)
    assert proc.returncode == 1 and "saved by ranks 0-0" in proc.stderr
    proc = run(*s3_args(s3_server), "restore", url, "--to", str(share), "--ranks", "0-99999999999", check=False)
    assert proc.returncode == 1 and "asked for 0-99999999999" in proc.stderr  # refused, no giant set built
    proc = run(*s3_args(s3_server), "restore", url, "--to", str(tmp_path / "other"), "--ranks", "5-1", check=False)
    assert proc.returncode == 2 and "5-1 is an empty range of ranks" in proc.stderr
    assert not (tmp_path / "other" / step_dir(2) / "COMMIT").exists()


def test_unreachable_server_and_wrong_credentials_fail_with_one_line(
    tmp_path: Path, s3_server: SeaweedS3, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/run"
    wrong = ["-o", f"endpoint_url={s3_server.endpoint_url}", "-o", f"key={s3_server.key}", "-o", "secret=nope"]
    proc = run(*wrong, "ls", url, check=False)
    assert proc.returncode == 1 and "access denied" in proc.stderr and "nope" not in proc.stderr
    closed = ["-o", "endpoint_url=http://127.0.0.1:9", "-o", "key=k", "-o", "secret=s"]
    proc = run("--retry-deadline", "2", *closed, "ls", url, check=False)
    assert proc.returncode == 1 and "gave up after" in proc.stderr
    *retries, last = proc.stderr.strip().splitlines()  # each retry said aloud, then the one-line error
    assert last.startswith("tiercheck: error: ") and "gave up after" in last
    assert retries and all(line.startswith("WARNING: ") and "retrying in" in line for line in retries), retries


def test_plan_sizes_gpt3_and_a_7b_model_by_hand(tmp_path: Path) -> None:
    gpt3 = json.loads(
        run("plan", "--layers", "96", "--hidden", "12288", "--vocab", "50257", "--tp", "8", "--pp", "16", "--dp", "8",
            "--json").stdout
    )  # fmt: skip
    # 12*L*h^2 + 13*L*h + V*h = 12*96*12288^2 + 13*96*12288 + 50257*12288 = 174,579,068,928
    assert gpt3["model"]["n_params"] == 174_579_068_928
    assert gpt3["sizes"]["weights_bytes"] == 2 * 174_579_068_928  # ~350 GB of bf16 weights
    assert gpt3["sizes"]["total_bytes"] == 14 * 174_579_068_928  # + 12 B/param of Adam: ~2.4 TB
    assert gpt3["sizes"]["ranks"] == 1024 and gpt3["sizes"]["nodes"] == 128
    assert gpt3["sizes"]["per_rank_bytes"] == 14 * 174_579_068_928 // 1024  # 2,386,823,208 B
    # 7e9 params, DP=8 on one node, a local tier of 2 GB/s write per node: 98 GB per node / 2 GB/s = 49 s.
    small = json.loads(run("plan", "--params", "7e9", "--dp", "8", "--tier", "nvme:2:4:node", "--json").stdout)
    [row] = small["tiers"]
    assert small["sizes"]["total_bytes"] == 98_000_000_000 and small["sizes"]["per_node_bytes"] == 98_000_000_000
    assert row["save_s"] == pytest.approx(49.0) and row["restore_s"] == pytest.approx(24.5)
    measured = json.loads(run("plan", "--params", "1e9", "--measure", str(tmp_path), "--json").stdout)
    assert measured["tiers"][0]["tier"]["write_bytes_per_s"] > 0
    assert list(tmp_path.iterdir()) == []  # the measurement cleaned up after itself
    table = run("plan", "--params", "7e9", "--dp", "8").stdout
    assert "Daly interval (h)" in table and "typical figures" in table


_NO_TORCH = """
import sys
from click.testing import CliRunner
from tiercheck.cli import main
runs = [["--help"], ["ls", sys.argv[1]], ["inspect", sys.argv[1]], ["verify", sys.argv[1]], ["plan", "--params", "7e9"]]
for args in runs:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, (args, result.output)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_commands_that_need_no_tensors_do_not_import_torch(saved: Path) -> None:
    """`import torch` takes seconds; --help, ls, inspect, verify and plan answer without it."""
    done = subprocess.run([sys.executable, "-c", _NO_TORCH, str(saved)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_refused_restore_leaves_no_target_behind(tmp_path: Path, saved: Path) -> None:
    target = tmp_path / "never"
    proc = run("restore", str(saved), "--to", str(target), "--step", "999", check=False)
    assert proc.returncode != 0 and "999" in proc.stderr, proc.stderr
    assert not target.exists()


def test_verify_and_restore_follow_no_symlink_out_of_the_checkpoint(tmp_path: Path, saved: Path) -> None:
    pack = saved / step_dir(20) / "packs" / "rank-000000.bin"
    outside = tmp_path / "outside.bin"
    pack.rename(outside)
    pack.symlink_to(outside)
    symlink = f"{pack} is a symbolic link"
    proc = run("verify", str(saved), "--step", "20", check=False)
    assert proc.returncode == 1, proc.stderr
    assert f"damaged: step 20: array 'model/layer0' chunk c.0.0: {symlink}" in proc.stderr, proc.stderr
    target = tmp_path / "target"
    proc = run("restore", str(saved), "--to", str(target), "--step", "20", check=False)
    assert proc.returncode != 0 and symlink in proc.stderr, proc.stderr
    assert not (target / step_dir(20) / "COMMIT").exists()


@pytest.mark.parametrize("damage", ["missing pack", "flipped byte", "truncated pack"])
def test_restore_to_commits_no_copy_with_a_missing_or_damaged_source_chunk(
    tmp_path: Path, saved: Path, damage: str
) -> None:
    step = saved / step_dir(30)
    pack = step / "packs" / "rank-000000.bin"
    if damage == "missing pack":
        pack.unlink()
    elif damage == "flipped byte":
        flip_chunk_byte(step, "model/layer3", "c.0.0", 17)
    else:
        pack.write_bytes(pack.read_bytes()[:-100])
    target = tmp_path / "node"
    proc = run("restore", str(saved), "--to", str(target), "--step", "30", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    said = {"missing pack": "step 30: the packs of saving ranks [0] are missing", "flipped byte": "checksum mismatch"}
    assert "step-00000030/packs/rank-000000.bin" in proc.stderr or "step 30" in proc.stderr, proc.stderr
    assert said.get(damage, "(truncated)") in proc.stderr, proc.stderr
    assert list_steps(open_tier(str(target))).committed == []  # nothing incomplete is committed


@pytest.mark.parametrize(
    ("flip", "said"),
    [
        ('"step":30', "its tiercheck.step is 31, not this step (30)"),  # the map names another step
        ('\\"data_type\\": \\"float32', "data_type 'float33'"),  # a document contradicts its array's record
        ('\\"chunk_shape\\": [\\n        128', "chunk_shape [129, 96]"),
    ],
)
def test_restore_to_commits_no_copy_whose_reference_map_load_would_refuse(
    tmp_path: Path, saved: Path, flip: str, said: str
) -> None:
    """One flipped byte in a reference map that leaves it valid JSON naming the step's save: ``load`` refuses the
    step, so the copy must refuse it too, before it commits anything."""
    refs = saved / step_dir(30) / "refs" / "rank-000000.json"
    data = bytearray(refs.read_bytes())
    at = data.index(flip.encode()) + len(flip) - 1
    data[at] ^= 0x01  # one bit: 0 -> 1, 2 -> 3, 8 -> 9
    refs.write_bytes(bytes(data))
    with pytest.raises(tiercheck.CorruptCheckpointError, match=re.escape(said)):
        tiercheck.load(saved, 30)  # the damage is one load refuses
    target = tmp_path / "node"
    proc = run("restore", str(saved), "--to", str(target), "--step", "30", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "refs/rank-000000.json" in proc.stderr and said in proc.stderr, proc.stderr
    assert list_steps(open_tier(str(target))).committed == []


def test_verify_a_hostile_reference_map_names_the_map_not_the_chunks(saved: Path) -> None:
    """Two entries of a reference map swapped (each points at the other chunk's range): the chunks are
    intact, the map is what is damaged, and the summary says so."""
    refs = saved / step_dir(20) / "refs" / "rank-000000.json"
    doc = json.loads(refs.read_text())
    keys = [k for k, v in doc["refs"].items() if isinstance(v, list)][:2]
    doc["refs"][keys[0]], doc["refs"][keys[1]] = doc["refs"][keys[1]], doc["refs"][keys[0]]
    refs.write_text(json.dumps(doc))
    proc = run("verify", str(saved), "--step", "20", check=False)
    assert proc.returncode == 1
    last = " ".join(proc.stderr.split()).rsplit("tiercheck: error: ", 1)[-1]
    assert last == f"1 damaged reference map in step 20 of {saved}", proc.stderr
    assert proc.stderr.count("damaged: step 20: refs/rank-000000.json:") == 2  # each entry named
