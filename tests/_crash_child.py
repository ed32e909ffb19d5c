"""The saving process of the crash tests (forked from ``tests/distributed.py``'s fork server): saves forever,
announcing each commit through a pipe.

Step s holds tensors whose content is a function of s alone, so the parent can check that
whatever is committed after a SIGKILL is exactly the state of that step.
"""

from __future__ import annotations

from multiprocessing.connection import Connection

import torch

from tiercheck import Checkpointer, RetentionOptions, StagingOptions, WriteOptions


def content(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(512, 1024, generator=g),  # 2 MiB, 8 chunks of 256 KiB
        "b": torch.randn(4096, generator=g).to(torch.bfloat16),
        "step": torch.tensor(step),
    }


def save_forever(directory: str, mode: str, announce: Connection) -> None:
    state = content(0)
    info = {"step": 0}
    with Checkpointer(
        {"tensors": state, "info": info},
        local=directory,
        staging=StagingOptions(mode=mode),  # type: ignore[arg-type]
        write=WriteOptions(chunk_bytes=256 << 10),
        retention=RetentionOptions(keep_last=2),
    ) as ck:
        last = ck.restore()
        step = 0 if last is None else last + 1
        while True:
            for k, v in content(step).items():
                state[k].copy_(v)
            info["step"] = step
            h = ck.save(step)
            h.wait()
            announce.send(step)
            step += 1
