"""torchtitan checkpointing through tiercheck's tiers: select the manager in your config module.

In a torchtitan config registry (``torchtitan/models/<model>/config_registry.py`` or your own), the lines to add:

    from tiercheck.integrations.torchtitan import TiercheckCheckpointManager

    def llama3_8b_tiercheck() -> Trainer.Config:
        config = llama3_8b()
        config.checkpoint = TiercheckCheckpointManager.Config(
            enable=True, interval=500, async_mode="async", keep_latest_k=3, last_save_model_only=False,
            local="/nvme/ckpt/llama3_8b", remote="s3://bucket/llama3_8b",
        )
        return config

``Trainer`` then builds, loads, saves and closes it as it does its own ``CheckpointManager``. This script drives
the manager the way ``Trainer.train`` does, on CPU with one gloo rank (``torchrun --nproc-per-node 2`` for two),
with a small FSDP2 model, torchtitan's AdamW container and LR scheduler and a train state; a stopped run resumes:

    python examples/torchtitan_train.py --dir runs/tt --steps 20
    python examples/torchtitan_train.py --dir runs/tt2 --steps 20 --stop-after 13   # exits at once after step 13
    python examples/torchtitan_train.py --dir runs/tt2 --steps 20                   # resumes from step 10
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

from tiercheck.integrations.torchtitan import TiercheckCheckpointManager


class TrainState:
    """What torchtitan's Trainer saves as ``train_state``."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--remote", default=None, help="a remote URL (default: <dir>/remote as file://)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--stop-after", type=int, default=None)
    p.add_argument("--async-mode", default="async", choices=["disabled", "async", "async_with_pinned_mem"],
                   help="async_with_pinned_mem needs CUDA (refused without it)")
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)))
    rank = dist.get_rank()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=5).build(optimizers=optimizers, training_steps=args.steps)
    state = TrainState()

    # What a torchtitan config module says, and how Trainer builds it:
    config = TiercheckCheckpointManager.Config(
        enable=True, interval=5, async_mode=args.async_mode, keep_latest_k=2, last_save_model_only=False,
        local=str(args.dir / "local"), remote=args.remote or (args.dir / "remote").absolute().as_uri(),
    )  # fmt: skip
    checkpointer = config.build(dataloader=None, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=lr_schedulers, states={"train_state": state}, sd_adapter=None,
                                base_folder=str(args.dir))  # fmt: skip

    checkpointer.load(step=-1)  # the newest step every rank can restore, local or remote; none: a fresh start
    if rank == 0:
        print(f"training starts at step {state.step + 1}")
    while state.step < args.steps:
        state.step += 1
        g = torch.Generator().manual_seed(1000 * rank + state.step)  # a step's data depends on the step alone
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        checkpointer.save(state.step, last_step=state.step == args.steps)
        if state.step == args.stop_after:
            checkpointer.maybe_wait_for_saving()
            os._exit(0)  # preempted: nothing closed, nothing drained
    checkpointer.close()  # waits for the last save and the drain to the remote
    digest = sum(float(v.full_tensor().double().sum()) for v in model.state_dict().values())
    if rank == 0:
        print(f"done at step {state.step}; weights digest {digest!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
