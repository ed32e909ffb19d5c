"""Train a tiny model with DeepSpeed ZeRO-2 on CPU (2 ranks, gloo), checkpointing through tiercheck.

One line puts DeepSpeed's checkpoints on tiercheck's tiers:

    tiercheck.integrations.deepspeed.install(engine, local=f"{ckpt_dir}/node{rank}")

after which the loop is plain DeepSpeed: ``engine.load_checkpoint(save_dir)`` at start (the newest
step both ranks can get; ``(None, None)`` on a fresh start) and ``engine.save_checkpoint(save_dir)``
every ``--every`` steps. ``save_checkpoint`` returns once the state is copied to host memory;
tiercheck writes and commits it in the background, then writes ``latest``.
Each rank is a node here, with its own local directory. ``scripts/demo_deepspeed.sh`` kills a run
with SIGKILL and resumes it.

    python examples/deepspeed_train.py --steps 40                                 # no checkpoints
    python examples/deepspeed_train.py --steps 40 --ckpt-dir runs/ds --out final.pt

Rank 0 prints ``step 17 loss 0.123456`` after each step. ``--out`` gets every rank's parameters
and optimizer state, for a bit-for-bit comparison.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

try:
    import tiercheck
except ImportError:  # running from a checkout where tiercheck is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import tiercheck

WORLD_SIZE = 2


def config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 8,
        "train_batch_size": 8 * WORLD_SIZE,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }


TEACHER = torch.randn(32, 1, generator=torch.Generator().manual_seed(123)) / 32**0.5


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression task the model can learn; the data depends only on (step, rank)."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(8, 32, generator=g)
    return x, torch.tanh(3 * x @ TEACHER)


def rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import deepspeed

        import tiercheck.integrations.deepspeed as tiercheck_ds

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config())
    start = 0
    if args.ckpt_dir:
        save_dir = os.path.join(args.ckpt_dir, "deepspeed")
        tiercheck_ds.install(engine, local=os.path.join(args.ckpt_dir, f"node{rank}"))
        path, _ = engine.load_checkpoint(save_dir)
        if path is not None:
            start = engine.global_steps
            if rank == 0:
                print(f"RESUMED from checkpoint step {start}", flush=True)
    loss = torch.zeros(())
    for step in range(start, args.steps):
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        if rank == 0:
            print(f"step {step + 1} loss {loss.item():.6f}", flush=True)
        if args.ckpt_dir and (step + 1) % args.every == 0:
            engine.save_checkpoint(save_dir)
        time.sleep(args.step_sleep)
    engine.destroy()  # commits the last checkpoint and waits for it
    if args.out:
        state = {
            "module": engine.module.state_dict(),
            "fp32_partition": [p.clone() for p in engine.optimizer.single_partition_of_fp32_groups],
            "adam": engine.optimizer.optimizer.state_dict()["state"],
            "final_loss": loss.item(),
        }
        torch.save(state, f"{args.out}.rank{rank}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5, help="save a checkpoint every N steps")
    parser.add_argument("--ckpt-dir", help="checkpoint here (and resume from here); no checkpoints if absent")
    parser.add_argument("--out", help="write the final state of rank r to OUT.rank<r>")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to wait after each step")
    args = parser.parse_args()
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(args, port), nprocs=WORLD_SIZE)
    print(f"tiercheck {tiercheck.__version__}: done", flush=True)


if __name__ == "__main__":
    main()
