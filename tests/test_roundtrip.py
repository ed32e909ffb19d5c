"""Round trips are bit-identical: every dtype, nested state, Stateful model + Adam, edge shapes."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tiercheck
from tests.conftest import assert_identical
from tests.plainzarr import open_step
from tiercheck import Checkpointer, StagingOptions, WriteOptions

DTYPES = [
    torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn,
]  # fmt: skip


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(),), generator=g)
    t = raw.to(torch.uint8).view(dtype).reshape(shape)
    if dtype == torch.bool:
        t = raw.to(torch.uint8).remainder(2).to(torch.bool).reshape(shape)
    return t


@pytest.mark.parametrize("mode", ["eager", "lazy"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_dtype_round_trips_bit_identical(ckpt_dir: Path, dtype: torch.dtype, mode: str) -> None:
    # Random bytes include NaN payloads and subnormals: the comparison is on bits, not values.
    state = {
        "big": random_tensor((37, 19, 3), dtype, 1),
        "scalar": random_tensor((), dtype, 2),
        "empty": random_tensor((0, 4), dtype, 3),
        "vector": random_tensor((1000,), dtype, 4),
    }
    expected = copy.deepcopy(state)
    # Tiny chunks force many chunks per array, edge padding and cuts below the first dimension.
    with Checkpointer(
        state, local=ckpt_dir, write=WriteOptions(chunk_bytes=4096), staging=StagingOptions(mode=mode)
    ) as ck:
        ck.save(1).wait()
    loaded = tiercheck.load(ckpt_dir)
    assert_identical(expected, loaded)
    for t in state.values():
        t.zero_() if t.dtype != torch.float8_e4m3fn else t.view(torch.uint8).zero_()
    with Checkpointer(state, local=ckpt_dir) as ck:
        assert ck.restore() == 1
    assert_identical(expected, state)


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 3))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("mode", ["eager", "lazy", "auto"])
def test_model_and_adam_restore_bit_identical_and_continue_identically(ckpt_dir: Path, mode: str) -> None:
    torch.manual_seed(0)
    model, opt = make_model()
    info = {"epoch": 3, "seen": [1, 2.5, "x"], "rng": torch.get_rng_state()}
    with Checkpointer({"model": model, "optimizer": opt, "info": info}, local=ckpt_dir,
                      staging=StagingOptions(mode=mode)) as ck:  # fmt: skip
        train(model, opt, 3, seed=1)
        ck.save(3)
        train(model, opt, 2, seed=2)  # the lazy copy must still capture the step-3 state
    saved = tiercheck.load(ckpt_dir, step=3)

    torch.manual_seed(123)
    model2, opt2 = make_model()
    info2: dict[str, object] = {"epoch": 0}
    with Checkpointer({"model": model2, "optimizer": opt2, "info": info2}, local=ckpt_dir) as ck:
        assert ck.restore(3) == 3
    assert_identical(saved["model"], {k: v for k, v in model2.state_dict().items()})
    assert_identical(saved["optimizer"]["state"], opt2.state_dict()["state"])
    assert info2["epoch"] == 3 and info2["seen"] == [1, 2.5, "x"]
    assert_identical(info["rng"], info2["rng"])

    # Continuing from the restored state matches continuing from the original at step 3.
    torch.manual_seed(0)
    ref_model, ref_opt = make_model()
    train(ref_model, ref_opt, 3, seed=1)
    train(ref_model, ref_opt, 2, seed=2)
    train(model2, opt2, 2, seed=2)
    assert_identical(ref_model.state_dict(), model2.state_dict())


def test_nested_plain_values_round_trip_without_pickle(ckpt_dir: Path) -> None:
    np_rng = np.random.RandomState(5)
    nested = {
        "ints": [0, -1, 2**62, True, False, None],
        "floats": (0.1, float("inf"), float("-inf"), float("nan"), -0.0),
        "text": "ünïcode",
        "bytes": b"\x00\xff",
        "int_keys": {0: "a", 1: {"deep": torch.arange(5)}},
        "dollar": {"$tensor": "not a reference"},
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "np_array": np.arange(12, dtype=np.int16).reshape(3, 4),
        "np_scalar": np.float32(1.5),
        "np_rng": np_rng.get_state(),
        "py_rng": random.Random(7).getstate(),
        "torch_rng": torch.Generator().manual_seed(3).get_state(),
        "non_contiguous": torch.arange(24.0).reshape(4, 6).t(),
    }
    expected = copy.deepcopy(nested)
    with Checkpointer({"nested": nested}, local=ckpt_dir) as ck:
        ck.save(0).wait()
    loaded = tiercheck.load(ckpt_dir)["nested"]
    assert_identical(expected["ints"], loaded["ints"])
    assert_identical(expected["floats"], loaded["floats"])
    assert str(loaded["floats"][4]) == "-0.0"
    for key in ("text", "bytes", "dollar", "size", "dtype"):
        assert loaded[key] == expected[key] and type(loaded[key]) is type(expected[key]), key
    assert_identical(expected["int_keys"], loaded["int_keys"])
    assert_identical(expected["np_array"], loaded["np_array"])
    assert loaded["np_scalar"] == expected["np_scalar"] and loaded["np_scalar"].dtype == np.float32
    assert_identical(expected["np_rng"], loaded["np_rng"])
    assert loaded["py_rng"] == expected["py_rng"]
    assert_identical(expected["torch_rng"], loaded["torch_rng"])
    assert_identical(expected["non_contiguous"].contiguous(), loaded["non_contiguous"])

    restored = {"nested": {"text": "old", "gone": 1}}
    inner = restored["nested"]
    with Checkpointer(restored, local=ckpt_dir) as ck:
        ck.restore()
    assert restored["nested"] is inner, "plain dicts are restored in place"
    assert "gone" not in inner and inner["text"] == "ünïcode"


def test_plain_zarr_reads_a_step(ckpt_dir: Path) -> None:
    w = torch.randn(100, 30).to(torch.bfloat16)
    state = {"model": {"w": w, "b": torch.arange(7, dtype=torch.int32)}}
    with Checkpointer(state, local=ckpt_dir, write=WriteOptions(chunk_bytes=4096)) as ck:
        ck.save(12).wait()
    group = open_step(str(ckpt_dir / "step-00000012"))
    assert len(list((ckpt_dir / "step-00000012").rglob("*"))) < 12, "a handful of files, not one per chunk"
    stored = group["model/w"]
    assert stored.attrs["tiercheck"]["dtype"] == "bfloat16"
    assert stored.dtype == np.uint16 and stored.nchunks > 1  # zarr also verified every crc32c
    assert np.array_equal(stored[:], w.view(torch.uint16).numpy())
    assert np.array_equal(group["model/b"][:], np.arange(7, dtype=np.int32))


def test_restore_returns_none_on_empty_tier_and_steps_are_listed(ckpt_dir: Path) -> None:
    state = {"x": torch.zeros(3)}
    with Checkpointer(state, local=ckpt_dir, retention=tiercheck.RetentionOptions(keep_last=None)) as ck:
        assert ck.restore() is None and ck.latest_step() is None
        for step in (5, 1, 9):
            state["x"].fill_(step)
            ck.save(step)
        ck.wait()
        assert ck.steps() == [1, 5, 9] and ck.latest_step() == 9
        assert ck.restore() == 9 and state["x"][0] == 9
        assert ck.restore(5) == 5 and state["x"][0] == 5


def test_saving_a_committed_step_again_is_refused(ckpt_dir: Path) -> None:
    with Checkpointer({"x": torch.zeros(3)}, local=ckpt_dir) as ck:
        ck.save(4).wait()
        with pytest.raises(tiercheck.StepExistsError, match="step 4 is already committed"):
            ck.save(4)
    with Checkpointer({"x": torch.zeros(3)}, local=ckpt_dir) as ck, pytest.raises(FileExistsError):
        ck.save(4)


def test_handle_reports_timings_and_metadata_is_stored(ckpt_dir: Path) -> None:
    with Checkpointer({"x": torch.ones(1000)}, local=ckpt_dir) as ck:
        h = ck.save(2, metadata={"loss": 1.25, "tokens": 10})
        h.wait()
        assert h.done() and h.staged.done() and not h.skipped and h.nbytes == 4000
        for key in ("plan_s", "blocked_s", "stage_s", "persist_s", "commit_s", "durable_s"):
            assert h.timings[key] >= 0.0, key
        assert h.timings["durable_s"] >= h.timings["blocked_s"]
    manifest = (ckpt_dir / "step-00000002" / "manifest.json").read_text()
    assert '"metadata":{"loss":1.25,"tokens":10}' in manifest


@pytest.mark.parametrize(
    ("dtype", "shape", "chunks"),
    [("bfloat16", (100, 30), (34, 30)), ("bool", (0, 4), (1, 4)), ("float32", (), ()), ("int64", (5, 6, 7), (1, 6, 7)),
     ("complex64", (3,), (3,)), ("float8_e5m2", (9, 9), (9, 9))],
)  # fmt: skip
def test_array_metadata_is_exactly_what_zarr_writes(
    dtype: str, shape: tuple[int, ...], chunks: tuple[int, ...]
) -> None:
    from tiercheck.format.codec import _zarr_array_document, zarr_documents
    from tiercheck.format.manifest import ArrayRecord

    rec = ArrayRecord(path="model/x", dtype=dtype, kind="tensor", shape=shape, chunks=chunks)
    assert zarr_documents([rec])["model/x/zarr.json"] == _zarr_array_document(rec)


@pytest.mark.parametrize(
    "name, dest",
    [
        # every chunk read straight into the tensor, the edge chunk's padding after it
        ("whole tensor", lambda full: full.clone().zero_()),
        # chunks that lie in the shard read in place; the two it cuts are read, then copied
        ("rows 3..9", lambda full: tiercheck.Shard(torch.zeros(6, 1024), global_shape=(10, 1024), offsets=(3, 0))),
        # a chunk's part of a column shard is not contiguous: read, then copied
        (
            "columns 512..",
            lambda full: tiercheck.Shard(torch.zeros(10, 512), global_shape=(10, 1024), offsets=(0, 512)),
        ),
        # a transposed view: nothing contiguous to read into
        ("transposed view", lambda full: torch.zeros(1024, 10).t()),
    ],
)
def test_restore_into_whole_tensors_shards_and_views_is_bit_identical(tmp_path: Path, name: str, dest: Any) -> None:
    # Restore reads a chunk straight into the destination where its part there is contiguous and
    # copies it otherwise; each case below takes one or both ways.
    full = torch.randn(10, 1024)  # chunks of 4 rows (16 KiB): 3 chunks, the last with 2 rows of padding
    with Checkpointer({"w": full}, local=tmp_path, write=WriteOptions(chunk_bytes=4 * 4096)) as ck:
        ck.save(1).wait()
    target = dest(full)
    with Checkpointer({"w": target}, local=tmp_path) as ck:
        assert ck.restore() == 1
    if isinstance(target, tiercheck.Shard):
        rows, cols = (slice(o, o + n) for o, n in zip(target.offsets, target.local.shape, strict=True))
        assert torch.equal(target.local, full[rows, cols]), name
    else:
        assert torch.equal(target, full), name


def test_the_store_keeps_nothing_of_past_saves_and_restores(ckpt_dir: Path) -> None:
    """A long job's key-value store does not grow with its checkpoints: every protocol removes its
    keys once every rank is past them (a single process runs the same protocols over its own store).
    Rank 0 deletes the last vote's keys, and the last restore's answer, at the next vote or restore
    (when it knows every node's leader is past them): those are all the store keeps."""
    state = {"w": torch.randn(64, 16), "step": 0}
    with Checkpointer(state, local=ckpt_dir) as ck:
        store = ck._coord.store
        assert ck._prefaulter.thread is not None
        ck._prefaulter.thread.join(60)  # its plan (the first save's) runs the planning protocol too
        assert store.num_keys() == 0  # joining the node and planning left nothing behind
        for step in range(6):
            state["step"] = step
            ck.save(step).wait()
            assert ck.restore() == step
            kept = sorted(store.list_keys())
            vote = [f"tiercheck/local/save/{step}/0/{k}" for k in ("arrived", "committed", "meta", "nodes", "outcome")]
            assert kept == sorted([*vote, f"tiercheck/local/restore{step}/step/step/answer"]), kept
        assert ck.stats()["store_ops"] > 0


def test_restore_hands_whole_tensors_its_verified_memory_and_copies_into_parts_of_buffers(ckpt_dir: Path) -> None:
    """An all-or-nothing restore with no save pool to stage in reads into new memory and, once
    every chunk is verified, a parameter that is the whole of its memory takes that memory over (no
    copy): a view the user holds and the optimizer's reference see the restored values. Tensors
    that are parts of one flat buffer are copied into, so the buffer stays one buffer."""
    model = torch.nn.Linear(64, 64)
    flat = torch.arange(100, dtype=torch.float32)
    parts = {"a": flat[:50], "b": flat[50:]}
    state = {"model": model, "parts": parts}
    expected = {"w": model.weight.detach().clone(), "flat": flat.clone()}
    with Checkpointer(state, local=ckpt_dir) as ck:
        ck.save(1).wait()
    with torch.no_grad():
        model.weight.zero_()
        flat.zero_()
    view = model.weight.view(-1)  # held by the caller across the restore
    ptr, version = model.weight.data_ptr(), model.weight._version
    with Checkpointer(state, local=ckpt_dir) as ck:
        assert ck.restore(in_place=False) == 1  # all or nothing, as once the job holds progress
        assert ck.stats()["restore_staged_in_pool"] == 0
    assert torch.equal(model.weight, expected["w"]) and torch.equal(view, expected["w"].view(-1))
    assert model.weight.data_ptr() != ptr  # the memory the restore read into, not a copy of it
    assert model.weight._version > version  # autograd sees the change, as after a copy
    assert torch.equal(flat, expected["flat"])
    assert parts["a"].data_ptr() == flat.data_ptr() and parts["b"].data_ptr() == flat.data_ptr() + 50 * 4


def test_a_0d_numpy_array_round_trips_0d(ckpt_dir: Path) -> None:
    """A 0-d array (a counter kept as np.array(7)) is stored 0-d, not as a 1-element vector that
    would no longer fit the live array it came from."""
    with Checkpointer({"count": np.array(7, dtype=np.int64)}, local=ckpt_dir) as ck:
        ck.save(1).wait()
    loaded = tiercheck.load(ckpt_dir)["count"]
    assert isinstance(loaded, np.ndarray) and loaded.shape == () and loaded.dtype == np.int64 and loaded == 7


class NumpyHolder:
    """A Stateful keeping numpy arrays (a replay buffer, a data loader's position): its
    ``state_dict()`` hands out the arrays themselves and ``load_state_dict`` keeps what it is given."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays

    def state_dict(self) -> dict[str, Any]:
        return {"arrays": dict(self.arrays)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.arrays = dict(state_dict["arrays"])


def numpy_arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    grid = rng.standard_normal((37, 19))
    return {
        "int16": rng.integers(-(2**15), 2**15, 3000, dtype=np.int16),
        "float32": rng.integers(0, 2**32, 1000, dtype=np.uint32).view(np.float32),  # NaN payloads too
        "bool": rng.integers(0, 2, 300).astype(bool),
        "grid": grid,  # 2-D float64, C order
        "fortran": np.asfortranarray(grid.astype(np.float32)),  # not C-contiguous
        "scalar": np.array(7, dtype=np.int64),
    }


@pytest.mark.parametrize("how", ["new checkpointer", "in_place", "after a save"])
def test_restore_fills_live_numpy_arrays_in_place_wherever_they_are_nested(ckpt_dir: Path, how: str) -> None:
    """Numpy arrays in a dict, in a list and behind a Stateful's state_dict() come back holding the
    saved bits, and are the same array objects: a restore writes into them as into tensors."""

    def make() -> dict[str, Any]:
        return {
            "plain": numpy_arrays(1),
            "listed": list(numpy_arrays(2).values()),
            "holder": NumpyHolder(numpy_arrays(3)),
        }

    def arrays(state: dict[str, Any]) -> list[np.ndarray]:
        return [*state["plain"].values(), *state["listed"], *state["holder"].arrays.values()]

    live = make()
    expected = [a.copy() for a in arrays(make())]
    # A new Checkpointer has no pool: it stages in new memory. After a save it stages in the pool
    # where the pool is idle and resident enough, which depends on timing: not asserted.
    pool = how == "after a save"
    with Checkpointer(live if pool else make(), local=ckpt_dir, write=WriteOptions(chunk_bytes=4096)) as ck:
        ck.save(1).wait()
        for a in arrays(live):
            a[...] = 0
        before = [id(a) for a in arrays(live)]
        if pool:
            assert ck.restore() == 1
    if not pool:
        with Checkpointer(live, local=ckpt_dir) as again:
            assert again.restore(in_place=how == "in_place") == 1
    assert [id(a) for a in arrays(live)] == before, "the live arrays are restored into, not replaced"
    for want, got in zip(expected, arrays(live), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got, want, equal_nan=want.dtype.kind == "f") and got.tobytes() == want.tobytes()


def test_a_tensor_and_a_numpy_array_of_one_shape_and_dtype_restore_into_each_other(ckpt_dir: Path) -> None:
    """Which of the two was saved does not matter, as the device a tensor was saved from does not:
    the live array or tensor is written into, and stays what the state holds."""
    saved = {"t": torch.arange(12, dtype=torch.float32).reshape(3, 4), "a": np.arange(6, dtype=np.int16)}
    with Checkpointer(saved, local=ckpt_dir) as ck:
        ck.save(1).wait()
    as_array, as_tensor = np.zeros((3, 4), np.float32), torch.zeros(6, dtype=torch.int16)
    live: dict[str, Any] = {"t": as_array, "a": as_tensor}
    with Checkpointer(live, local=ckpt_dir) as ck:
        assert ck.restore() == 1
    assert live["t"] is as_array and as_array.dtype == np.float32 and np.array_equal(as_array, saved["t"].numpy())
    assert live["a"] is as_tensor and torch.equal(as_tensor, torch.from_numpy(saved["a"]))


def test_a_forked_child_exits_without_closing_its_parents_checkpointer(tmp_path: Path) -> None:
    """A child forked while a Checkpointer is open (Megatron's async saves fork their caller) exits at
    once: the exit hook closes only the Checkpointers of the process that made them, whose threads the
    child does not have (it waited DistributedOptions.timeout_s for them)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    with Checkpointer({"w": torch.ones(4)}, local=tmp_path / "ckpt") as ck:
        ck.save(1)
        child = ctx.Process(target=print, args=("child",))
        child.start()
        child.join(60)
        alive = child.is_alive()
        if alive:
            child.kill()
        assert not alive and child.exitcode == 0, "the forked child hung at exit"
