"""Host staging: bounded and reused memory (invariant 3), lazy copies, busy policies."""

from __future__ import annotations

import copy
import fcntl
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

import tiercheck
import tiercheck.restore.read
from tests.conftest import assert_identical
from tests.ondisk import chunk_span, chunks_of, evict_packs, flip_chunk_byte, skip_without_direct_io
from tiercheck import Checkpointer, StagingOptions, WriteOptions
from tiercheck.state import staging
from tiercheck.state.staging import ALIGN, HostPool, align_up
from tiercheck.tiers.local import LocalTier, PackWriter


def test_pool_stays_within_its_bound_over_many_saves(ckpt_dir: Path) -> None:
    bound = 64 << 10
    state = {"w": torch.zeros(256, 1024)}  # 1 MiB: 16x the bound
    with Checkpointer(state, local=ckpt_dir, staging=StagingOptions(max_host_bytes=bound)) as ck:
        for step in range(20):
            state["w"].fill_(step)
            ck.save(step)
        ck.wait()
        stats = ck.stats()
    assert 0 < stats["pool_peak_bytes"] <= stats["pool_capacity_bytes"] <= bound
    assert stats["pool_allocations"] == 1, "the pool is allocated once and reused"
    assert stats["committed"] == 20
    assert torch.equal(tiercheck.load(ckpt_dir)["w"], torch.full((256, 1024), 19.0))


def test_close_gives_the_pool_back(ckpt_dir: Path) -> None:
    """A closed Checkpointer holds no host memory for staging: a job that closes one and builds
    another (a restore with a fresh one, a plugin re-created) holds one pool, not two."""
    state = {"w": torch.randn(1 << 20)}
    ck = Checkpointer(state, local=ckpt_dir, staging=StagingOptions(prefault=False))
    ck.save(1).wait()
    pool = ck._pool
    assert pool is not None and pool.capacity >= 4 << 20
    ck.close()
    assert pool.capacity == 0 and ck.stats()["pool_capacity_bytes"] == 0


def test_default_pool_is_one_snapshot_allocated_once(ckpt_dir: Path) -> None:
    state = {"a": torch.zeros(1000), "b": torch.zeros(10, 10, dtype=torch.float64)}
    with Checkpointer(state, local=ckpt_dir) as ck:
        for step in range(10):
            ck.save(step)
        ck.wait()
        stats = ck.stats()
    assert stats["pool_allocations"] == 1
    # Both chunks are staged together, as they lie in the pack (each followed by its checksum).
    assert stats["pool_capacity_bytes"] == align_up(4000 + 4 + 800 + 4)


def test_ring_pool_reuses_out_of_order_releases_and_blocks_when_full() -> None:
    page = align_up(1)
    pool = HostPool(pin_memory=False)
    pool.reserve(4 * page)
    a, b, c = pool.acquire(page), pool.acquire(page - 100), pool.acquire(2 * page)
    assert (a.offset, b.offset, c.offset) == (0, page, 2 * page) and pool.in_use == 4 * page
    assert pool.view(a, page).data_ptr() % page == 0, "regions are page-aligned for O_DIRECT"
    pool.release(b)  # out of order: reclaimed only once `a` goes too
    assert pool.in_use == 4 * page
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(2 * page).offset))
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive() and not got, "a full pool must block the stager"
    pool.release(a)
    waiter.join(timeout=10)
    assert got == [0] and pool.peak_in_use == 4 * page
    with pytest.raises(tiercheck.StagingError, match="does not fit"):
        pool.acquire(8 * page)


def test_the_pool_lends_only_memory_it_has_touched_and_only_while_idle() -> None:
    pool = HostPool(pin_memory=False)
    pool.reserve(4 * ALIGN)  # allocated, never written: a restore would fault it in as new memory
    with pool.lend(ALIGN) as arena:
        assert arena is None
    pool.release(pool.acquire(2 * ALIGN))  # a save staged here
    with pool.lend(2 * ALIGN - 1) as arena:
        assert arena is not None and arena.numel() == 2 * ALIGN - 1 and arena.dtype == torch.uint8
        with pool.lend(1) as busy:
            assert busy is None
        assert pool.in_use == 2 * ALIGN
    assert pool.in_use == 0
    with pool.lend(2 * ALIGN + 1) as arena:
        assert arena is None  # beyond what was written
    ahead = HostPool(pin_memory=False)
    ahead.reserve(4 * ALIGN, touch=threading.Event())  # faulted in when allocated: all of it
    with ahead.lend(4 * ALIGN) as arena:
        assert arena is not None


def test_lazy_save_captures_the_state_of_the_save_call(ckpt_dir: Path) -> None:
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer(
        {"model": model, "optimizer": opt}, local=ckpt_dir, write=WriteOptions(chunk_bytes=64 << 10)
    ) as ck:
        assert ck.lazy, "auto mode is lazy when an optimizer is in the state"
        h = ck.save(1)
        model(torch.ones(1, 512)).sum().backward()
        opt.step()  # the pre-step hook waits for the copy before parameters change
        assert h.staged.done()
        h.wait()
        assert not torch.equal(model.weight, before["weight"])
    assert_identical(before, tiercheck.load(ckpt_dir)["model"])


def test_eager_mode_is_staged_when_save_returns(ckpt_dir: Path) -> None:
    state = {"w": torch.ones(100_000)}
    with Checkpointer(state, local=ckpt_dir, staging=StagingOptions(mode="eager")) as ck:
        h = ck.save(1)
        assert h.staged.done()
        state["w"].zero_()
        h.wait()
    assert torch.equal(tiercheck.load(ckpt_dir)["w"], torch.ones(100_000))


class GatedTier(LocalTier):
    """A real local tier whose chunk writes wait for a gate: a save stays in flight on demand."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()

    def write(self, path: str, parts):  # type: ignore[no-untyped-def]
        self.gate.wait(timeout=60)
        super().write(path, parts)

    def open_pack(self, path: str) -> PackWriter:
        pack = super().open_pack(path)
        write_at = pack.write_at

        def gated(offset: int, parts):  # type: ignore[no-untyped-def]
            self.gate.wait(timeout=60)
            write_at(offset, parts)

        pack.write_at = gated  # type: ignore[method-assign]
        return pack


def test_busy_policy_skip_drops_the_save_with_a_warning(ckpt_dir: Path) -> None:
    state = {"w": torch.zeros(1000)}
    with Checkpointer(state, local=ckpt_dir, staging=StagingOptions(if_busy="skip", mode="eager")) as ck:
        ck.tier = tier = GatedTier(ckpt_dir)
        first = ck.save(1)
        with pytest.warns(RuntimeWarning, match="skipped the save of step 2"):
            second = ck.save(2)
        assert second.skipped and second.done() and not first.done()
        tier.gate.set()
        first.wait()
        assert ck.steps() == [1] and ck.stats()["skipped"] == 1


def test_busy_policy_wait_blocks_until_the_pool_has_room(ckpt_dir: Path) -> None:
    state = {"w": torch.zeros(1000)}
    with Checkpointer(state, local=ckpt_dir, staging=StagingOptions(if_busy="wait", mode="eager")) as ck:
        ck.tier = tier = GatedTier(ckpt_dir)
        first = ck.save(1)
        handles: list[tiercheck.SaveHandle] = []
        saver = threading.Thread(target=lambda: handles.append(ck.save(2)))
        saver.start()
        saver.join(timeout=0.2)
        assert saver.is_alive() and not first.done(), "the second save waits: the pool holds one snapshot"
        tier.gate.set()
        saver.join(timeout=60)
        first.wait()
        handles[0].wait()
        assert ck.steps() == [1, 2] and ck.stats()["skipped"] == 0


@pytest.mark.parametrize("direct_io", [True, False])
def test_direct_and_buffered_writes_store_the_same_bytes(tmp_path: Path, direct_io: bool) -> None:
    # 1 MiB + 100 bytes per chunk: an aligned head goes around the page cache, the tail does not.
    state = {"w": torch.randn(3, (1 << 18) + 25)}
    opts = WriteOptions(chunk_bytes=(1 << 20) + 100, direct_io=direct_io)
    with Checkpointer(state, local=tmp_path / "d", write=opts) as ck:
        ck.save(1).wait()
        assert ck.stats()["pool_capacity_bytes"] % 4096 == 0
    assert_identical(state, tiercheck.load(tmp_path / "d"))
    step = tmp_path / "d/step-00000001"
    spans = [chunk_span(step, "w", key) for key in chunks_of(step, "w")]
    assert [length for _, _, length in spans] == [(1 << 20) + 100 + 4] * 3
    assert [offset % 4096 for _, offset, _ in spans] == [0, 0, 0], "big chunks start block-aligned in the pack"


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="per-thread niceness is read from Linux /proc")
def test_background_threads_yield_the_cpu_to_training(ckpt_dir: Path) -> None:
    def nice_of(tid: int) -> int:
        stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[16])  # field 19 of proc(5), after the command name

    base = nice_of(threading.get_native_id())
    with Checkpointer({"w": torch.zeros(1000)}, local=ckpt_dir, write=WriteOptions(nice=7)) as ck:
        ck.save(1).wait()
        workers = [t for t in threading.enumerate() if t.name.startswith("tiercheck-")]
        io = [t for t in workers if t.name.startswith("tiercheck-io") and t.native_id]
        stager = [t for t in workers if t.name == "tiercheck-stage" and t.native_id]
        assert io and stager, workers
        assert all(nice_of(t.native_id) == min(base + 7, 19) for t in io if t.native_id), io
        assert nice_of(stager[0].native_id) == base, "training waits for the copy: it keeps its priority"
    assert nice_of(threading.get_native_id()) == base, "the training thread keeps its priority"


def test_runs_of_chunks_are_staged_exactly_as_they_lie_in_the_pack(ckpt_dir: Path) -> None:
    """Chunks are staged in runs that mirror the pack: odd sizes that leave the next chunk at an
    unaligned place, a transposed (non-contiguous) tensor, edge chunks with padding and a big
    chunk after an alignment gap. Every chunk's bytes and checksum are where zarr looks, and the
    gaps are zeros even though the pool held other bytes there before."""
    g = torch.Generator().manual_seed(0)
    real = {
        "odd": torch.randn(1001, generator=g),  # 4004 bytes: what follows starts unaligned
        "f64": torch.randn(7, 3, generator=g, dtype=torch.float64),
        "t": torch.randn(5, 9, generator=g).T,  # not contiguous: copied through a view of its dtype
        "bf16": torch.randn(333, generator=g).to(torch.bfloat16),
        "bool": torch.rand(77, generator=g) > 0.5,
        "edges": torch.randn(1000, 700, generator=g),  # 2 MiB chunks of rows, the last one padded
        "big": torch.randn(1 << 18, generator=g),  # 1 MiB: starts block-aligned after a gap
        "scalar": torch.tensor(3.5, dtype=torch.float64),
    }
    state: dict[str, torch.Tensor] = {"fill": torch.full((2 << 20,), 7.0)}  # 8 MiB of nonzero bytes
    with Checkpointer(state, local=ckpt_dir, write=WriteOptions(chunk_bytes=2 << 20)) as ck:
        ck.save(1).wait()
        state.clear()
        state.update(real)  # a new plan, staged in the same pool over step 1's bytes
        ck.save(2).wait()
        assert ck.stats()["pool_allocations"] == 1
    assert_identical(state, tiercheck.load(ckpt_dir, step=2))
    step = ckpt_dir / "step-00000002"
    spans = sorted((off, length) for name in state for key in chunks_of(step, name)
                   for _, off, length in [chunk_span(step, name, key)])  # fmt: skip
    pack = next((step / "packs").iterdir()).read_bytes()
    covered = bytearray(len(pack))
    for off, length in spans:
        covered[off : off + length] = b"\1" * length
    gaps = [pack[i] for i in range(len(pack)) if not covered[i]]
    assert gaps and not any(gaps), "alignment gaps are zeros"
    assert spans[-1][0] + spans[-1][1] == len(pack)


def test_a_run_that_starts_unaligned_in_the_pack_writes_its_big_chunk_with_direct_io(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs begin wherever the chunk before them ended: the 513th small chunk starts a run at an
    odd place in the pack, and a 4 MiB chunk follows it in the same run. The run's whole blocks
    still go to disk with O_DIRECT (the run lies in the pool as in the pack, modulo a page), so a
    big chunk never passes through the page cache whatever run it falls in; only the bytes
    before the first block boundary and after the last one do."""
    state = {f"s{i:03d}": torch.full((1000,), float(i)) for i in range(600)}  # 4004 bytes with their CRCs
    state["zbig"] = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    calls: list[tuple[bool, int, int]] = []  # (direct, offset, bytes) of every pwritev into a pack
    pwritev = os.pwritev

    def spy(fd: int, views: Sequence[memoryview], offset: int) -> int:
        n = pwritev(fd, views, offset)
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".bin"):
            calls.append((bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT), offset, n))
        return n

    ckpt_dir.mkdir(parents=True, exist_ok=True)
    skip_without_direct_io(ckpt_dir)
    with Checkpointer(state, local=ckpt_dir, write=WriteOptions(chunk_bytes=8 << 20)) as ck:
        monkeypatch.setattr(os, "pwritev", spy)
        ck.save(1).wait()
        monkeypatch.undo()
    _, big_at, big_len = chunk_span(
        ckpt_dir / "step-00000001", "zbig", chunks_of(ckpt_dir / "step-00000001", "zbig")[0]
    )
    runs = sorted({off for _, off, _ in calls})
    assert any(off % 4096 for off in runs), "a run starts at an unaligned place in the pack"
    direct = [(off, off + n) for d, off, n in calls if d]
    whole = (big_at + big_len) // 4096 * 4096
    assert any(a <= big_at and whole <= b for a, b in direct), (big_at, big_len, calls)
    assert sum(n for d, _, n in calls if not d) < 1 << 20, "what is left to the page cache is the small chunks"
    assert_identical(state, tiercheck.load(ckpt_dir))


def test_copy_threads_are_set_for_the_calling_thread_alone() -> None:
    """The stager copies lazily staged chunks with one thread while training runs beside it;
    that count is the stager's own: the training thread's, and that of a thread started later
    (torch's global default), stay as they were."""
    if staging._set_omp_threads is None:
        pytest.skip("torch's OpenMP runtime is not reachable here; copies keep torch's thread count")
    default = torch.get_num_threads()
    seen: dict[str, int] = {}

    def stager() -> None:
        staging.set_copy_threads(1)
        seen["stager"] = torch.get_num_threads()

    def later() -> None:
        seen["later"] = torch.get_num_threads()

    for target in (stager, later):
        t = threading.Thread(target=target)
        t.start()
        t.join()
    assert seen == {"stager": 1, "later": default}
    assert torch.get_num_threads() == default


def test_the_pool_is_faulted_in_when_a_single_process_checkpointer_is_built(ckpt_dir: Path) -> None:
    """The first save of a single process finds its pool allocated and its pages touched (on a
    background thread from construction on), and uses it as it is; prefault=False leaves the
    pool to the first save."""
    state = {"w": torch.randn(1 << 20)}
    with Checkpointer(state, local=ckpt_dir / "on") as ck:
        assert ck._prefaulter.thread is not None
        ck._prefaulter.thread.join(60)
        assert not ck._prefaulter.thread.is_alive()
        built = ck.stats()
        assert built["pool_allocations"] == 1 and built["pool_capacity_bytes"] == align_up((4 << 20) + 4)
        ck.save(1).wait()
        assert ck.stats()["pool_allocations"] == 1, "the first save staged into the pre-faulted pool"
    with Checkpointer(state, local=ckpt_dir / "off", staging=StagingOptions(prefault=False)) as ck:
        assert ck._prefaulter.thread is None and ck.stats()["pool_allocations"] == 0
        ck.save(1).wait()
        assert ck.stats()["pool_allocations"] == 1


def test_where_steps_are_committed_the_pool_is_faulted_in_after_the_restore(ckpt_dir: Path) -> None:
    """A job whose directory holds committed steps restores first, into as much new memory as the
    pool holds: the pool is faulted in once the restore is done, for the state as restored (its
    optimizer's state included). A restore that finds nothing stops the pre-faulting begun when
    the Checkpointer was built, gives that pool back, and starts again."""
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    with Checkpointer({"model": model, "optim": opt}, local=ckpt_dir / "job") as ck:
        ck.save(1).wait()
        saved = ck.stats()["pool_capacity_bytes"]
    fresh = torch.nn.Linear(256, 256)
    fresh_opt = torch.optim.AdamW(fresh.parameters())  # no state until its first step
    with Checkpointer({"model": fresh, "optim": fresh_opt}, local=ckpt_dir / "job") as ck:
        assert ck._prefaulter.thread is None and ck.stats()["pool_allocations"] == 0
        assert ck.restore() == 1
        assert ck._prefaulter.thread is not None
        ck._prefaulter.thread.join(60)
        assert ck.stats()["pool_allocations"] == 1 and ck.stats()["pool_capacity_bytes"] == saved
    assert_identical(model.state_dict(), fresh.state_dict())

    with Checkpointer({"model": torch.nn.Linear(256, 256)}, local=ckpt_dir / "new") as ck:
        assert ck._prefaulter.thread is not None
        ck._prefaulter.thread.join(60)
        assert ck.stats()["pool_allocations"] == 1
        assert ck.restore() is None  # nothing to restore: the pool was given back, then faulted in again
        assert ck._prefaulter.thread is not None
        ck._prefaulter.thread.join(60)
        assert ck.stats()["pool_allocations"] == 2


def test_a_tensor_re_strided_since_the_plan_is_staged_where_it_can_be(ckpt_dir: Path) -> None:
    """Runs place a contiguous chunk anywhere in the pack (copied as bytes) and others only where
    their dtype can be viewed. A tensor replaced by one of the same shape but other strides keeps
    the plan (shapes and dtypes are the same) but not that placement: its float64 chunk after a
    3-byte one would be viewed at an odd address."""
    state = {"b": torch.tensor([True, False, True]), "w": torch.randn(5, 9, dtype=torch.float64)}
    with Checkpointer(state, local=ckpt_dir) as ck:
        ck.save(1).wait()
        state["w"] = torch.randn(9, 5, dtype=torch.float64).T  # same shape, not contiguous
        ck.save(2).wait()
        assert ck.stats()["saves"] == 2
    assert_identical(state, tiercheck.load(ckpt_dir, step=2))


def test_a_restore_in_the_saving_process_stages_in_the_idle_pool(ckpt_dir: Path) -> None:
    """A Checkpointer that has saved (a job rolling back in process) stages its restore in its
    idle save pool, resident already, instead of a snapshot's worth of new memory: the state comes
    back bit for bit, copied into the live tensors' own memory (none of it left pointing into the
    pool), and the pool serves the next save as before."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())

    def train() -> None:
        model(torch.randn(2, 256)).sum().backward()
        opt.step()

    train()
    live = [model.weight, model.bias, *(t for s in opt.state.values() for t in s.values() if t.dim())]
    ptrs = [t.data_ptr() for t in live]
    nbytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    nbytes += sum(p.numel() * p.element_size() for p in model.parameters())
    with Checkpointer({"model": model, "optim": opt}, local=ckpt_dir) as ck:
        ck.save(1).wait()
        one = {"model": copy.deepcopy(model.state_dict()), "optim": copy.deepcopy(opt.state_dict())}
        train()
        ck.save(2).wait()
        assert ck.restore(step=1) == 1
        stats = ck.stats()
        assert stats["restore_staged_in_pool"] == nbytes
        assert stats["pool_allocations"] == 1
        assert_identical({"model": model.state_dict(), "optim": opt.state_dict()}, one)
        assert [t.data_ptr() for t in live] == ptrs, "a live tensor was handed pool memory"
        train()
        ck.save(3).wait()  # the pool was given back whole: the next save stages as before
        three = {"model": copy.deepcopy(model.state_dict()), "optim": copy.deepcopy(opt.state_dict())}
    fresh = torch.nn.Linear(256, 256)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    with Checkpointer({"model": fresh, "optim": fresh_opt}, local=ckpt_dir) as ck:
        assert ck.restore() == 3
        assert ck.stats()["restore_staged_in_pool"] == 0  # no pool yet: new memory, taken over
    assert_identical({"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}, three)


def test_page_aligned_memory_this_machine_cannot_give_is_a_staging_error() -> None:
    with pytest.raises(tiercheck.StagingError, match=r"cannot allocate 1,125,899,906,842,624 bytes"):
        staging.page_aligned_empty((1 << 48,), torch.float32)  # 1 PiB: beyond any address space here


def _mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "aligned": torch.randn(4, 1 << 18, generator=g),  # four 1 MiB chunks, each on a page in memory
        "odd": torch.randn(3, (1 << 18) + 25, generator=g),  # 1 MiB + 100 byte chunks: tails, off-page starts
        "small": torch.randn(100, generator=g),
        "rows": torch.randn(1000, 700, generator=g),  # chunks of 374 rows, the last one short
        "bf16": torch.randn(1 << 20, generator=g).to(torch.bfloat16),
    }


@pytest.mark.parametrize("cached", [False, True])
def test_a_restore_reads_big_chunks_around_the_page_cache_unless_it_holds_them(ckpt_dir: Path, cached: bool) -> None:
    """A cold restore reads the block-aligned bodies of big chunks with O_DIRECT, straight into
    staging memory on a page (handed over to the live tensors), and the rest of each run (small
    chunks, checksums, the tails and off-page chunks, which are copied into place) into one
    scratch buffer; a chunk's bytes come back the same either way. Where the page cache holds
    the pack (a restore right after another, or after pre-staging), it is read from there."""
    state = _mixed_state()
    opts = WriteOptions(chunk_bytes=(1 << 20) + 100)
    with Checkpointer(state, local=ckpt_dir, write=opts) as ck:
        ck.save(1).wait()
    step = ckpt_dir / "step-00000001"
    evict_packs(step)
    if cached:
        for pack in (step / "packs").iterdir():
            pack.read_bytes()
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    with Checkpointer(live, local=ckpt_dir, write=opts) as ck:
        assert ck.restore(in_place=False) == 1  # staged (a job start's default reads into the live tensors)
        direct = ck.stats()["restore_read_direct_bytes"]
    assert_identical(live, state)
    if cached:
        assert direct == 0
    else:
        aligned = state["aligned"].numel() * 4
        assert aligned <= direct < sum(t.numel() * t.element_size() for t in state.values()) + (1 << 20)
        assert live["aligned"].data_ptr() % 4096 == 0, "staged on a page, and that memory handed over"


def test_chunks_as_big_as_a_read_run_are_read_around_the_page_cache_too(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the default 64 MiB chunks every run of a pack holds one chunk: a cold restore reads
    each of them with O_DIRECT too, not through the cache (here runs and chunks scaled down)."""
    monkeypatch.setattr(tiercheck.restore.read, "READ_RUN_BYTES", 1 << 20)
    state = {"w": torch.randn(4, 1 << 18, generator=torch.Generator().manual_seed(3))}  # four 1 MiB chunks
    opts = WriteOptions(chunk_bytes=1 << 20)
    with Checkpointer(state, local=ckpt_dir, write=opts) as ck:
        ck.save(1).wait()
    evict_packs(ckpt_dir / "step-00000001")
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    with Checkpointer(live, local=ckpt_dir, write=opts) as ck:
        assert ck.restore(in_place=False) == 1  # staged, as once the job holds progress
        assert ck.stats()["restore_read_direct_bytes"] >= 4 << 20
    assert_identical(live, state)


def test_a_second_restore_of_a_cold_pack_reads_around_the_page_cache_again(ckpt_dir: Path) -> None:
    """Reads that bypass the page cache leave nothing in it, and asking the cache what it holds
    reads nothing in: a job that restores twice from a cold pack (a restart right after a restart)
    reads it directly both times."""
    state = _mixed_state()
    opts = WriteOptions(chunk_bytes=(1 << 20) + 100)
    with Checkpointer(state, local=ckpt_dir, write=opts) as ck:
        ck.save(1).wait()
    evict_packs(ckpt_dir / "step-00000001")
    for _ in range(2):
        live = {k: torch.zeros_like(v) for k, v in state.items()}
        with Checkpointer(live, local=ckpt_dir, write=opts) as ck:
            assert ck.restore(in_place=False) == 1  # staged, as once the job holds progress
            assert ck.stats()["restore_read_direct_bytes"] >= state["aligned"].numel() * 4
        assert_identical(live, state)


def test_a_damaged_big_chunk_read_around_the_page_cache_is_named_and_the_state_kept(ckpt_dir: Path) -> None:
    state = _mixed_state()
    opts = WriteOptions(chunk_bytes=(1 << 20) + 100)
    with Checkpointer(state, local=ckpt_dir, write=opts) as ck:
        ck.save(1).wait()
    step = ckpt_dir / "step-00000001"
    flip_chunk_byte(step, "aligned", "c.2.0", 5000)  # inside the block-aligned body read with O_DIRECT
    evict_packs(step)
    live = {k: torch.full_like(v, 7) for k, v in state.items()}
    with (
        Checkpointer(live, local=ckpt_dir, write=opts) as ck,
        pytest.raises(tiercheck.CorruptCheckpointError, match=r"array 'aligned' chunk c\.2\.0: checksum mismatch"),
    ):
        ck.restore(in_place=False)  # staged, as once the job holds progress
    assert all(bool((t == 7).all()) for t in live.values()), "a failed restore leaves the live state untouched"


def test_a_restore_in_the_saving_process_reads_around_the_page_cache_into_the_pool(ckpt_dir: Path) -> None:
    """Staged in the idle save pool, big arrays start on a block, so their chunks are read with
    O_DIRECT there too, then copied into the live tensors."""
    state = _mixed_state()
    one = copy.deepcopy(state)
    opts = WriteOptions(chunk_bytes=(1 << 20) + 100)
    with Checkpointer(state, local=ckpt_dir, write=opts) as ck:
        ck.save(1).wait()
        for t in state.values():
            t.add_(1)
        ck.save(2).wait()
        evict_packs(ckpt_dir / "step-00000001")
        assert ck.restore(step=1) == 1
        stats = ck.stats()
    assert_identical(state, one)
    assert stats["restore_staged_in_pool"] == sum(t.numel() * t.element_size() for t in state.values())
    assert stats["restore_read_direct_bytes"] >= state["aligned"].numel() * 4


def test_a_pack_cut_short_inside_a_big_chunk_read_around_the_page_cache_is_reported(ckpt_dir: Path) -> None:
    """A pack that ends inside a big chunk (a disk that filled, a copy cut short) ends the direct
    read within a block: the run is read again chunk by chunk, and the chunk that is cut short is
    named; the live state is untouched."""
    state = _mixed_state()
    state["aligned"] = state.pop("aligned")  # last in the pack: the only array cut short
    with Checkpointer(state, local=ckpt_dir, write=WriteOptions(chunk_bytes=(1 << 20) + 100)) as ck:
        ck.save(1).wait()
    step = ckpt_dir / "step-00000001"
    last = max(chunks_of(step, "aligned"), key=lambda k: chunk_span(step, "aligned", k)[1])
    pack, offset, length = chunk_span(step, "aligned", last)
    assert pack.stat().st_size == offset + length
    os.truncate(pack, offset + length // 2 + 123)  # mid-chunk, not on a block
    evict_packs(step)
    live = {k: torch.full_like(v, 7) for k, v in state.items()}
    with (
        Checkpointer(live, local=ckpt_dir) as ck,
        pytest.raises(
            tiercheck.CorruptCheckpointError, match=rf"array 'aligned' chunk {last}: chunk has \d+ bytes.*truncated"
        ),
    ):
        ck.restore(in_place=False)  # staged, as once the job holds progress
    assert all(bool((t == 7).all()) for t in live.values()), "a failed restore leaves the live state untouched"
