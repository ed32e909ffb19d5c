"""Sharded saves and resharding restores with real processes (gloo, CPU), one directory per node.

A "model" here is a set of global tensors fixed by a seed. A layout (TP x PP x DP, Megatron's rank
order: TP fastest, then DP, then PP) decides which slice of which tensor each rank holds, as a
``tiercheck.Shard``. Saving on one layout and restoring on another must give every rank exactly
the slices of the saved global tensors that its new layout asks for.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tiercheck import Shard
from tiercheck.format.codec import unseal
from tiercheck.format.manifest import parse_rank_part
from tiercheck.format.paths import pack_file, part_file
from tiercheck.format.steps import read_manifest
from tiercheck.tiers.local import LocalTier

from .distributed import run_ranks
from .ondisk import flip_chunk_byte, resign_index, step_parts

LAYERS = 4
HIDDEN = 8
FFN = 12
VOCAB = 16


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)


def global_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {"embed": torch.randn(VOCAB, HIDDEN, generator=g)}
    for i in range(LAYERS):
        out[f"layers.{i}.fc1"] = torch.randn(FFN, HIDDEN, generator=g)  # column parallel: rows split
        out[f"layers.{i}.fc2"] = torch.randn(HIDDEN, FFN, generator=g).to(torch.bfloat16)  # row parallel: cols split
        out[f"layers.{i}.norm"] = torch.randn(HIDDEN, generator=g)  # replicated over TP
    return out


def _split(extent: int, parts: int, i: int) -> tuple[int, int]:
    """torch.tensor_split's boundaries: uneven parts differ by one, larger first."""
    bounds = [0, *(b.numel() for b in torch.arange(extent).tensor_split(parts))]
    start = sum(bounds[: i + 1])
    return start, start + bounds[i + 1]


def _shard(full: torch.Tensor, dim: int, parts: int, i: int, fill: float | None) -> Shard:
    a, b = _split(full.shape[dim], parts, i)
    local = full.narrow(dim, a, b - a).clone()
    if fill is not None:
        local.fill_(fill)
    offsets = [0] * full.dim()
    offsets[dim] = a
    return Shard(local, global_shape=full.shape, offsets=offsets)


def model_state(layout: Layout, rank: int, *, seed: int, fill: float | None = None) -> dict[str, Any]:
    """What ``rank`` holds under ``layout``; with ``fill``, the right shapes but junk values."""
    t, _, p = layout.coords(rank)
    full = global_tensors(seed)
    stage_layers = [i for i in range(LAYERS) if i * layout.pp // LAYERS == p]
    model: dict[str, Any] = {}
    if p == 0:
        model["embed"] = _shard(full["embed"], 0, layout.tp, t, fill)
    for i in stage_layers:
        model[f"layers.{i}.fc1"] = _shard(full[f"layers.{i}.fc1"], 0, layout.tp, t, fill)
        model[f"layers.{i}.fc2"] = _shard(full[f"layers.{i}.fc2"], 1, layout.tp, t, fill)
        norm = full[f"layers.{i}.norm"].clone()
        model[f"layers.{i}.norm"] = norm.fill_(fill) if fill is not None else norm
    return {"model": model, "rank_info": {"rank": rank, "coords": list(layout.coords(rank))}, "iteration": seed}


def check_model(state: dict[str, Any], seed: int) -> int:
    """Every tensor equals its slice of the seed's global tensors, bit for bit. Returns how many."""
    full = global_tensors(seed)
    for name, value in state["model"].items():
        if isinstance(value, Shard):
            idx = tuple(slice(o, o + n) for o, n in zip(value.offsets, value.local.shape, strict=True))
            assert torch.equal(value.local, full[name][idx]), name
        else:
            assert torch.equal(value, full[name]), name
    return len(state["model"])


def node_dir(root: str, rank: int, ranks_per_node: int) -> str:
    return os.path.join(root, f"node{rank // ranks_per_node}")


def _save(
    rank: int, world: int, layout: Layout, root: str, per_node: int, steps: list[int], seed: int, take_over: bool = False
) -> Any:
    """A job that saves ``steps`` of a state made from ``seed``; ``take_over``: in directories
    holding an earlier job's steps, without restoring them (it starts a lineage of its own)."""
    state = model_state(layout, rank, seed=seed)
    write = tiercheck.WriteOptions(take_over=take_over)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, per_node), write=write) as ck:
        for s in steps:
            ck.save(s, metadata={"note": "test"}).wait()
        return ck.stats()["plan_bytes_per_save"]


def _restore(
    rank: int,
    world: int,
    layout: Layout,
    root: str,
    per_node: int,
    seed: int,
    read_once: bool = False,
    in_place: bool = False,
    share_memory: bool = True,
) -> tuple[int | None, int, dict[str, Any], int, int, int]:
    state = model_state(layout, rank, seed=seed, fill=-1.0)
    opts = tiercheck.DistributedOptions(read_once=read_once, share_memory=share_memory)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, per_node), distributed=opts) as ck:
        step = ck.restore(in_place=in_place)
        n = check_model(state, seed) if step is not None else 0
        stats = ck.stats()
        received, shared = stats["restore_chunks_received"], stats["restore_chunks_shared"]
        return step, n, state["rank_info"], stats["restore_bytes_read"], received, shared


SAVED = Layout(tp=2, pp=2, dp=2)


@pytest.fixture(scope="module")
def saved_8(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Steps 1 and 2 saved by TP=2 x PP=2 x DP=2 on 8 ranks, two ranks per node (4 node dirs)."""
    root = str(tmp_path_factory.mktemp("tp2pp2dp2"))
    run_ranks(_save, 8, SAVED, root, 2, [1, 2], 2)
    return root


@pytest.mark.parametrize(
    ("layout", "per_node", "read_once", "in_place", "share_memory"),
    [
        (Layout(tp=4, pp=1, dp=1), 2, False, False, True),
        (Layout(tp=4, pp=1, dp=1), 2, False, False, False),  # every chunk received over gloo
        (Layout(tp=4, pp=1, dp=1), 2, True, False, True),
        (Layout(tp=4, pp=1, dp=1), 2, True, True, True),  # chunks read and received into the live shards
        (Layout(tp=3, pp=1, dp=1), 1, False, False, True),  # uneven splits, 3 nodes
        (Layout(tp=1, pp=1, dp=1), 1, False, False, True),
        (Layout(tp=2, pp=2, dp=2), 2, False, False, False),  # the same layout
    ],
    ids=["tp4", "tp4-gloo", "tp4-read-once", "tp4-read-once-in-place", "tp3-uneven", "single", "same-gloo"],
)
def test_restore_onto_another_layout_is_bit_identical(
    saved_8: str, tmp_path: Path, layout: Layout, per_node: int, read_once: bool, in_place: bool, share_memory: bool
) -> None:
    # The new job has fewer nodes; each was given the files of some of the old nodes (as a pre-staging
    # copy would), so that together they hold every chunk, but no node holds all of them.
    root = str(tmp_path)
    n_nodes = math.ceil(layout.world / per_node)
    for j in range(4):
        _merge_into(Path(saved_8) / f"node{j}", tmp_path / f"node{j % n_nodes}")
    results = run_ranks(
        _restore, layout.world, layout, root, per_node, 2, read_once, in_place, share_memory
    )
    for rank, (step, n, info, _, _, _) in enumerate(results):
        assert step == 2
        assert n > 0
        if layout.world == SAVED.world:
            assert info == {"rank": rank, "coords": list(SAVED.coords(rank))}  # each rank's own plain values
        else:
            assert info["rank"] == rank  # rank r's plain values come from saving rank r
    read = sum(r[3] for r in results)
    received = sum(r[4] for r in results)
    shared = sum(r[5] for r in results)
    unique = sum(t.nbytes for t in global_tensors(2).values())
    if layout.world == 1:
        assert (read, received) == (unique, 0)
    else:
        # Each chunk is on one node here: read there once (read_once or not), the rest sent. All
        # ranks share this host: every chunk received comes through shared memory unless told not to.
        assert read == unique and received > 0
        assert shared == (received if share_memory else 0)


def test_each_chunk_is_written_once_and_replicas_share_the_writing(saved_8: str) -> None:
    nodes = sorted(Path(saved_8).glob("node*"))
    assert len(nodes) == 4
    indexes = [json.loads((n / "step-00000002" / "manifest.json").read_bytes()) for n in nodes]
    assert all(m == indexes[0] for m in indexes), "every node has the same index"
    assert indexes[0]["format_version"] == 5
    # Each node holds the manifest parts of its own ranks only (a commit moves no rank's part elsewhere).
    for i, n in enumerate(nodes):
        parts = sorted(f.name for f in (n / "step-00000002" / "manifest").glob("rank-*.json"))
        assert parts == [f"rank-{r:06d}.json" for r in (2 * i, 2 * i + 1)]
    merged = Path(saved_8) / "merged"
    for n in nodes:
        shutil.copytree(n / "step-00000002", merged / "step-00000002", dirs_exist_ok=True)
    manifest = read_manifest(LocalTier(merged), 2)
    arrays = {path: rec.to_json() for path, rec in manifest.arrays.items()}
    unique = sum(t.nbytes for t in global_tensors(2).values())
    itemsizes = {"float32": 4, "bfloat16": 2}
    stored = sum(len(a["crc32c"]) * math.prod(a["chunks"]) * itemsizes[a["dtype"]] for a in arrays.values())
    assert stored == unique  # the grid matches the shards: no padding, no second copy

    files: dict[str, list[str]] = {}
    on_disk = 0
    for n in nodes:
        here = 0
        for part in step_parts(n / "step-00000002"):
            for array, offsets in part.offsets.items():
                for key in offsets:
                    files.setdefault(f"{array}/{key}", []).append(n.name)
                    on_disk += part.chunk_bytes[array]
                    here += part.chunk_bytes[array] + 4  # and its CRC32C trailer
        packs = (n / "step-00000002" / "packs").iterdir()
        assert sum(p.stat().st_size for p in packs) == here, "the node's packs hold what its parts list"
    assert on_disk == unique
    assert all(len(where) == 1 for where in files.values()), "no chunk is stored on two nodes"
    assert len(files) == sum(len(a["crc32c"]) for a in arrays.values())

    written = [0] * 8
    for a in arrays.values():
        for owner in a["owner"].values():
            written[owner] += math.prod(a["chunks"]) * itemsizes[a["dtype"]]
    assert all(w > 0 for w in written), f"every rank writes a share: {written}"
    # DP replicas hold the same shards; the plan splits them rather than leaving them to DP rank 0.
    for pp in range(2):
        for tp in range(2):
            pair = [written[pp * 4 + dp * 2 + tp] for dp in range(2)]
            assert max(pair) <= 2 * min(pair), f"replicas (tp={tp}, pp={pp}) wrote {pair}"


def _restore_embed_only(rank: int, world: int, root: str) -> tuple[bool, int]:
    full = global_tensors(2)["embed"]
    state = {"model": {"embed": Shard(torch.zeros(4, HIDDEN), global_shape=full.shape, offsets=(8, 0))}}
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, 1)) as ck:
        assert ck.restore(strict=False) == 2
        return torch.equal(state["model"]["embed"].local, full[8:12]), ck.stats()["restore_bytes_read"]


def test_only_the_chunks_a_rank_needs_are_read(saved_8: str, tmp_path: Path) -> None:
    for j in range(4):
        _merge_into(Path(saved_8) / f"node{j}", tmp_path / "node0")
    [(ok, nbytes)] = run_ranks(_restore_embed_only, 1, str(tmp_path))
    assert ok
    assert nbytes == 8 * HIDDEN * 4  # the one saved TP shard (rows 8-15) that holds rows 8-11; nothing else


# ---------------------------------------------------------------------------------- ZeRO, DTensor


def _zero_state(rank: int, world: int, numel: int, fill: float | None) -> dict[str, Any]:
    flat = torch.arange(numel, dtype=torch.float32) * 0.5
    part = math.ceil(numel / world)  # DeepSpeed-style equal partitions, the last one short
    a, b = min(rank * part, numel), min((rank + 1) * part, numel)
    local = flat[a:b].clone()
    if fill is not None:
        local.fill_(fill)
    return {"optim": {"fp32_flat": Shard(local, global_shape=(numel,), offsets=(a,)), "step": 10}}


def _zero(rank: int, world: int, root: str, save: bool) -> bool:
    state = _zero_state(rank, world, 1001, None if save else 0.0)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, 1)) as ck:
        if save:
            ck.save(5).wait()
            return True
        assert ck.restore() == 5
    expect = _zero_state(rank, world, 1001, None)["optim"]["fp32_flat"]
    return torch.equal(state["optim"]["fp32_flat"].local, expect.local) and state["optim"]["step"] == 10


def test_zero1_partitions_over_4_ranks_restore_on_2(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    assert run_ranks(_zero, 4, str(old), True) == [True] * 4
    for j in range(4):  # node k of the 2-rank job holds what nodes k and k+2 of the 4-rank job wrote
        _merge_into(old / f"node{j}", new / f"node{j % 2}")
    assert run_ranks(_zero, 2, str(new), False) == [True] * 2


def _merge_into(src: Path, dst: Path) -> None:
    """Hard-link one node directory's files into another; commit markers name the ranks of both."""
    for f in src.rglob("*"):
        if f.is_dir() or f.name == ".tiercheck-node":
            continue
        target = dst / f.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        if f.name == "COMMIT":
            marker = json.loads(f.read_text())
            if target.exists():
                marker["ranks"] = sorted(set(marker["ranks"]) | set(json.loads(target.read_text())["ranks"]))
            target.write_text(json.dumps(marker))
        elif not target.exists():
            os.link(f, target)


def _dtensor(
    rank: int, world: int, root: str, per_node: int, mesh_shape: list[int], placements: list[str], save: bool
) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor import Shard as DShard

    mesh = init_device_mesh("cpu", tuple(mesh_shape))
    place = [Replicate() if p == "R" else DShard(int(p[1:])) for p in placements]
    full = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6) / 7
    w = distribute_tensor(full if save else torch.zeros_like(full), mesh, place)
    state = {
        "w": w,
        "bias": distribute_tensor(torch.ones(6) * (1 if save else 0), mesh, [Replicate()] * len(mesh_shape)),
    }
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, per_node)) as ck:
        if save:
            ck.save(1).wait()
            return True
        assert ck.restore() == 1
    return torch.equal(state["w"].full_tensor(), full) and torch.equal(state["bias"].full_tensor(), torch.ones(6))


def test_dtensor_2d_mesh_restores_onto_a_1d_mesh(tmp_path: Path) -> None:
    root = str(tmp_path)
    assert run_ranks(_dtensor, 4, root, 2, [2, 2], ["S0", "S1"], True) == [True] * 4
    # The 2-rank job runs on the same two nodes, one rank each.
    assert run_ranks(_dtensor, 2, root, 1, [2], ["S1"], False) == [True] * 2


# ------------------------------------------------------------------------------ failures and loss

SMALL = Layout(tp=2, pp=1, dp=2)  # 4 ranks on 2 nodes: DP replicas on different nodes


def _save_and_die(rank: int, world: int, root: str, victim: int) -> str:
    state = model_state(SMALL, rank, seed=1)
    # The dead rank is found out at this timeout; 5 s was too short for step 1's planning on a loaded
    # 2-core machine (a rank gave up waiting for the plan before any rank died).
    opts = tiercheck.DistributedOptions(timeout_s=15)
    ck = tiercheck.Checkpointer(state, local=node_dir(root, rank, 2), distributed=opts)
    ck.save(1).wait()
    for value in state["model"].values():
        (value.local if isinstance(value, Shard) else value).fill_(99.0)
    if rank == victim:
        write = ck.tier.write

        def write_then_die(path: str, parts: Any) -> None:
            write(path, parts)
            os._exit(17)  # dies after its first file of step 2, like a SIGKILL: no cleanup at all

        ck.tier.write = write_then_die  # type: ignore[method-assign]
    handle = ck.save(2)
    try:
        handle.wait()
        return "committed"
    except tiercheck.CoordinationError as e:
        return f"failed: {e}"
    finally:
        ck.close()


@pytest.mark.parametrize("victim", [0, 3], ids=["node-leader", "other-rank"])
def test_a_rank_killed_mid_save_commits_nothing_and_the_previous_step_restores(tmp_path: Path, victim: int) -> None:
    outcomes = run_ranks(_save_and_die, 4, str(tmp_path), victim, check=False)
    assert outcomes[victim].exitcode == 17
    for o in outcomes:
        if o.rank != victim:
            assert o.error is None, o.error
            assert o.result.startswith("failed: "), o.result
            assert "step 2 was not committed" in o.result
    assert not list(tmp_path.glob("node*/step-00000002/COMMIT"))
    results = run_ranks(_restore, 4, SMALL, str(tmp_path), 2, 1)
    assert [r[0] for r in results] == [1, 1, 1, 1]  # values checked bit for bit against step 1 inside


def _restore_or_error(rank: int, world: int, root: str) -> tuple[int | None, str]:
    state = model_state(SMALL, rank, seed=1, fill=0.0)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, 2)) as ck:
        try:
            step = ck.restore()
        except tiercheck.CheckpointNotFoundError as e:
            return None, str(e)
        check_model(state, 1)
        return step, ""


def test_a_wiped_node_makes_ranks_agree_on_an_older_step_or_say_what_is_missing(tmp_path: Path) -> None:
    run_ranks(_save, 4, SMALL, str(tmp_path), 2, [1, 2], 1)
    # Node 1 lost its copy of step 2 only: step 1 is whole everywhere, so every rank takes it.
    shutil.rmtree(tmp_path / "node1" / "step-00000002")
    assert run_ranks(_restore_or_error, 4, str(tmp_path)) == [(1, "")] * 4
    # Node 1 was replaced (empty directory): no step is whole, and every rank says what is missing.
    shutil.rmtree(tmp_path / "node1")
    for step, message in run_ranks(_restore_or_error, 4, str(tmp_path)):
        assert step is None
        assert "no committed step is whole" in message
        assert "newest: step 2: the files of saving rank(s) 2-3 are on no rank's local tier" in message
        assert "restoring rank(s) 2-3 have no copy of the step" in message


def _restore_mismatch(rank: int, world: int, root: str, case: str) -> tuple[str, str]:
    state = model_state(SMALL, rank, seed=1, fill=0.0)
    if rank == 1 and case == "shape":
        state["model"]["embed"] = Shard(torch.zeros(9, HIDDEN), global_shape=(18, HIDDEN), offsets=(9, 0))
    if rank == 1 and case == "absent":
        state["model"]["extra"] = torch.zeros(3)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, 2)) as ck:
        try:
            ck.restore()
        except tiercheck.TiercheckError as e:
            untouched = all(bool((v.local if isinstance(v, Shard) else v).eq(0).all()) for v in state["model"].values())
            return type(e).__name__, f"{e} untouched={untouched}"
    return "restored", ""


@pytest.mark.parametrize("case", ["shape", "absent"])
def test_an_incompatible_rank_fails_every_rank_before_anything_is_overwritten(tmp_path: Path, case: str) -> None:
    run_ranks(_save, 4, SMALL, str(tmp_path), 2, [1], 1)
    results = run_ranks(_restore_mismatch, 4, str(tmp_path), case)
    kind, message = results[1]
    assert kind == "IncompatibleStateError"
    if case == "shape":
        assert "model/embed: checkpoint has float32[16, 8], the state to restore into has float32[18, 8]" in message
    else:
        assert "tensors of the state are missing from the checkpoint: model/extra" in message
    for rank in (0, 2, 3):
        assert results[rank][0] == "CoordinationError"
        assert "rank 1 failed" in results[rank][1]
    assert all(m.endswith("untouched=True") for _, m in results)


def _restore_expect_failure(rank: int, world: int, root: str) -> tuple[str, str]:
    state = model_state(SMALL, rank, seed=1, fill=0.0)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, 2)) as ck:
        try:
            ck.restore(in_place=False)  # all or nothing: a job start would stream in
        except tiercheck.TiercheckError as e:
            return type(e).__name__, str(e)
    return "restored", ""


def test_a_corrupt_chunk_on_one_node_fails_every_rank_without_a_hang(tmp_path: Path) -> None:
    run_ranks(_save, 4, SMALL, str(tmp_path), 2, [1], 1)
    # A chunk written by a rank of node 1 that node 0's ranks need too (replicated norm, or a TP shard):
    # rank 2's part of the manifest, in node 1's directory, lists the checksums of what rank 2 wrote.
    raw = (tmp_path / "node1" / "step-00000001" / part_file(2)).read_bytes()
    written = parse_rank_part(unseal(raw, where="test"), where="test", save=None).checksums
    path, key = next((p, k) for p, crcs in sorted(written.items()) for k in crcs)
    flip_chunk_byte(tmp_path / "node1" / "step-00000001", path, key, 0)
    results = run_ranks(_restore_expect_failure, 4, str(tmp_path), timeout=60)
    kinds = {kind for kind, _ in results}
    assert kinds <= {"CorruptCheckpointError", "CoordinationError"} and "CorruptCheckpointError" in kinds
    assert all(f"array {path!r} chunk {key}" in message for _, message in results), results
    assert all("no other node holds a copy of saving rank(s) [2]' files" in message for _, message in results)


# ---------------------------------------------------------------------- training loops, plan cache


def _train(rank: int, world: int, root: str, phase: str) -> dict[str, Any]:
    """Data-parallel replicas of one model + Adam (lazy staging): save at step 3, restore, continue."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    data = torch.randn(6, 4, 8, generator=torch.Generator().manual_seed(1))

    def step(i: int) -> None:
        opt.zero_grad()
        model(data[i]).pow(2).mean().backward()
        opt.step()

    state = {"model": model, "optim": opt}
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, 1)) as ck:
        assert ck.lazy
        start = 0
        if phase == "resume":
            start = ck.restore() or 0
            assert start == 3
        for i in range(start, 6):
            if i == 3 and phase == "first":
                ck.save(3)
                # The plan is cached: steady-state saves exchange nothing with the other ranks.
                ck._coord.exchange = None  # type: ignore[assignment]
            step(i)
        ck.save(6).wait()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_data_parallel_replicas_with_adam_resume_bit_identically(tmp_path: Path) -> None:
    first = run_ranks(_train, 2, str(tmp_path / "a"), "first")
    for j in range(2):
        shutil.rmtree(tmp_path / "a" / f"node{j}" / "step-00000006")  # resume from step 3
    resumed = run_ranks(_train, 2, str(tmp_path / "a"), "resume")
    for a, b in zip(first, resumed, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _relayout(rank: int, world: int, root: str) -> tuple[int | None, bool, bool]:
    state = model_state(SMALL, rank, seed=1)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, 2)) as ck:
        ck.save(1).wait()
        # Every rank adds tensors: a new plan. A plain tensor is a replica (one rank writes it);
        # per_rank() makes it this rank's own slice of a [world, ...] tensor.
        state["model"]["head"] = torch.full((3,), 7.0)
        state["rng"] = tiercheck.per_rank(torch.full((2,), float(rank)))
        ck.save(2).wait()
    fresh = model_state(SMALL, rank, seed=1, fill=0.0)
    fresh["model"]["head"] = torch.zeros(3)
    fresh["rng"] = tiercheck.per_rank(torch.zeros(2))
    with tiercheck.Checkpointer(fresh, local=node_dir(root, rank, 2)) as ck:
        step = ck.restore()
        check_model({"model": {k: v for k, v in fresh["model"].items() if k != "head"}}, 1)
        return (
            step,
            torch.equal(fresh["model"]["head"], torch.full((3,), 7.0)),
            torch.equal(fresh["rng"].local, torch.full((1, 2), float(rank))),
        )


def test_a_layout_change_on_every_rank_makes_a_new_plan(tmp_path: Path) -> None:
    assert run_ranks(_relayout, 4, str(tmp_path)) == [(2, True, True)] * 4


# --------------------------------------------------------------------------------- remote tier


def _save_drain(rank: int, world: int, root: str, remote: str) -> dict[str, Any]:
    state = model_state(SMALL, rank, seed=5)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, 2), remote=remote) as ck:
        handle = ck.save(1)
        assert handle.drained.result(timeout=60) is True  # on every rank, uploader or not
        return ck.drain()


def _restore_remote(rank: int, world: int, root: str, remote: str) -> tuple[int | None, int]:
    state = model_state(SMALL, rank, seed=5, fill=0.0)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, 2), remote=remote) as ck:
        step = ck.restore()
        check_model(state, 5)
        return step, ck.stats()["restore_remote_reads"]


def test_nodes_drain_their_own_files_and_a_replaced_node_restores_from_the_remote(tmp_path: Path) -> None:
    remote = f"file://{tmp_path / 'shared'}"
    statuses = run_ranks(_save_drain, 4, str(tmp_path), remote)
    uploaded = [s["files_uploaded"] for s in statuses]
    assert uploaded[1] == uploaded[3] == 0 and uploaded[0] > 0 and uploaded[2] > 0  # one uploader per node
    marker = json.loads((tmp_path / "shared" / "step-00000001" / "COMMIT").read_text())
    assert marker["ranks"] == [0, 1, 2, 3]
    full = tiercheck.load(tmp_path / "shared")  # the remote copy is whole: global tensors
    for name, t in global_tensors(5).items():
        assert torch.equal(full["model"][name], t), name

    shutil.rmtree(tmp_path / "node1")  # node 1 was replaced: an empty local directory
    results = run_ranks(_restore_remote, 4, str(tmp_path), remote)
    assert [step for step, _ in results] == [1, 1, 1, 1]  # values checked against step 1 inside
    assert results[2][1] > 0 and results[3][1] > 0  # the replaced node's ranks read from the remote

    # A node whose own manifest files are damaged (here its second rank's part) reads the whole step
    # from the remote, as the replaced node did: the damage is one tier's, not the step's.
    part = tmp_path / "node0" / "step-00000001" / "manifest" / "rank-000001.json"
    part.write_bytes(part.read_bytes()[:-1])
    results = run_ranks(_restore_remote, 4, str(tmp_path), remote)
    assert [step for step, _ in results] == [1, 1, 1, 1]
    assert results[0][1] > 0 and results[1][1] > 0


def _two_groups(rank: int, world: int, root: str) -> tuple[int, float]:
    """Ranks {0, 1} and {2, 3} are separate jobs in one world (e.g. two pipeline stages that
    checkpoint on their own), each with its own Checkpointer on its own process group."""
    groups = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
    mine = groups[rank // 2]
    state = {"w": torch.full((4 + rank // 2,), float(rank // 2))}  # different layouts, same step
    with tiercheck.Checkpointer(state, local=os.path.join(root, f"g{rank // 2}"), process_group=mine) as ck:
        ck.save(1).wait()
        assert ck.world_size == 2
    state["w"].zero_()
    with tiercheck.Checkpointer(state, local=os.path.join(root, f"g{rank // 2}"), process_group=mine) as ck:
        return ck.restore() or -1, float(state["w"].sum())


def test_checkpointers_on_different_process_groups_do_not_mix(tmp_path: Path) -> None:
    assert run_ranks(_two_groups, 4, str(tmp_path)) == [(1, 0.0)] * 2 + [(1, 5.0)] * 2


def _alone(rank: int, world: int, root: str) -> float | None:
    """Only rank 0 checkpoints (a consolidated copy, say): no other rank has to take part."""
    if rank != 0:
        return None
    state = {"w": torch.arange(3.0)}
    opts = tiercheck.DistributedOptions(enabled=False)
    with tiercheck.Checkpointer(state, local=root, distributed=opts) as ck:
        ck.save(1).wait()
        assert (ck.rank, ck.world_size) == (0, 1)
    return float(tiercheck.load(root)["w"].sum())


def test_a_rank_may_checkpoint_alone(tmp_path: Path) -> None:
    assert run_ranks(_alone, 2, str(tmp_path)) == [3.0, None]


def test_verify_and_load_on_one_node_directory(saved_8: str, tmp_path: Path) -> None:
    """A node's directory holds its ranks' chunks and parts of the manifest: `tiercheck verify`
    checks every chunk they wrote (also of arrays another node coordinated), and `load` says the
    rest is elsewhere."""
    from tests.test_cli import run
    from tiercheck.cluster.coordination import shard_of

    # A chunk a rank of node k wrote, of an array a rank of another node coordinated.
    k, path, key = next(
        (k, p, key)
        for k in range(4)
        for w in (2 * k, 2 * k + 1)
        for p, crcs in sorted(_written(Path(saved_8) / f"node{k}", w).items())
        for key in crcs
        if shard_of(p, 8) // 2 != k
    )
    node = tmp_path / f"node{k}"
    shutil.copytree(Path(saved_8) / f"node{k}", node)
    assert run("verify", str(node), "--all").stdout.startswith("ok: steps 1, 2 intact")
    flip_chunk_byte(node / "step-00000002", path, key, 1)
    proc = run("verify", str(node), "--all", check=False)
    assert proc.returncode == 1
    assert f"damaged: step 2: array {path!r} chunk {key}: checksum mismatch" in proc.stderr
    with pytest.raises(tiercheck.CheckpointNotFoundError, match=r"saving rank\(s\) .* are in other nodes'"):
        tiercheck.load(node)


def _written(node: Path, rank: int) -> dict[str, dict[str, int]]:
    raw = (node / "step-00000002" / part_file(rank)).read_bytes()
    return parse_rank_part(unseal(raw, where="test"), where="test", save=None).checksums


def _commit_out_of_write_order(rank: int, world: int, root: str) -> list[int]:
    """On rank 1, step 1's refs file is written only after step 2's chunk was: step 2's writes end first
    there (its chunk holds no pool memory that step 2's staging would wait for)."""
    from tiercheck.save.pipeline import Pipeline

    if rank == 1:
        real = Pipeline._write
        later_written = threading.Event()

        def write(self: Pipeline, job: Any, write: Any) -> None:
            if job.step == 1 and write.staged is None:
                assert later_written.wait(60), "step 2 was never written"
            real(self, job, write)
            if job.step == 2 and write.staged is not None:
                later_written.set()

        Pipeline._write = write  # type: ignore[method-assign]
    state = {"w": Shard(torch.full((4,), float(rank)), global_shape=(8,), offsets=(4 * rank,))}
    opts = tiercheck.DistributedOptions(timeout_s=30)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, 1), distributed=opts) as ck:
        handles = [ck.save(1), ck.save(2)]
        for h in handles:
            h.wait()
        return ck.steps()


def test_saves_commit_in_save_order_whatever_order_their_writes_end(tmp_path: Path) -> None:
    """Committing step 2 first on a rank whose writes of it ended first deadlocked the job: the other
    ranks were waiting for that rank at step 1's commit."""
    assert run_ranks(_commit_out_of_write_order, 2, str(tmp_path)) == [[1, 2], [1, 2]]


def _drain_fails_on_one_node(rank: int, world: int, root: str, remote: str) -> str:
    if rank == 2:  # node 1's uploader: its upload fails for good (not a transient error)
        from tiercheck.tiering import drain

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise PermissionError("access denied to the bucket")

        drain.upload_step = broken  # type: ignore[assignment]
    state = model_state(SMALL, rank, seed=5)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, 2), remote=remote) as ck:
        handle = ck.save(1)
        handle.wait()
        error = handle.drained.exception(timeout=60)  # the retry deadline is 900 s: nobody waits it out
        ck.close(drain=False)
        return f"{type(error).__name__}: {error}"


def test_a_node_whose_drain_fails_tells_the_others_at_once(tmp_path: Path) -> None:
    """The other nodes waited for the remote commit that node's files would complete until the retry
    deadline (900 s by default); it now tells them it will not come."""
    remote = (tmp_path / "remote").as_uri()
    errors = run_ranks(_drain_fails_on_one_node, 4, str(tmp_path), remote)
    # The uploading node's own error: a file:// remote's OSError, as the library's (the cause's text kept).
    assert errors[2].startswith("RemoteStorageError: ") and errors[2].endswith("access denied to the bucket")
    for rank in (0, 1, 3):  # rank 0 waited for the commit; 1 and 3 follow their node's uploader
        assert "access denied to the bucket" in errors[rank], (rank, errors[rank])
    assert not (tmp_path / "remote" / "step-00000001" / "COMMIT").exists()


def _restore_timed(rank: int, world: int, root: str, timeout_s: float) -> tuple[str, str, float]:
    state = model_state(SMALL, rank, seed=1, fill=0.0)
    opts = tiercheck.DistributedOptions(timeout_s=timeout_s)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, 2), distributed=opts) as ck:
        t0 = time.monotonic()
        try:
            step = ck.restore(in_place=False)  # all or nothing: a job start would stream in
        except tiercheck.TiercheckError as e:
            return type(e).__name__, str(e), time.monotonic() - t0
        return "restored", str(step), time.monotonic() - t0


def _swap(step: Path, *names: Callable[[int], str]) -> None:
    for name in names:
        a, b = step / name(0), step / name(1)
        data = a.read_bytes()
        a.write_bytes(b.read_bytes())
        b.write_bytes(data)


@pytest.mark.parametrize("swapped", ["parts", "packs"])
def test_two_ranks_files_swapped_in_a_node_directory_fail_every_rank_at_once(tmp_path: Path, swapped: str) -> None:
    """Ranks 0 and 1 of node 0 once failed at once ("no checksum") and ranks 2-3 waited out the
    whole timeout. Now every rank learns of it at once: they fall back together, or, with no
    older step, all fail with the damage, well within a timeout of 120 s."""
    names = {"parts": part_file, "packs": pack_file}[swapped]
    run_ranks(_save, 4, SMALL, str(tmp_path), 2, [1, 2], 1)
    _swap(tmp_path / "node0" / "step-00000002", names)
    fell_back = run_ranks(_restore_timed, 4, str(tmp_path), 120.0, timeout=200)
    assert [(kind, text) for kind, text, _ in fell_back] == [("restored", "1")] * 4, fell_back
    assert all(took < 30 for _, _, took in fell_back), fell_back
    _swap(tmp_path / "node0" / "step-00000001", names)
    failed = run_ranks(_restore_timed, 4, str(tmp_path), 120.0, timeout=200)
    assert {kind for kind, _, _ in failed} == {"CorruptCheckpointError"}, failed
    assert all("no older committed step is whole to restore; step(s) 1 are damaged too" in t for _, t, _ in failed)
    assert all(took < 30 for _, _, took in failed), failed


def test_an_index_naming_another_world_size_is_refused_at_once_on_every_rank(tmp_path: Path) -> None:
    """Step 2's manifest.json says 8 ranks saved it, in a 4-rank job whose COMMITs say 4: every
    rank once blocked in the store instead of falling back."""
    run_ranks(_save, 4, SMALL, str(tmp_path), 2, [1, 2], 1)
    for node in ("node0", "node1"):
        step = tmp_path / node / "step-00000002"
        index = json.loads((step / "manifest.json").read_bytes())
        index["world_size"] = index["topology"]["world_size"] = 8
        resign_index(step, json.dumps(index).encode())
    results = run_ranks(_restore_timed, 4, str(tmp_path), 120.0, timeout=200)
    assert [(kind, text) for kind, text, _ in results] == [("restored", "1")] * 4, results
    assert all(took < 30 for _, _, took in results), results


def _fall_back_then_save_again(rank: int, world: int, root: str) -> tuple[int | None, int | None, int]:
    state = model_state(SMALL, rank, seed=1, fill=0.0)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, 2)) as ck:
        fell_back = ck.restore()
        check_model(state, 1)
        ck.save(2).wait()
    fresh = model_state(SMALL, rank, seed=7, fill=0.0)
    with tiercheck.Checkpointer(fresh, local=node_dir(root, rank, 2)) as ck:
        again = ck.restore()
        return fell_back, again, check_model(fresh, 1)


def test_a_step_passed_over_on_every_node_is_set_aside_when_the_run_saves_its_number_again(tmp_path: Path) -> None:
    """One chunk of step 2 rotted on node 1: every rank falls back to step 1, and saving step 2
    again (on both nodes: node 0's copy is no whole step either) once raised StepExistsError."""
    run_ranks(_save, 4, SMALL, str(tmp_path), 2, [1, 2], 1)  # one lineage: a take-over would disown step 1
    step2 = tmp_path / "node1" / "step-00000002"
    written = step_parts(step2)[0].checksums
    path, key = next((p, k) for p, crcs in sorted(written.items()) for k in crcs)
    flip_chunk_byte(step2, path, key, 0)
    results = run_ranks(_fall_back_then_save_again, 4, str(tmp_path))
    assert [(fell_back, again) for fell_back, again, _ in results] == [(1, 2)] * 4  # values checked inside
    for node in ("node0", "node1"):
        assert [p.name.split(".")[0] for p in (tmp_path / node / "set-aside").iterdir()] == ["step-00000002"]


DP4 = Layout(tp=1, pp=1, dp=4)


def _save_dp4(rank: int, world: int, root: str) -> None:
    for step in (1, 2):  # each step's values are its own seed's
        with tiercheck.Checkpointer(model_state(DP4, rank, seed=step), local=node_dir(root, rank, 1)) as ck:
            ck.save(step).wait()


def _restore_dp4(rank: int, world: int, root: str, seed: int) -> tuple[int | None, int, int, int]:
    state = model_state(DP4, rank, seed=seed, fill=-1.0)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, 1)) as ck:
        step = ck.restore(in_place=False)  # all or nothing: a job start would stream in
        check_model(state, seed)
        stats = ck.stats()
    held = sum(v.local.nbytes if isinstance(v, Shard) else v.nbytes for v in state["model"].values())
    return step, stats["restore_unstaged_bytes"], held, stats["restore_chunks_shared"]


def test_data_parallel_replicas_of_one_host_restore_from_shared_memory_all_or_nothing(tmp_path: Path) -> None:
    """Four replicas, a node each, on this one host: each node holds a quarter of the chunks, and
    every rank needs all of them. Each chunk is read once, into its reader's shared memory, and
    every rank copies it from there into its live tensors, with no staging memory; only once every
    chunk is verified. A damaged chunk fails the step on every rank before any tensor changes, and
    the older step restores whole."""
    root = str(tmp_path)
    run_ranks(_save_dp4, 4, root)
    results = run_ranks(_restore_dp4, 4, root, 2)
    for step, unstaged, held, shared in results:
        assert (step, unstaged) == (2, held) and shared > 0
    written = _written(tmp_path / "node1", 1)
    path = sorted(written)[0]
    flip_chunk_byte(tmp_path / "node1" / "step-00000002", path, sorted(written[path])[0], 0)
    assert run_ranks(_restore_dp4_damaged, 4, root) == [True] * 4
    fallback = run_ranks(_restore_dp4, 4, root, 1)  # step 1's values, bit for bit
    assert [r[0] for r in fallback] == [1, 1, 1, 1]


def _restore_dp4_damaged(rank: int, world: int, root: str) -> bool:
    """Step 2 asked for, and damaged: every rank fails, and no live tensor has changed."""
    state = model_state(DP4, rank, seed=2, fill=-1.0)
    with (
        tiercheck.Checkpointer(state, local=node_dir(root, rank, 1)) as ck,
        pytest.raises(tiercheck.CorruptCheckpointError, match="checksum mismatch"),
    ):
        ck.restore(step=2, in_place=False)  # all or nothing
    return all(bool(((v.local if isinstance(v, Shard) else v) == -1).all()) for v in state["model"].values())
