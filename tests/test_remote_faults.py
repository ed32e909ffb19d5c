"""A failing remote never stops training and never loses the local copy (invariant 4).

Real failures, not mocks: the S3 server is stopped mid-drain and started again; a proxy in front
of it answers a share of requests with 503 SlowDown or resets the connection; credentials are
wrong. Each time saves keep committing locally, and what the remote gets is intact.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

import tiercheck
from tests.conftest import assert_identical, seeded_tensors
from tests.faultproxy import FaultProxy
from tests.servers import SeaweedS3
from tiercheck import Checkpointer, DrainOptions, RetryOptions
from tiercheck.format.steps import list_steps
from tiercheck.tiers.base import Buffer
from tiercheck.tiers.remote import RemoteTier

PATIENT = RetryOptions(attempts=200, initial_backoff_s=0.05, max_backoff_s=0.5, deadline_s=120)


def state_of(seed: int) -> dict[str, Any]:
    return seeded_tensors(seed, {f"layer{i}": (64, 256) for i in range(12)}) | {"step": seed}


class StopsServerMidway(RemoteTier):
    """A remote tier whose third upload stops the S3 server (then carries on, and fails)."""

    def __init__(self, server: SeaweedS3, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server = server
        self.writes = 0
        self.stopped = threading.Event()
        self._count = threading.Lock()

    def _one_more(self) -> None:
        with self._count:
            self.writes += 1
            stop_now = self.writes == 3
        if stop_now:
            self.server.stop()
            self.stopped.set()

    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        self._one_more()
        super().write(path, parts)

    def write_stream(self, path: str, pieces: Callable[[], Iterable[Buffer]], *, size: int | None = None) -> None:
        self._one_more()
        super().write_stream(path, pieces, size=size)


def test_an_s3_outage_mid_drain_blocks_nothing_and_the_drain_completes(
    tmp_path: Path, s3_server: SeaweedS3, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/run"
    remote = StopsServerMidway(s3_server, url, storage_options=s3_server.storage_options(), retry=PATIENT)
    state = state_of(1)
    drain = DrainOptions(concurrency=2, retry=PATIENT)
    try:
        with Checkpointer(state, local=tmp_path / "local", remote=remote, drain=drain) as ck:
            first = ck.save(1)
            assert remote.stopped.wait(60), "the drain of step 1 reached its third upload"
            for step in (2, 3):  # the server is down: saves still commit locally, at local speed
                state.update(state_of(step))
                ck.save(step).wait(timeout=60)
            assert ck.steps() == [1, 2, 3]
            assert not first.drained.done()
            s3_server.start()  # same ports, same data directory
            assert first.drained.result(timeout=120) is True
            status = ck.drain(timeout=120)
            assert status["failed"] == 0 and status["retries"] > 0
            assert status["last_drained"] == 3
    finally:
        if not s3_server.running:
            s3_server.start()
    opts = s3_server.storage_options()
    assert list_steps(RemoteTier(url, storage_options=opts)).committed == [1, 3]  # 2 was skipped for 3
    assert_identical(tiercheck.load(url, step=1, storage_options=opts), state_of(1))
    assert_identical(tiercheck.load(url, step=3, storage_options=opts), state_of(3))


def test_throttling_and_resets_are_retried_until_the_checkpoint_lands(
    tmp_path: Path, s3_server: SeaweedS3, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/run"
    with FaultProxy(s3_server.endpoint_url, throttle=0.25, reset=0.15, seed=7) as proxy:
        state = state_of(4)
        with Checkpointer(
            state,
            local=tmp_path / "local",
            remote=url,
            remote_options=s3_server.storage_options(endpoint_url=proxy.url),
            drain=DrainOptions(retry=PATIENT),
        ) as ck:
            assert ck.save(4).drained.result(timeout=120) is True
            ck.drain(timeout=120)
        status = ck.status()["remote"]  # after close: every request is over
        faults = proxy.stats()
    assert faults["throttled"] > 0 and faults["reset"] > 0
    # Retried by us and counted: nearly every fault (s3fs answers a throttled HEAD by listing, and
    # aiohttp may reconnect after a reset by itself), never more than there were faults.
    assert faults["throttled"] // 2 < status["retries"] <= faults["throttled"] + faults["reset"]
    assert_identical(tiercheck.load(url, storage_options=s3_server.storage_options()), state_of(4))


@pytest.mark.parametrize("kind", ["s3", "azure"])
def test_wrong_credentials_fail_fast_and_keep_the_local_checkpoint(
    tmp_path: Path, request: pytest.FixtureRequest, kind: str
) -> None:
    if kind == "s3":
        server = request.getfixturevalue("s3_server")
        url = f"s3://{request.getfixturevalue('s3_bucket')}/run"
        options = server.storage_options() | {"secret": "not-the-secret"}
    else:
        server = request.getfixturevalue("azurite_server")
        url = f"az://{request.getfixturevalue('azure_container')}/run"
        options = server.storage_options()
        options["connection_string"] = options["connection_string"].replace("AccountKey=Eby8", "AccountKey=Xby8")
    state = state_of(5)
    with Checkpointer(state, local=tmp_path / "local", remote=url, remote_options=options) as ck:
        handle = ck.save(5)
        handle.wait()
        with pytest.raises(tiercheck.RemoteStorageError, match="access denied") as info:
            handle.drained.result(timeout=60)
        status = ck.status()["remote"]
        assert status["retries"] == 0
        assert "not-the-secret" not in str(info.value) and "Xby8" not in str(info.value)
    assert_identical(tiercheck.load(tmp_path / "local"), state_of(5))


def test_close_with_the_remote_down_is_bounded_and_reports_the_undrained_steps(
    tmp_path: Path, s3_server: SeaweedS3, s3_bucket: str, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first save waits up to REMOTE_CHECK_S (10 s) for the prefix's owner, which no reset request can tell:
    # the close's bound is what is tested here, not that wait.
    monkeypatch.setattr("tiercheck.tiering.lineage.REMOTE_CHECK_S", 1.0)
    with FaultProxy(s3_server.endpoint_url, reset=1.0, seed=3) as proxy:  # every request is reset
        ck = Checkpointer(
            state_of(5),
            local=tmp_path / "local",
            remote=f"s3://{s3_bucket}/run",
            remote_options=s3_server.storage_options(endpoint_url=proxy.url),
            drain=DrainOptions(retry=PATIENT),  # would retry for 120 s
        )
        ck.save(5).wait()
        undrained = ck.close(timeout=2)
        # Returned long before the retries' own deadline, naming the step; the drain gave up.
        assert undrained == [5]
        assert ck.close() == []  # idempotent
    warned = [r.message for r in caplog.records if r.levelname == "WARNING" and "not drained" in r.message]
    assert len(warned) == 1 and "step(s) 5 not drained" in warned[0] and "tiercheck drain" in warned[0]
    assert list_steps(tiercheck.tiers.local.LocalTier(tmp_path / "local")).committed == [5]  # kept locally
