"""What a new user meets first: messages, logging they see without configuring any, options where
the README puts them, the RNG state saved right, and the object stores as optional extras.

The ``tiercheck`` command runs in-process (``tests/cli.py``), and as a subprocess where the process is the
point: logging left unconfigured, a client module blocked from import, no torch imported, stderr a terminal.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import tiercheck
from tests.cli import Ran, run, s3_args
from tests.servers import SeaweedS3
from tiercheck.errors import (
    ClosedError,
    InvalidArgumentError,
    NotADirectoryTierError,
    RemoteStorageError,
    TiercheckError,
    UnsupportedValueError,
)
from tiercheck.format.paths import step_dir
from tiercheck.tiers.remote import RemoteTier


def tiercheck_cli(*args: str) -> Ran:
    return run(*args, check=False)


def closed_port() -> int:
    """A loopback port nothing listens on: connections to it are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    local = tmp_path / "local"
    with tiercheck.Checkpointer({"w": torch.arange(6.0)}, local=local) as ck:
        ck.save(5).wait()
    return local


# ------------------------------------------------------------------ messages for wrong input


def test_paths_of_the_wrong_kind_are_named_as_such(tmp_path: Path, saved: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [
        (["ls", str(a_file)], f"tiercheck: error: not a directory: {a_file} is a file; give a checkpoint directory"),
        (["inspect", str(a_file)], f"tiercheck: error: not a directory: {a_file} is a file"),
        # was a raw "[Errno 17]" / "[Errno 20] Not a directory"
        (["restore", str(saved), "--to", str(a_file)], f"tiercheck: error: not a directory: {a_file} is a file"),
        # a step's own directory: the hint names its parent (was "no steps in ...", exit 0)
        (
            ["ls", str(saved / step_dir(5))],
            f"tiercheck: error: {saved / step_dir(5)} is the directory of one step; "
            f"give the checkpoint directory that holds it: {saved}",
        ),
        (["inspect", str(saved / step_dir(5))], "give the checkpoint directory that holds it"),
        # one slash: fsspec lists nothing there, and ls said "no steps" with exit status 0
        (["ls", "s3:/bucket/run"], "tiercheck: error: s3:/bucket/run: not a URL fsspec can list; write s3://bucket/"),
        (["ls", "s3:bucket"], "write s3://bucket/prefix (two slashes)"),
    ]
    for args, message in cases:
        proc = tiercheck_cli(*args)
        assert proc.returncode == 1, (args, proc.stdout, proc.stderr)
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("tiercheck: error: "), (args, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)
    assert a_file.read_text() == "x"


_WHAT_WORKS = (
    "tiercheck stores checkpoints in a local directory, file://PATH, s3://BUCKET/PREFIX, az://CONTAINER/PREFIX "
    "or abfs://CONTAINER/PREFIX"
)


@pytest.mark.parametrize(
    "url", ["http://example.com/ckpt", "ftp://example.com/ckpt", "hdfs://namenode/ckpt", "gs://bucket/ckpt", "run:1/x"]
)
def test_a_url_of_a_scheme_tiercheck_does_not_store_in_names_those_that_work(url: str) -> None:
    """``http://`` retried a DNS failure for 2 minutes, ``ftp://`` said only ``Name or service not known``,
    ``hdfs://`` ``No module named 'pyarrow'``, ``gs://`` to install gcsfs: at once, which schemes work."""
    proc = tiercheck_cli("--retry-deadline", "60", "inspect", url)
    assert proc.returncode == 1, proc.stderr
    scheme = url.split(":", 1)[0]
    assert proc.stderr == f"tiercheck: error: {url}: no {scheme}:// here; {_WHAT_WORKS}\n" or (
        ":" in url and "://" not in url and _WHAT_WORKS in proc.stderr and f"./{url}" in proc.stderr
    ), proc.stderr


def test_an_upper_case_scheme_is_the_same_scheme(s3_server: SeaweedS3, s3_bucket: str, tmp_path: Path) -> None:
    """``S3://`` said ``Protocol not known: S3`` and a paragraph about AWS credentials: schemes are case-insensitive."""
    url = f"s3://{s3_bucket}/run"
    with tiercheck.Checkpointer({"w": torch.arange(4.0)}, local=tmp_path / "l", remote=url,
                                remote_options=s3_server.storage_options()) as ck:  # fmt: skip
        ck.save(3).wait()
        ck.drain()
    proc = tiercheck_cli("ls", "--json", f"S3://{s3_bucket}/run", *s3_args(s3_server))
    assert proc.returncode == 0, proc.stderr
    assert [s["step"] for s in json.loads(proc.stdout)["steps"]] == [3]


def test_a_checkpointer_refuses_an_unsupported_remote_before_it_creates_its_directory(tmp_path: Path) -> None:
    local = tmp_path / "never"
    with pytest.raises(InvalidArgumentError, match=re.escape(f"gs://bucket/run: no gs:// here; {_WHAT_WORKS}")):
        tiercheck.Checkpointer({"w": torch.zeros(2)}, local=local, remote="gs://bucket/run")
    assert not local.exists()


def test_a_host_name_that_does_not_resolve_is_not_retried(tmp_path: Path) -> None:
    """A DNS failure (no such name: ``.invalid`` never resolves) is the same answer next time: one attempt, and
    the message says the name does not resolve."""
    proc = tiercheck_cli(
        "--retry-deadline", "120", "ls", "s3://bucket/run", "-o", "endpoint_url=http://no-such-host.invalid:9000",
        "-o", "key=k", "-o", "secret=s",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    [line] = proc.stderr.strip().splitlines()  # no retry warnings
    assert line.startswith("tiercheck: error: s3://bucket/run: listing bucket 'bucket' prefix 'run': "), line
    assert "host name 'no-such-host.invalid' does not resolve" in line, line


def test_bad_option_values_get_one_line(saved: Path) -> None:
    cases = [
        (
            ["--retry-deadline", "-1", "ls", str(saved)],
            "Invalid value for '--retry-deadline': expected a finite number above 0, got -1.0",
        ),
        (
            ["--retry-deadline", "nan", "ls", str(saved)],
            "'--retry-deadline': expected a finite number above 0, got nan",
        ),
        (["plan", "--params", "1e400"], "Invalid value for '--params': expected a parameter count from 1 to 1e16, got 1e400"),
        (["plan", "--params", "nan"], "'--params': expected a parameter count such as 7B, 70e9 or 1.5T, got 'nan'"),
        (["plan", "--params", "1e300"], "'--params': expected a parameter count from 1 to 1e16, got 1e300"),
        (["verify", str(saved), "--step", "-5"], "Invalid value for '--step': a step is a non-negative number, got -5"),
        (["inspect", str(saved), "--step", "x"], "'--step': expected a step number or 'latest', got 'x'"),
        (
            ["plan", "--params", "7e9", "--node-mtbf-hours", "0"],
            "'--node-mtbf-hours': expected a finite number above 0",
        ),
        (["ls", str(saved), "--nope"], "No such option '--nope'"),
    ]
    for args, message in cases:
        proc = tiercheck_cli(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.count("\n") == 1, (args, proc.stderr)  # no usage block, no traceback
        assert proc.stderr.startswith("tiercheck: error: ") and message in proc.stderr, (args, proc.stderr)
        assert "--help')" in proc.stderr


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
    result = run(*args, check=False)
    assert result.returncode == 2, (args, result.stdout + result.stderr)
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"tiercheck: error: Invalid value for '{option}'"), line


def test_ls_without_credentials_names_the_bucket_the_prefix_and_where_it_looked(tmp_path: Path) -> None:
    """``tiercheck ls s3://no-such-bucket/run`` said ``listing /: NoCredentialsError``."""
    missing = str(tmp_path / "none")
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("AWS_")}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_SHARED_CREDENTIALS_FILE=missing, AWS_CONFIG_FILE=missing)
    secret = "AKIDNOTTOBESHOWN"
    for options in ([], ["-o", f"key={secret}"]):
        proc = run("--retry-deadline", "5", "ls", "s3://no-such-bucket/run", *options, env=env, check=False)
        assert proc.returncode == 1, proc.stderr
        [line] = proc.stderr.strip().splitlines()
        assert line.startswith(
            "tiercheck: error: s3://no-such-bucket/run: listing bucket 'no-such-bucket' prefix 'run': no credentials"
        ), line
        assert "AWS_ACCESS_KEY_ID" in line and "~/.aws/credentials" in line and "-o KEY=VALUE" in line, line
        assert ("key given" in line) == bool(options), line
        assert "AWS_CONFIG_FILE set" in line and secret not in line, line


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


def test_inspect_answers_for_20000_arrays(tmp_path: Path) -> None:
    """Every array listed once, with its row; the text table took 18 s here at 20,000 arrays, 1.1 s now."""
    state = {f"a{i:05d}": torch.full((2,), float(i)) for i in range(20_000)}
    with tiercheck.Checkpointer(state, local=tmp_path) as ckpt:
        ckpt.save(1).wait()
    proc = tiercheck_cli("inspect", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("a") and line[1:6].isdigit()]
    assert [r[0] for r in rows] == sorted(state)
    assert all(r[1:] == ["float32", "[2]", "[2]", "1", "8", "B", "0"] for r in rows), rows[:3]
    assert "in 20000 arrays" in proc.stdout


# ------------------------------------------------------------------ -o after the subcommand


def test_fsspec_options_after_the_subcommand(tmp_path: Path, s3_server: SeaweedS3, s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/run"
    with tiercheck.Checkpointer(
        {"w": torch.arange(4.0)}, local=tmp_path / "local", remote=url, remote_options=s3_server.storage_options()
    ) as ck:
        ck.save(3).wait()
        ck.drain()
    endpoint, key, secret = (
        f"endpoint_url={s3_server.endpoint_url}",
        f"key={s3_server.key}",
        f"secret={s3_server.secret}",
    )
    # all after the subcommand (was "No such option: -o"), and split around it
    for args in (["ls", url, "--json", "-o", endpoint, "-o", key, "-o", secret],
                 ["-o", endpoint, "ls", url, "--json", "-o", key, "--option", secret]):  # fmt: skip
        proc = tiercheck_cli(*args)
        assert proc.returncode == 0, (args, proc.stderr)
        assert [s["step"] for s in json.loads(proc.stdout)["steps"]] == [3]
    proc = tiercheck_cli("inspect", url, "--json", "-o", endpoint, "-o", key, "-o", secret)
    assert proc.returncode == 0 and json.loads(proc.stdout)["step"] == 3, proc.stderr
    proc = tiercheck_cli("restore", url, "--to", str(tmp_path / "node"), "-o", endpoint, "-o", key, "-o", secret)
    assert proc.returncode == 0 and "restored step 3" in proc.stdout, proc.stderr


# ------------------------------------------------------------------ retries say what they retry


def test_a_refused_connection_is_retried_aloud(tmp_path: Path) -> None:
    """The CLI showed nothing while it retried for minutes; each retry now names the request, the
    attempt of how many, the seconds so far and the deadline, and the last line is the error."""
    port = closed_port()
    proc = tiercheck_cli(
        "--retry-deadline", "1", "ls", "s3://bucket/run", "-o", f"endpoint_url=http://127.0.0.1:{port}",
        "-o", "key=k", "-o", "secret=s",
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    retries = lines[:-1]
    assert retries, proc.stderr
    assert re.match(r"WARNING: s3://bucket/run: listing bucket 'bucket' prefix 'run': attempt 1 of 50 failed after \d+\.\d s \(", retries[0])
    for i, line in enumerate(retries, 1):
        assert f": attempt {i} of 50 failed after " in line and "for up to 1 s in all" in line, line
        assert f"127.0.0.1:{port}" in line and "retrying in " in line, line
    assert lines[-1].startswith(
        f"tiercheck: error: s3://bucket/run: listing bucket 'bucket' prefix 'run': gave up after {len(retries) + 1} attempt(s) in "
    )
    assert "(retry limits: 50 attempts / 1 s)" in lines[-1]


def test_retry_warnings_count_true_attempts_and_seconds(caplog: pytest.LogCaptureFixture) -> None:
    tier = RemoteTier(
        "s3://bucket/run",
        storage_options={"endpoint_url": f"http://127.0.0.1:{closed_port()}", "key": "k", "secret": "s"},
        retry=tiercheck.RetryOptions(attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02, deadline_s=60),
    )
    # The seconds are whatever three refused connections took (0.5 s each on a loaded machine): the count and
    # the limits are what the message must get right.
    with pytest.raises(RemoteStorageError, match=r"listing step-00000001: gave up after 3 attempt\(s\) in \d+ s "
                                                 r"\(retry limits: 3 attempts / 60 s\)"):  # fmt: skip
        tier.list_dir(step_dir(1))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2
    for i, message in enumerate(warned, 1):
        assert message.startswith(f"s3://bucket/run: listing step-00000001: attempt {i} of 3 failed after "), message
        assert message.endswith("s, for up to 60 s in all"), message


# ------------------------------------------------------------------ WARNINGs seen without logging set up


_UNCONFIGURED = """
import sys, torch, tiercheck
from pathlib import Path
local = Path(sys.argv[1])
(local / "step-00000007").mkdir(parents=True)
(local / "step-00000007" / "half-written").write_bytes(b"x")
with tiercheck.Checkpointer({"w": torch.zeros(2)}, local=local) as ck:
    ck.save(8).wait()
"""


def test_warnings_reach_stderr_with_logging_unconfigured(tmp_path: Path) -> None:
    """No NullHandler swallows them: Python's last-resort handler prints the WARNING."""
    proc = subprocess.run(
        [sys.executable, "-c", _UNCONFIGURED, str(tmp_path / "local")], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == (
        f"removing partial step 7 from {tmp_path / 'local'} (left by an interrupted save or deletion)\n"
    ), proc.stderr


# ------------------------------------------------------------------ RNG state


def test_rng_state_is_saved_at_each_save_and_set_by_restore(tmp_path: Path) -> None:
    state = {"w": torch.zeros(2), "rng": tiercheck.RNGState()}
    with tiercheck.Checkpointer(state, local=tmp_path) as ck:
        torch.manual_seed(1), random.seed(1), np.random.seed(1)
        torch.rand(3), random.random(), np.random.rand()  # the generators move on after construction
        ck.save(1).wait()
        expected = (torch.rand(4), random.random(), np.random.rand(3))
        torch.rand(9), random.random(), np.random.rand(5)
        assert ck.restore() == 1
        got = (torch.rand(4), random.random(), np.random.rand(3))
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1] and np.array_equal(got[2], expected[2])
    assert set(tiercheck.load(tmp_path)["rng"]) >= {"torch", "python", "numpy"}


def test_the_readme_state_uses_the_rng_helper() -> None:
    """The README's example once saved torch.get_rng_state() from construction time, never restored."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    using_it = readme.split("## Using it", 1)[1].split("```", 2)[1]
    assert '"rng": tiercheck.RNGState()' in using_it and "get_rng_state" not in using_it


# ------------------------------------------------------------------ optional object-store clients


_BLOCKED = """
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("s3fs", "adlfs"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, Blocker())
import tiercheck
from tiercheck.tiers.remote import open_tier
for url in sys.argv[1:]:
    try:
        open_tier(url)
    except tiercheck.RemoteStorageError as e:
        print(e)
"""


def test_a_missing_object_store_client_names_the_extra() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKED, "s3://bucket/run", "az://container/run", "abfs://container/run"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    s3, az, abfs = proc.stdout.strip().splitlines()
    assert s3.startswith("cannot open s3://bucket/run: s3fs is not installed; pip install 'tiercheck[s3]' "
                         "(or 'tiercheck[all]')"), s3  # fmt: skip
    assert az.startswith("cannot open az://container/run: adlfs is not installed; pip install 'tiercheck[azure]'"), az
    assert "pip install 'tiercheck[azure]'" in abfs, abfs


def test_the_object_store_clients_are_extras_and_test_pulls_them() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith(("s3fs", "adlfs"))]
    extras = project["optional-dependencies"]
    assert extras["s3"] == ["s3fs>=2024.6"] and extras["azure"] == ["adlfs>=2024.7"]
    assert extras["all"] == ["tiercheck[s3,azure]"] and "tiercheck[s3,azure]" in extras["test"]


def test_the_cli_in_process_imports_no_torch_and_leaves_logging_as_it_was() -> None:
    """-o after the subcommand and the new validation cost no torch import either; the handler the
    command adds for its WARNINGs goes when it ends (tests and embedders run ``main`` in-process)."""
    code = textwrap.dedent("""
        import logging, sys
        from click.testing import CliRunner
        from tiercheck.cli import main
        logger = logging.getLogger("tiercheck")
        r = CliRunner().invoke(main, ["plan", "--params", "7e9", "-o", "x=1"])
        assert r.exit_code == 0, r.output
        assert logger.handlers == [] and logger.level == logging.NOTSET  # the command's logging undone
        print("torch" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr


# ------------------------------------------------------------------ progress bars on a terminal


def on_a_terminal(*args: str) -> tuple[int, str, str]:
    """Run the command with stderr on a pseudo-terminal (as a user at a shell has it)."""
    import os
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "tiercheck", *args], stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    stdout = proc.communicate(timeout=120)[0]
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    return proc.returncode, stdout, b"".join(chunks).decode()


def test_copies_and_drains_show_a_progress_bar_on_a_terminal(tmp_path: Path, saved: Path) -> None:
    rc, stdout, bar = on_a_terminal("restore", str(saved), "--to", str(tmp_path / "node"))
    assert rc == 0 and stdout.startswith("restored step 5"), (stdout, bar)
    final = bar.rsplit("\r", 2)[-2]  # the bar's last frame
    assert "step 5" in final and "━" in final and "0:00:00" in final, repr(bar)
    rc, stdout, bar = on_a_terminal("drain", str(saved), "--to", f"file://{tmp_path / 'remote'}")
    assert rc == 0 and "step 5 -> " in stdout and "committed" in stdout, (stdout, bar)
    assert "step 5" in bar and "━" in bar, repr(bar)
    rc, stdout, bar = on_a_terminal("-q", "restore", str(saved), "--to", str(tmp_path / "quiet"))
    assert rc == 0 and "━" not in bar, repr(bar)
