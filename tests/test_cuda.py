"""The CUDA path: pinned pool, side-stream copies, lazy staging fenced before optimizer.step().

Runs only where a CUDA device exists (marker ``gpu``); elsewhere pytest reports these as skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tiercheck
from tests.conftest import assert_identical
from tiercheck import Checkpointer, StagingOptions, WriteOptions

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
