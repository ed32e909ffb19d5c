"""Lazy staging's safety net: a tensor changed between ``save()`` and its copy to host memory
fails that save, naming the tensor, instead of committing a torn step (issue 42, item 13)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tiercheck
import tiercheck.save.pipeline
from tests.conftest import assert_identical
from tiercheck import Checkpointer, RetentionOptions, StateChangedError, WriteOptions
from tiercheck.state.staging import HostPool

CHUNK = WriteOptions(chunk_bytes=64 << 10)  # several runs: a change can land between two copies


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Staging waits at its first copy until the event is set: the copy is still to come when
    ``save()`` has returned, whatever the machine's speed."""
    gate = threading.Event()
    acquire = HostPool.acquire

    def gated(pool: HostPool, nbytes: int):  # type: ignore[no-untyped-def]
        assert gate.wait(timeout=60)
        return acquire(pool, nbytes)

    monkeypatch.setattr(HostPool, "acquire", gated)
    yield gate
    gate.set()


def test_a_parameter_changed_before_its_lazy_copy_fails_the_save_and_keeps_the_last_step(
    ckpt_dir: Path, held: threading.Event
) -> None:
    """The repro: ``h = ck.save(1); model.weight.mul_(0)`` under no_grad committed a torn step."""
    model, opt = _model()
    with Checkpointer({"model": model, "optimizer": opt}, local=ckpt_dir, write=CHUNK) as ck:
        assert ck.lazy
        held.set()
        ck.save(0).wait()
        at_0 = {k: v.clone() for k, v in model.state_dict().items()}
        held.clear()
        h = ck.save(1)
        assert not h.staged.done(), "the copy is held back: save() returned before it"
        with torch.no_grad():
            model[0].weight.mul_(0)
        held.set()
        with pytest.raises(StateChangedError, match=r"model/0\.weight.*changed after save\(1\)") as err:
            h.wait()
        assert isinstance(err.value, RuntimeError) and "not committed" in str(err.value)
        assert h.done() and isinstance(h.committed.exception(), StateChangedError)
        with pytest.raises(StateChangedError):
            ck.wait()  # the latest save's failure
        assert ck.steps() == [0], "step 1 is not committed"
        assert ck.stats()["failed"] == ck.stats()["state_changed"] == 1 and ck.stats()["committed"] == 1
        assert not (ckpt_dir / "step-00000001").exists(), "the failed save's files are gone"
        assert_identical(at_0, tiercheck.load(ckpt_dir, step=0)["model"])

        ck.save(2).wait()  # the next save is fine
        assert ck.steps() == [0, 2] and ck.stats()["committed"] == 2
        assert_identical(model.state_dict(), tiercheck.load(ckpt_dir, step=2)["model"])


def test_a_change_during_the_copy_fails_the_save(ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor changed while its copy runs (here: half of it, then the copy) is caught after the copy."""
    model, opt = _model()
    copy_pieces = tiercheck.save.pipeline.copy_pieces
    target = model[1].bias

    def tearing(outs, pieces, stream):  # type: ignore[no-untyped-def]
        if any(p.data_ptr() == target.data_ptr() for p in pieces):
            with torch.no_grad():
                target[:4].fill_(7.0)  # the training thread, mid-copy
        copy_pieces(outs, pieces, stream)

    with Checkpointer({"model": model, "optimizer": opt}, local=ckpt_dir, write=CHUNK) as ck:
        ck.save(0).wait()
        monkeypatch.setattr(tiercheck.save.pipeline, "copy_pieces", tearing)
        h = ck.save(1)
        with pytest.raises(StateChangedError, match=r"model/1\.bias.*while it was being copied"):
            h.wait()
        monkeypatch.undo()
        assert ck.steps() == [0]
        ck.save(2).wait()
        assert ck.steps() == [0, 2]


def test_the_optimizer_step_loop_in_lazy_mode_raises_no_false_alarm(ckpt_dir: Path) -> None:
    """Parameters and Adam's moments (and its step counters) change in ``optimizer.step()``, which
    waits for the copy: every save commits, each the state of its save() call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    saved = {}
    keep = RetentionOptions(keep_last=10)
    with Checkpointer({"model": model, "optimizer": opt}, local=ckpt_dir, write=CHUNK, retention=keep) as ck:
        for step in range(12):
            model(torch.randn(8, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step % 3 == 0:
                saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
                ck.save(step)
        ck.wait()
        stats = ck.stats()
    assert stats["failed"] == stats["state_changed"] == 0 and stats["committed"] == 4
    for step, state in saved.items():
        assert_identical(state, tiercheck.load(ckpt_dir, step=step)["model"])


def test_a_parameter_replaced_rather_than_changed_keeps_the_copy_of_the_save(
    ckpt_dir: Path, held: threading.Event
) -> None:
    """Assigning a new Parameter leaves the old tensor, the one save() took, as it was: no alarm."""
    model, opt = _model()
    with Checkpointer({"model": model, "optimizer": opt}, local=ckpt_dir, write=CHUNK) as ck:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        h = ck.save(1)
        model[0].weight = torch.nn.Parameter(torch.zeros(256, 256))
        held.set()
        h.wait()
    assert_identical(before, tiercheck.load(ckpt_dir)["model"])


def _dtensor_changed(rank: int, world: int, root: str) -> tuple[str, list[int], bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Linear(16, 8)
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    model.bias = torch.nn.Parameter(distribute_tensor(model.bias.detach(), mesh, [Shard(0)]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gate = threading.Event()
    acquire = HostPool.acquire
    HostPool.acquire = lambda pool, n: (gate.wait(60), acquire(pool, n))[1]  # type: ignore[method-assign]
    with Checkpointer({"model": model, "optimizer": opt}, local=f"{root}/node{rank}") as ck:
        gate.set()
        ck.save(0).wait()
        gate.clear()
        h = ck.save(1)
        with torch.no_grad():
            if rank == 0:
                model.weight.mul_(0)  # a DTensor op: its own version counter moves, not its local tensor's
            else:
                model.bias.to_local().mul_(0)  # the local tensor's moves
        gate.set()
        try:
            h.wait()
            outcome = "committed"
        except StateChangedError as e:
            outcome = str(e)
        ck.save(2).wait()
        return outcome, ck.steps(), ck.stats()["state_changed"] == 1


def test_a_dtensor_changed_before_its_lazy_copy_fails_the_save(tmp_path: Path) -> None:
    """An in-place op on a DTensor moves the DTensor's counter; one on ``to_local()`` the local
    tensor's, which the copy reads: either is caught, on the rank that made it."""
    from tests.distributed import run_ranks

    (r0, steps0, counted0), (r1, steps1, counted1) = run_ranks(
        _dtensor_changed, 2, str(tmp_path)
    )
    assert "model/weight changed after save(1)" in r0 and counted0
    assert "model/bias changed after save(1)" in r1 and counted1
    assert steps0 == steps1 == [0, 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_change_launched_before_or_during_the_side_stream_copy_fails_the_save(
    ckpt_dir: Path, held: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counters move when an op is launched on the host: one launched before the copy is queued is
    caught before it, one launched while the side stream copies is caught once the copies have ended."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    copy_pieces = tiercheck.save.pipeline.copy_pieces
    target = model[1].weight

    def racing(outs, pieces, stream):  # type: ignore[no-untyped-def]
        copy_pieces(outs, pieces, stream)  # queued on the side stream
        if any(p.data_ptr() == target.data_ptr() for p in pieces):
            with torch.no_grad():
                target.mul_(0)  # queued on the training stream meanwhile

    with Checkpointer({"model": model, "optimizer": opt}, local=ckpt_dir, write=CHUNK) as ck:
        held.set()
        ck.save(0).wait()
        held.clear()
        h = ck.save(1)
        with torch.no_grad():
            model[0].weight.mul_(0)
        held.set()
        with pytest.raises(StateChangedError, match=r"model/0\.weight changed after save\(1\), before it was copied"):
            h.wait()
        monkeypatch.setattr(tiercheck.save.pipeline, "copy_pieces", racing)
        with pytest.raises(StateChangedError, match=r"model/1\.weight changed after save\(2\), while it was being"):
            ck.save(2).wait()
        monkeypatch.undo()
        ck.save(3).wait()
        assert ck.steps() == [0, 3] and ck.stats()["state_changed"] == 2
