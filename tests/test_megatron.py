"""Megatron-core's ``dist_checkpointing.save`` / ``load`` through tiercheck (``tiercheck.integrations.megatron``).

Ranks are real processes in a gloo process group (``tests/distributed.py``); a "node" is a local directory.
The model is a handful of global tensors fixed by a seed, cut the way Megatron cuts them: an embedding split
over TP, stacked layers (a prepended layer axis) with a SwiGLU-style ``fc1`` (two pieces per rank), a
row-parallel bf16 ``fc2`` and a norm replicated over TP (``replica_id``), plus ShardedObjects.

The same tests run on both release lines: megatron-core 0.16 (Python 3.11, the main suite: a strategy
registry) and 0.19 (Python 3.12, its own lane in scripts/test.sh: subclasses of the torch_dist strategies,
the common state handed to the strategy). ``_save`` / ``_load`` pass the strategies as each line expects.

On a CPU build of torch, Megatron's own torch_dist writer calls ``torch.cuda.synchronize()`` and
``torch.cuda.current_device()``, which raise there. The ranks replace exactly these two with no-ops
(``_cpu_only``) before saving in Megatron's own format, and only then: tiercheck's path needs neither.
"""

from __future__ import annotations

import fractions
import json
import multiprocessing
import shutil
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import tiercheck
from tiercheck.integrations import megatron as tm  # imported first: it keeps megatron-core's import quiet

from .ondisk import chunks_of, flip_chunk_byte, step_parts

from megatron.core import dist_checkpointing as dc  # isort: skip
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor  # isort: skip
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # isort: skip

from .distributed import run_ranks
from .shm import private_shm

pytestmark = pytest.mark.frameworks

LAYERS, VOCAB, HIDDEN, FFN = 2, 8, 6, 4
TENSOR_KEYS = ("embed", "layers.fc1", "layers.fc2", "layers.norm")
N_TENSORS = 1 + 4 * LAYERS  # ShardedTensors per rank at TP1 and TP2: the embedding; per layer two fc1 pieces, fc2, norm


@pytest.fixture(scope="module", autouse=True)
def _preloaded_forkserver() -> None:
    """Import torch and megatron-core once, in the fork server the ranks are forked from (megatron-core's
    import alone takes ~5 s per process). If another module started the server already, ranks import it."""
    forkserver.set_forkserver_preload(["torch", "torch.distributed", "tests.distributed", __name__])
    forkserver.ensure_running()


def _launch(fn: Any, world: int, *args: Any) -> list[Any]:
    return run_ranks(fn, world, *args, timeout=120)


def _cpu_only() -> None:
    """Stand-ins for the two CUDA calls Megatron's own writer makes (see the module docstring)."""
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]  # where Megatron puts its flags


def _save(backend: tm.TiercheckBackend, sd: dict[str, Any], ck: str, **kwargs: Any) -> Any:
    """``dist_checkpointing.save`` through tiercheck: by backend name on 0.16, by strategy object on 0.17+."""
    strategy = ("tiercheck", 1) if tm.HAS_STRATEGY_REGISTRY else backend.save_strategy
    return dc.save(sd, ck, sharded_strategy=strategy, **kwargs)


def _load(backend: tm.TiercheckBackend, sd: dict[str, Any], ck: str) -> Any:
    """On 0.16 ``metadata.json`` names tiercheck and Megatron picks the strategy; 0.17+ is given it."""
    if tm.HAS_STRATEGY_REGISTRY:
        return dc.load(sd, ck)
    return dc.load(sd, ck, sharded_strategy=backend.load_strategy)


# ------------------------------------------------------------------------------------ the model


def global_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(VOCAB, HIDDEN, generator=g),
        "layers.fc1": torch.randn(LAYERS, 2 * FFN, HIDDEN, generator=g),  # [gate; up] per layer
        "layers.fc2": torch.randn(LAYERS, HIDDEN, FFN, generator=g).to(torch.bfloat16),
        "layers.norm": torch.randn(LAYERS, HIDDEN, generator=g),
    }


def rank_objects(rank: int, seed: int) -> dict[str, Any]:
    return {"rank": rank, "seed": seed, "counts": np.arange(3) + rank, "state": torch.full((2,), float(rank))}


def sharded_state(
    tp: int, pp: int, rank: int, *, seed: int, blank: bool = False, per_rank: bool = True
) -> dict[str, Any]:
    """What ``rank`` holds under TP x PP (TP fastest); ``blank``: right shapes, zeros, to load into."""
    t, p = rank % tp, rank // tp
    full = global_tensors(seed)

    def local(key: str, index: Any) -> torch.Tensor:
        x = full[key][index].clone()
        return x.zero_() if blank else x

    rows, cols = VOCAB // tp, FFN // tp
    sd: dict[str, Any] = {"layers": {}}
    if p == 0:
        sd["embed"] = ShardedTensor.from_rank_offsets(
            "embed", local("embed", slice(t * rows, (t + 1) * rows)), (0, t, tp)
        )
    for i in [i for i in range(LAYERS) if i * pp // LAYERS == p]:
        layer = (0, i, LAYERS)
        gate = local("layers.fc1", (i, slice(t * cols, (t + 1) * cols)))
        up = local("layers.fc1", (i, slice(FFN + t * cols, FFN + (t + 1) * cols)))
        sd["layers"][i] = {
            "fc1": [  # Megatron's SwiGLU factory: two pieces of one key on each rank
                ShardedTensor.from_rank_offsets("layers.fc1", gate, layer, (1, t, 2 * tp), prepend_axis_num=1),
                ShardedTensor.from_rank_offsets("layers.fc1", up, layer, (1, t + tp, 2 * tp), prepend_axis_num=1),
            ],
            "fc2": ShardedTensor.from_rank_offsets(
                "layers.fc2",
                local("layers.fc2", (i, slice(None), slice(t * cols, (t + 1) * cols))),
                layer,
                (2, t, tp),
                prepend_axis_num=1,
            ),
            "norm": ShardedTensor.from_rank_offsets(
                "layers.norm", local("layers.norm", i), layer, replica_id=t, prepend_axis_num=1
            ),
        }
    sd["config"] = ShardedObject("config", {"hidden": HIDDEN, "dims": (FFN, HIDDEN), "seed": seed}, (1,), (0,), rank)
    if per_rank:
        world = tp * pp
        sd["rng"] = ShardedObject("rng", None if blank else rank_objects(rank, seed), (world,), (rank,))
    return sd


def check_loaded(sd: dict[str, Any], loaded: dict[str, Any], seed: int, rank: int, in_place: bool = True) -> int:
    """Every loaded tensor equals its slice of the seed's global tensors, bit for bit, and was filled in
    place; objects equal what was saved. Returns the number of tensors checked."""
    full = global_tensors(seed)
    n = 0

    def walk(a: Any, b: Any, where: str) -> None:
        nonlocal n
        if isinstance(a, dict):
            for k in a:
                walk(a[k], b[k], f"{where}/{k}")
        elif isinstance(a, list):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                walk(x, y, f"{where}/{i}")
        elif isinstance(a, ShardedTensor):
            assert b is a.data or not in_place, f"{where}: not loaded in place"
            expected = full[a.key][a.global_slice()]
            assert b.dtype == expected.dtype and torch.equal(b, expected), f"{where}: values differ"
            n += 1
        elif a.key == "config":
            assert b == {"hidden": HIDDEN, "dims": (FFN, HIDDEN), "seed": seed}, f"{where}: {b!r}"
        else:
            want = rank_objects(rank, seed)
            assert b.keys() == want.keys() and b["rank"] == rank and b["seed"] == seed, f"{where}: {b!r}"
            assert isinstance(b["counts"], np.ndarray) and (b["counts"] == want["counts"]).all(), where
            assert torch.equal(b["state"], want["state"]), where

    walk(sd, loaded, "state")
    return n


def _may_have_children() -> None:
    """The launcher starts ranks as daemon processes, and multiprocessing forbids those children; Megatron's
    async caller forks one per save, its torch_dist writer starts a manager. This rank stops being
    "daemonic" (the launcher still kills it on failure)."""
    multiprocessing.current_process().daemon = False


def _new_dir(path: Path) -> str:
    """Megatron saves into an existing directory; rank 0 makes it, the others wait for it."""
    if dist.get_rank() == 0:
        path.mkdir(parents=True)
    dist.barrier()
    return str(path)


# ------------------------------------------------------------------------------------ rank bodies


def _save_tp1(rank: int, world: int, root: str) -> None:
    """TP1 round trip with the data in the checkpoint directory; metadata.json; corrupt chunk; pickle opt-in."""
    backend = tm.install()
    assert tm.installed() is backend  # for code far from install(), e.g. Megatron-LM's loader
    ck = _new_dir(Path(root) / "ckpt" / "iter_0000010")
    _save(backend, {**sharded_state(1, 1, 0, seed=1), "iteration": 10, "args": {"lr": 0.5}}, ck)
    assert json.loads((Path(ck) / "metadata.json").read_text())["sharded_backend"] == "tiercheck"
    pointer = json.loads((Path(ck) / tm.POINTER_FILE).read_text())
    assert (pointer["step"], pointer["local"]) == (10, ".")
    # The common (non-sharded) state is where Megatron's own reader finds it: up to 0.18 Megatron writes
    # common.pt itself; from 0.19 the strategy is handed it and writes Megatron's current format, a one-entry
    # DCP checkpoint (.metadata).
    written = {p.name for p in Path(ck).iterdir()} & {"common.pt", ".metadata"}
    release = tuple(int(x) for x in tm.MEGATRON_CORE_VERSION.split(".")[:2])
    assert written == ({"common.pt"} if release < (0, 19) else {".metadata"}), written
    assert dc.load_common_state_dict(ck) == {"iteration": 10, "args": {"lr": 0.5}}

    sd = sharded_state(1, 1, 0, seed=1, blank=True)
    loaded = _load(backend, sd, ck)
    assert loaded["iteration"] == 10 and loaded["args"] == {"lr": 0.5}
    assert check_loaded(sd, loaded, seed=1, rank=0) == N_TENSORS
    assert set(tiercheck.load(ck)) == {"tensors", "objects"}  # a plain tiercheck step, readable without Megatron

    bad = Path(root) / "ckpt" / "iter_0000011"
    shutil.copytree(ck, bad)
    flip_chunk_byte(bad / "step-00000010", "tensors/embed", chunks_of(bad / "step-00000010", "tensors/embed")[0], 0)
    with pytest.raises(tiercheck.CorruptCheckpointError, match=r"tensors/embed.*chunk"):
        _load(backend, sharded_state(1, 1, 0, seed=1, blank=True), str(bad))

    odd = {"config": ShardedObject("config", {"ratio": fractions.Fraction(1, 3)}, (1,), (0,))}
    with pytest.raises(tiercheck.UnsupportedValueError, match="allow_pickle"):
        _save(backend, odd, _new_dir(Path(root) / "ckpt" / "odd-a"))
    backend = tm.install(allow_pickle=True)
    pickled = _new_dir(Path(root) / "ckpt" / "odd-b")
    _save(backend, odd, pickled)
    backend = tm.install()
    with pytest.raises(tiercheck.UnsafeCheckpointError):
        _load(backend, {"config": ShardedObject("config", None, (1,), (0,))}, pickled)
    backend = tm.install(allow_pickle=True)
    assert (
        _load(backend, {"config": ShardedObject("config", None, (1,), (0,))}, pickled)["config"]["ratio"]
        == odd["config"].data["ratio"]
    )


def _load_tp2_and_pp2(rank: int, world: int, root: str) -> list[int]:
    backend = tm.install()
    counts = []
    for tp, pp in ((2, 1), (1, 2)):
        sd = sharded_state(tp, pp, rank, seed=1, blank=True, per_rank=False)
        loaded = _load(backend, sd, str(Path(root) / "ckpt" / "iter_0000010"))
        counts.append(check_loaded(sd, loaded, seed=1, rank=rank))
    # Switching back: what was loaded through tiercheck, saved in Megatron's own torch_dist format,
    # loads without tiercheck's strategy (metadata.json names torch_dist).
    native = _new_dir(Path(root) / "ckpt" / "native")
    _may_have_children()
    _cpu_only()  # Megatron's own writer
    dc.save({**sd, "iteration": 10}, native, sharded_strategy=("torch_dist", 1))
    assert json.loads((Path(native) / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    again = sharded_state(1, 2, rank, seed=1, blank=True, per_rank=False)
    # (Megatron's own loader returns some pieces as new tensors rather than filling them in place.)
    assert check_loaded(again, dc.load(again, native), seed=1, rank=rank, in_place=False) == counts[-1]
    if not tm.HAS_STRATEGY_REGISTRY:  # 0.17+: tiercheck's load strategy stands in for torch_dist's
        again = sharded_state(1, 2, rank, seed=1, blank=True, per_rank=False)
        loaded = dc.load(again, native, sharded_strategy=backend.load_strategy)
        assert check_loaded(again, loaded, seed=1, rank=rank, in_place=False) == counts[-1]
        assert loaded["iteration"] == 10
    return counts


def _save_tp2(rank: int, world: int, root: str) -> dict[str, Any]:
    """TP2, a node directory per rank, draining to a remote: a sync save, then an async one through
    Megatron's AsyncCallsQueue; a re-save after an unfinished one; loaded back at TP2 (and PP2)."""
    backend = tm.install(local=Path(root) / f"node{rank}", remote=(Path(root) / "remote").as_uri())
    ck1, ck2 = (_new_dir(Path(root) / "ckpt" / f"iter_000000{i}") for i in (1, 2))
    _save(backend, sharded_state(2, 1, rank, seed=1), ck1)

    _may_have_children()
    _cpu_only()  # Megatron's AsyncCallsQueue synchronizes CUDA before it forks its caller (0.19)
    queue = AsyncCallsQueue(persistent=False)
    request = _save(backend, {**sharded_state(2, 1, rank, seed=2), "iteration": 2}, ck2, async_sharded_save=True)
    queue.schedule_async_request(request)
    assert not (Path(ck2) / "metadata.json").exists()  # written by a finalize function, on this thread
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert json.loads((Path(ck2) / "metadata.json").read_text())["sharded_backend"] == "tiercheck"
    assert dc.load_common_state_dict(ck2) == {"iteration": 2}

    # A save that committed but was never finalized (the job died first), then the restarted job saves the
    # same iteration into the same directory: it gets the next free tiercheck step; tiercheck.json says which.
    ck3 = _new_dir(Path(root) / "ckpt" / "iter_0000003")
    orphan = _save(backend, sharded_state(2, 1, rank, seed=3), ck3, async_sharded_save=True)
    orphan.async_fn()  # waits for tiercheck's commit; the finalize functions never run
    _save(backend, sharded_state(2, 1, rank, seed=4), ck3)
    assert json.loads((Path(ck3) / tm.POINTER_FILE).read_text())["step"] == 4

    counts = []
    for ck, seed, (tp, pp) in ((ck1, 1, (2, 1)), (ck2, 2, (2, 1)), (ck3, 4, (2, 1)), (ck2, 2, (1, 2))):
        sd = sharded_state(tp, pp, rank, seed=seed, blank=True)
        counts.append(check_loaded(sd, _load(backend, sd, ck), seed=seed, rank=rank))
    backend.close()  # waits for the drains to the remote
    return {"counts": counts, "step": json.loads((Path(ck2) / tm.POINTER_FILE).read_text())["step"]}


def _load_tp1_from_remote(rank: int, world: int, root: str) -> int:
    """A new node (an empty directory) loads the TP2 checkpoint at TP1: every chunk from the remote."""
    backend = tm.install(local=Path(root) / "new-node", remote=(Path(root) / "remote").as_uri())
    sd = sharded_state(1, 1, 0, seed=2, blank=True, per_rank=False)
    return check_loaded(sd, _load(backend, sd, str(Path(root) / "ckpt" / "iter_0000002")), seed=2, rank=0)


# ------------------------------------------------------------------------------------ tests


def test_tp1_save_load_objects_corruption_then_load_at_tp2_and_pp2(tmp_path: Path) -> None:
    _launch(_save_tp1, 1, str(tmp_path))
    # TP2: every rank holds half of each layer; PP2: rank 0 the embedding and layer 0, rank 1 layer 1.
    assert _launch(_load_tp2_and_pp2, 2, str(tmp_path)) == [[N_TENSORS, 1 + 4], [N_TENSORS, 4]]


def test_tp2_sync_and_async_saves_replicas_once_then_load_at_tp1_from_remote(tmp_path: Path) -> None:
    (result, _) = _launch(_save_tp2, 2, str(tmp_path))
    assert result == {"counts": [N_TENSORS] * 3 + [1 + 4], "step": 2}  # the last: rank 0 of PP2

    # Each chunk was written once, by one of the ranks holding it: the norm's replicas (both TP ranks hold
    # all of it) and all else add up to the global tensors' bytes exactly, spread over the two nodes.
    written: dict[str, int] = {}
    for node in ("node0", "node1"):
        step = tmp_path / node / "step-00000002"
        for part in step_parts(step):
            for array, offsets in part.offsets.items():
                if not array.startswith("tensors/"):
                    continue
                for key in offsets:
                    rel = str(Path(array).relative_to("tensors") / key)
                    assert rel not in written, f"{rel} written on both nodes"
                    written[rel] = part.chunk_bytes[array]
    assert sum(written.values()) == sum(t.nbytes for t in global_tensors(2).values())
    assert all(any(k.startswith(f"{key}/") for k in written) for key in TENSOR_KEYS)

    assert _launch(_load_tp1_from_remote, 1, str(tmp_path)) == [N_TENSORS]


def _memory_round_trip(rank: int, world: int, root: str, shm: str) -> int:
    """install(local=..., memory=MemoryOptions(...)): a save committed in memory; with the local copy gone (the
    clean close persisted it), a new backend loads the step from memory."""
    memory = tiercheck.MemoryOptions(path=shm, persist_every=1000, keep_at_close=True)
    with pytest.raises(tiercheck.errors.InvalidArgumentError, match="needs local="):
        tm.install(memory=memory)
    local = Path(root) / "local"
    backend = tm.install(local=local, memory=memory)
    _save(backend, sharded_state(1, 1, 0, seed=4), _new_dir(Path(root) / "ckpt" / "iter_0000010"))
    assert backend._roots[(str(local), None)].ckpt.steps() == []  # in memory only
    backend.close()
    shutil.rmtree(local / "step-00000010")
    backend = tm.install(local=local, memory=memory)
    sd = sharded_state(1, 1, 0, seed=4, blank=True)
    n = check_loaded(sd, _load(backend, sd, str(Path(root) / "ckpt" / "iter_0000010")), seed=4, rank=0)
    backend.close()
    assert (local / "step-00000010").is_dir()  # the step restored from memory is persisted again
    return n


def test_with_the_memory_tier_a_step_on_no_disk_loads_from_memory(tmp_path: Path) -> None:
    with private_shm() as shm:
        assert _launch(_memory_round_trip, 1, str(tmp_path), str(shm)) == [N_TENSORS]


def test_layouts_name_pieces_independently_of_tp() -> None:
    """TP2's and TP1's pieces of a SwiGLU fc1 land in the same arrays (one per layer and half), as views."""
    tp2 = [st for st in _fc1_pieces(sharded_state(2, 1, 1, seed=3))]
    tp1 = [st for st in _fc1_pieces(sharded_state(1, 1, 0, seed=3))]
    lay2, lay1 = tm.layouts_of(tp2)["layers.fc1"], tm.layouts_of(tp1)["layers.fc1"]
    assert lay2 == lay1 == tm.KeyLayout("float32", (LAYERS, 2 * FFN, HIDDEN), prepend=1, parts=(0, 2))
    places = {place for st in tp2 for place, _ in tm.shard_pieces(st, lay2)}
    assert places == {(str(i), f"part{j}") for i in range(LAYERS) for j in range(2)}
    (place, piece), *_ = tm.shard_pieces(tp2[1], lay2)  # layer 0, the up half of TP rank 1
    assert place == ("0", "part1") and piece.offsets == (FFN // 2, 0) and piece.global_shape == (FFN, HIDDEN)
    assert piece.local.data_ptr() == tp2[1].data.data_ptr()  # restoring writes into the model's tensor


def test_flattened_and_mismatched_tensors_are_refused_by_name() -> None:
    st = ShardedTensor.from_rank_offsets("decoder.opt.exp_avg", torch.zeros(4))
    st.flattened_range = slice(0, 4)  # Megatron 0.16 refuses to build these; older releases made them
    with pytest.raises(tiercheck.UnsupportedValueError, match="decoder.opt.exp_avg"):
        tm.layouts_of([st])
    small = tm.KeyLayout("float32", (3,))
    with pytest.raises(tiercheck.IncompatibleStateError, match=r"'w'.*\[3\].*\[4\]"):
        tm.shard_pieces(ShardedTensor.from_rank_offsets("w", torch.zeros(4)), small, clip=True)
    padded = ShardedTensor.from_rank_offsets("w", torch.zeros(4), allow_shape_mismatch=True)
    ((_, piece),) = tm.shard_pieces(padded, small, clip=True)  # a padded vocabulary: load what is stored
    assert piece.local.shape == (3,)
    with pytest.raises(TypeError, match="unknown Checkpointer option"):
        tm.install(retain=3)


def _fc1_pieces(sd: dict[str, Any]) -> list[Any]:
    return [st for layer in sd["layers"].values() for st in layer["fc1"]]
