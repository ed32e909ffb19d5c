"""The CUDA path: pinned pool, side-stream copies, lazy staging fenced before optimizer.step(),
job-start restores streamed into GPU tensors through page-locked bounce buffers, and all-or-nothing
restores staged on the GPU where it has room, else on the host and copied up through a page-locked
ring (issue 43).

Runs only where a CUDA device exists (marker ``gpu``); elsewhere pytest reports these as skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tiercheck
from tests.conftest import assert_identical
from tests.ondisk import evict_packs, flip_chunk_byte
from tiercheck import Checkpointer, CorruptCheckpointError, PartlyRestoredError, StagingOptions, WriteOptions
from tiercheck.format.paths import step_dir
from tiercheck.restore import stage, to_device

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_cuda_state_round_trips_through_a_pinned_pool(ckpt_dir: Path, mode: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
    model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())
    state = {"model": model, "optimizer": opt, "extra": {"t": torch.arange(10, device="cuda")}}
    with Checkpointer(
        state, local=ckpt_dir, staging=StagingOptions(mode=mode), write=WriteOptions(chunk_bytes=64 << 10)
    ) as ck:  # type: ignore[arg-type]
        model(torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        h = ck.save(1)
        # Queue work that changes the parameters right away: the side stream must copy first.
        model(torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        h.wait()
        stats = ck.stats()
    assert stats["pool_pinned"] is True
    assert_identical(expected, tiercheck.load(ckpt_dir)["model"])

    model2 = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
    model2 = model2.to(torch.bfloat16)
    with Checkpointer({"model": model2}, local=ckpt_dir) as ck:
        ck.restore(strict=False)
    assert all(p.is_cuda for p in model2.parameters())
    assert_identical(expected, {k: v.cpu() for k, v in model2.state_dict().items()})


def _cuda_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "big": torch.randn(1024, 1024, device="cuda", generator=g),  # 4 MiB: 4 chunks of 1 MiB, read around the cache
        "odd": torch.randn(333, 777, device="cuda", generator=g).to(torch.bfloat16),  # an edge chunk
        "small": torch.arange(10, device="cuda"),
    }


def _saved_cold(ckpt_dir: Path, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Step 1 of ``_cuda_state(seed)`` saved and out of the page cache: its tensors on the CPU, and
    zeroed live tensors like them on the GPU to restore into."""
    saved = _cuda_state(seed)
    with Checkpointer({"s": saved}, local=ckpt_dir, write=WriteOptions(chunk_bytes=1 << 20)) as ck:
        ck.save(1).wait()
    evict_packs(ckpt_dir / step_dir(1))
    return {k: v.cpu() for k, v in saved.items()}, {k: torch.zeros_like(v) for k, v in saved.items()}


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in tensors.values())


def _no_device_sync(*args: object, **kwargs: object) -> None:
    raise AssertionError("restore waited for the whole device")


def test_a_job_start_restore_streams_into_the_gpu_tensors(ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted job: a new Checkpointer reads each run of a cold pack around the page cache into
    a page-locked bounce buffer, verifies it, and copies it up into the live GPU tensors
    themselves: nothing staged, no new GPU memory, and no wait for the whole device."""
    expected, live = _saved_cold(ckpt_dir, seed=0)
    pointers = {k: v.data_ptr() for k, v in live.items()}
    with Checkpointer({"s": live}, local=ckpt_dir) as ck:
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "synchronize", _no_device_sync)
            assert ck.restore() == 1
        stats = ck.stats()
    assert_identical(expected, {k: v.cpu() for k, v in live.items()})
    assert {k: v.data_ptr() for k, v in live.items()} == pointers
    assert stats["restore_in_place_bytes"] == _nbytes(expected)
    assert stats["restore_staged_on_device"] == stats["restore_copied_up_bytes"] == 0
    assert stats["restore_read_direct_bytes"] >= 4 << 20


def test_a_damaged_chunk_mid_stream_falls_back_to_the_older_step_bit_identically(ckpt_dir: Path) -> None:
    """Step 2's third chunk of "big" is damaged: the job-start restore has streamed parts of step 2
    into the GPU tensors by then, and the older step 1 overwrites every one of them."""
    one, two = _cuda_state(4), _cuda_state(5)
    state = {k: v.clone() for k, v in one.items()}
    with Checkpointer({"s": state}, local=ckpt_dir, write=WriteOptions(chunk_bytes=1 << 20)) as ck:
        ck.save(1).wait()
        for k in state:
            state[k].copy_(two[k])
        ck.save(2).wait()
    flip_chunk_byte(ckpt_dir / step_dir(2), "s/big", "c.2.0", 100)
    live = {k: torch.zeros_like(v) for k, v in one.items()}
    with Checkpointer({"s": live}, local=ckpt_dir) as ck:
        assert ck.restore() == 1
        stats = ck.stats()
    assert_identical({k: v.cpu() for k, v in one.items()}, {k: v.cpu() for k, v in live.items()})
    assert stats["restore_in_place_bytes"] == _nbytes(one)


def test_a_job_start_restore_with_no_whole_step_names_the_gpu_tensors_it_overwrote(ckpt_dir: Path) -> None:
    saved = _cuda_state(6)
    with Checkpointer({"s": saved}, local=ckpt_dir, write=WriteOptions(chunk_bytes=1 << 20)) as ck:
        ck.save(1).wait()
    flip_chunk_byte(ckpt_dir / step_dir(1), "s/big", "c.3.0", 100)
    live = {k: torch.zeros_like(v) for k, v in saved.items()}
    with Checkpointer({"s": live}, local=ckpt_dir) as ck, pytest.raises(PartlyRestoredError) as info:
        ck.restore()
    assert "no older committed step is whole to restore" in str(info.value)
    assert "parts of step(s) 1 into tensor(s)" in str(info.value) and "s/big" in str(info.value)


def test_an_all_or_nothing_restore_stages_gpu_tensors_on_the_gpu_and_reads_around_the_cache(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``in_place=False`` at a job start: every chunk is verified in spare GPU memory before the
    live tensors are copied into, with O_DIRECT reads of a cold pack, and only the restore's own
    copies are waited for."""
    expected, live = _saved_cold(ckpt_dir, seed=0)
    pointers = {k: v.data_ptr() for k, v in live.items()}
    with Checkpointer({"s": live}, local=ckpt_dir) as ck:
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "synchronize", _no_device_sync)
            assert ck.restore(in_place=False) == 1
        stats = ck.stats()
    assert_identical(expected, {k: v.cpu() for k, v in live.items()})
    assert {k: v.data_ptr() for k, v in live.items()} == pointers  # copied into, memory kept
    assert stats["restore_staged_on_device"] == _nbytes(expected)
    assert stats["restore_in_place_bytes"] == 0
    assert stats["restore_read_direct_bytes"] >= 4 << 20


def test_a_damaged_chunk_leaves_gpu_tensors_as_they_were(ckpt_dir: Path) -> None:
    saved = _cuda_state(1)
    with Checkpointer({"s": saved}, local=ckpt_dir, write=WriteOptions(chunk_bytes=1 << 20)) as ck:
        ck.save(1).wait()
    flip_chunk_byte(ckpt_dir / step_dir(1), "s/big", "c.2.0", 100)
    live = _cuda_state(2)
    before = {k: v.cpu() for k, v in live.items()}
    with Checkpointer({"s": live}, local=ckpt_dir) as ck, pytest.raises(CorruptCheckpointError, match="c.2.0"):
        ck.restore(in_place=False)
    assert_identical(before, {k: v.cpu() for k, v in live.items()})


@pytest.mark.parametrize("room", [4 << 20, 0], ids=["room-for-one", "full"])
def test_a_full_gpu_stages_the_rest_in_host_memory_and_copies_it_up_through_a_pinned_ring(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch, room: int
) -> None:
    """A GPU too full to stage the whole state stages what fits there; the other tensors are
    staged in ordinary host memory (pinning it would cost more than the one copy up it speeds)
    and, once every chunk is verified, go up through a ring of two page-locked buffers of 1 MiB
    (small here, so that it wraps around), with no wait for the whole device."""
    expected, live = _saved_cold(ckpt_dir, seed=3)
    pinned: list[object] = []
    real_empty = torch.empty

    def empty(*args: object, pin_memory: bool = False, **kwargs: object) -> torch.Tensor:
        if pin_memory and args and isinstance(args[0], tuple):
            pinned.append(args[0])  # page-locked memory shaped as a tensor: staging (a bounce buffer is bytes)
        return real_empty(*args, pin_memory=pin_memory, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(stage, "device_room", lambda items: {torch.device("cuda", torch.cuda.current_device()): room})
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(to_device, "RING_PIECE", 1 << 20)
    monkeypatch.setattr(to_device, "RING_BUFFERS", 2)
    with Checkpointer({"s": live}, local=ckpt_dir) as ck:
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "synchronize", _no_device_sync)
            assert ck.restore(in_place=False) == 1
        stats = ck.stats()
    assert_identical(expected, {k: v.cpu() for k, v in live.items()})
    assert all(v.is_cuda for v in live.values())
    assert stats["restore_staged_on_device"] == (4 << 20 if room else 0)  # "big" fits, nothing else then
    assert stats["restore_copied_up_bytes"] == _nbytes(expected) - stats["restore_staged_on_device"]
    assert pinned == []


def test_the_pinned_pool_locks_what_it_holds_and_no_more(ckpt_dir: Path) -> None:
    """A pool of 5 MiB and a page is page-locked at that size (cudaHostRegister), not at torch's
    next power of two (8 MiB), and the saved step is bit-identical."""
    state = {"w": torch.randn((5 << 20) // 4 + 1024, device="cuda")}
    expected = state["w"].cpu().clone()
    def torch_pinned() -> int:  # what torch's caching host allocator holds (torch 2.5 and later say)
        stats = getattr(torch.cuda, "host_memory_stats", dict)()
        return int(stats.get("allocated_bytes.all.current", 0))

    with Checkpointer(state, local=ckpt_dir, staging=StagingOptions(pin_memory=True)) as ck:
        cached = torch_pinned()
        ck.save(1).wait()
        stats = ck.stats()
        assert stats["pool_pinned"] is True
        assert stats["pool_pinned_bytes"] == stats["pool_capacity_bytes"] <= expected.nbytes + (2 << 20)
        assert torch_pinned() == cached
    assert torch.equal(tiercheck.load(ckpt_dir)["w"], expected)
