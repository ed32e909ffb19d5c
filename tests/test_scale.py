"""A 32-rank save restored onto 16 ranks with another layout, with real processes (gloo, CPU).

The model and its layouts are those of test_distributed (Megatron's rank order: TP fastest, then
DP, then PP). On top of them every rank holds its DP partition of a distributed optimizer's flat
fp32 buffer, split DeepSpeed-style (equal parts, the last one short) over the DP ranks and
replicated over TP and PP. The restoring job changes every dimension (TP 4 -> 8, PP 2 -> 1,
DP 4 -> 2) and runs on as many nodes as the saving job, two ranks a node instead of four, so each
node directory is seen by two restoring ranks and every chunk written on another node has to
come over the process group.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tiercheck import Shard

from .distributed import run_ranks
from .test_distributed import Layout, check_model, global_tensors, model_state, node_dir

FLAT = 1001  # the optimizer's flat buffer: odd, so that no DP split is even


def flat_buffer(seed: int) -> torch.Tensor:
    return torch.randn(FLAT, generator=torch.Generator().manual_seed(seed + 1000))


def scale_state(layout: Layout, rank: int, *, seed: int, fill: float | None = None) -> dict[str, Any]:
    """model_state, plus this rank's DP partition of the flat optimizer buffer."""
    state = model_state(layout, rank, seed=seed, fill=fill)
    _, d, _ = layout.coords(rank)
    part = math.ceil(FLAT / layout.dp)
    a, b = min(d * part, FLAT), min((d + 1) * part, FLAT)
    local = flat_buffer(seed)[a:b].clone()
    if fill is not None:
        local.fill_(fill)
    state["optim"] = {"fp32_flat": Shard(local, global_shape=(FLAT,), offsets=(a,))}
    return state


def _tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    values = [*state["model"].values(), *state["optim"].values()]
    return [v.local if isinstance(v, Shard) else v for v in values]


def _save(rank: int, world: int, layout: Layout, root: str, per_node: int) -> int:
    """Step 1 holds seed 1's values, step 2 seed 2's: a restore of step 2 cannot pass with step 1's bytes."""
    state = scale_state(layout, rank, seed=1)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, per_node)) as ck:
        ck.save(1).wait()
        for dst, src in zip(_tensors(state), _tensors(scale_state(layout, rank, seed=2)), strict=True):
            dst.copy_(src)
        state["iteration"] = 2
        ck.save(2).wait()
        return ck.stats()["plan_bytes_per_save"]


def _restore(rank: int, world: int, layout: Layout, root: str, per_node: int) -> dict[str, Any]:
    state = scale_state(layout, rank, seed=0, fill=-1.0)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, per_node)) as ck:
        step = ck.restore()
        n = check_model(state, 2)
        flat = state["optim"]["fp32_flat"]
        a = flat.offsets[0]
        assert torch.equal(flat.local, flat_buffer(2)[a : a + flat.local.numel()])
        stats = ck.stats()
    return {
        "step": step,
        "tensors": n + 1,
        "rank_info": state["rank_info"],
        "iteration": state["iteration"],
        "read": stats["restore_bytes_read"],
        "received": stats["restore_chunks_received"],
    }


SAVE = Layout(tp=4, pp=2, dp=4)  # 32 ranks, 4 a node: nodes 0-7
RESTORE = Layout(tp=8, pp=1, dp=2)  # 16 ranks, 2 a node: the same nodes 0-7


@pytest.mark.slow
@pytest.mark.timeout(420)  # ~40 s here (2 cores); each launch below is bounded at 180 s
def test_32_ranks_on_8_nodes_restore_onto_16_ranks_with_another_layout(tmp_path: Path) -> None:
    root = str(tmp_path)
    planned = run_ranks(_save, SAVE.world, SAVE, root, 4, timeout=180, pg_timeout=120)
    unique = sum(t.nbytes for t in global_tensors(2).values()) + flat_buffer(2).nbytes
    # Every chunk is written once, replicas or not. The flat buffer's chunks are its DP parts (251 elements), and
    # zarr stores the short last one (248) full size.
    padding = (math.ceil(FLAT / SAVE.dp) * SAVE.dp - FLAT) * 4
    assert sum(planned) == unique + padding
    committed = sorted(p.parent.parent.name for p in tmp_path.glob("node*/step-00000002/COMMIT"))
    assert committed == [f"node{j}" for j in range(8)]

    results = run_ranks(
        _restore, RESTORE.world, RESTORE, root, 2, timeout=180, pg_timeout=120
    )
    for rank, r in enumerate(results):
        assert r["step"] == 2
        # embed, 4 layers of 3 tensors (PP 1: every rank holds every layer), the flat buffer; checked bit for bit inside
        assert r["tensors"] == 1 + 3 * 4 + 1
        assert r["rank_info"] == {"rank": rank, "coords": list(SAVE.coords(rank))}  # saving rank r's plain values
        assert r["iteration"] == 2
    assert sum(r["read"] for r in results) >= unique
    assert all(r["received"] > 0 for r in results)  # each rank needs chunks that only other nodes hold
