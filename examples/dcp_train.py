"""A torchtitan-style training loop on CPU (FSDP2, gloo) checkpointing with ``torch.distributed.checkpoint``
through tiercheck's tiers.

Two ranks shard a small MLP with FSDP2 (``fully_shard`` on a CPU device mesh). As torchtitan's
``CheckpointManager`` does, the model, the optimizer and the training progress are ``Stateful`` objects of one
state dict, saved with ``dcp.async_save`` every ``--every`` steps on a gloo process group of its own (DCP's
save thread runs collectives while training runs FSDP's), the previous save awaited before the next:

    writer = TiercheckWriter(local=<ckpt-dir>/local, remote=<url>)      # once, on every rank
    future = dcp.async_save(states, storage_writer=writer, checkpoint_id=step, process_group=ckpt_group)
    ...
    dcp.load(states, storage_reader=TiercheckReader(local=<ckpt-dir>/local))   # at start: the newest step

The checkpoint id is the step. A run stopped at any step (``--stop-after``) and started again resumes from the
newest committed step and ends bit-identical to an uninterrupted run (the data of a step is a function of the
step alone). In a temporary directory, which leaves nothing in the repository:

    d=$(mktemp -d)
    python examples/dcp_train.py --ckpt-dir $d/dcp --steps 40 --out $d/a.pt
    python examples/dcp_train.py --ckpt-dir $d/dcp2 --steps 40 --stop-after 23
    python examples/dcp_train.py --ckpt-dir $d/dcp2 --steps 40 --out $d/b.pt        # resumes at 21
    python -c "import sys, torch; a, b = map(torch.load, sys.argv[1:]); print(all(torch.equal(a[k], b[k]) for k in a))" $d/a.pt $d/b.pt

``tiercheck ls $d/dcp/local`` and ``tiercheck verify $d/dcp/local`` work on the steps it writes.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

try:
    import tiercheck
except ImportError:  # running from a checkout where tiercheck is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import tiercheck
from tiercheck.integrations.dcp import TiercheckReader, TiercheckWriter

WORLD = 2
D_IN, HIDDEN, D_OUT = 16, 64, 8
BATCH = 32
LR = 3e-3
SEED = 1234


class ModelWrapper(Stateful):
    """torchtitan's wrapper: the (FSDP2-sharded) model's state dict as DTensors, loaded in place."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerWrapper(Stateful):
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)  # initialises Adam's state if empty

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step, self.losses = 0, []

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "losses": list(self.losses)}  # plain values: DCP pickles them (bytes)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.losses = int(state_dict["step"]), list(state_dict["losses"])


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED * 1_000_003 + step)
    return torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g)


def run(rank: int, args: argparse.Namespace, port: int) -> None:
    warnings.filterwarnings("ignore", message="`synchronize_staging` is deprecated", category=FutureWarning)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    say = print if rank == 0 else (lambda *a, **k: None)

    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, D_OUT))
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    train = TrainState()
    states = {"model": ModelWrapper(model), "optimizer": OptimizerWrapper(model, optimizer), "train_state": train}

    writer: TiercheckWriter | None = None
    pending = None
    ckpt_group = dist.new_group(backend="gloo")  # DCP's save thread talks here, training on the default group
    if args.ckpt_dir is not None:
        local = args.ckpt_dir.absolute() / "local"  # node-local (NVMe on a cluster); remote= drains it
        writer = TiercheckWriter(local=local, remote=args.remote, retention=tiercheck.RetentionOptions(keep_last=3))
        if local.exists() and any(local.glob("step-*/COMMIT")):
            dcp.load(states, storage_reader=TiercheckReader(local=local, remote=args.remote))
            say(f"RESUMED from step {train.step}; continuing at {train.step + 1}", flush=True)
    first = train.step + 1 if train.losses else 0

    for step in range(first, args.steps):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        train.step = step
        train.losses.append(loss.item())
        say(f"step {step} loss {train.losses[-1]:.6f}", flush=True)

        if writer is not None and step > 0 and step % args.every == 0:
            if pending is not None:
                pending.result()  # as torchtitan: one save in flight at a time
            t0 = time.perf_counter()
            pending = dcp.async_save(states, storage_writer=writer, checkpoint_id=step, process_group=ckpt_group)
            say(f"  ckpt: step {step} staged in {(time.perf_counter() - t0) * 1e3:.0f} ms", flush=True)
        if args.stop_after is not None and step == args.stop_after:
            say(f"stopping after step {step}, as asked", flush=True)
            break

    if pending is not None:
        pending.result()
    if writer is not None:
        writer.close()  # waits for the drain to the remote tier
    full = {k: v.full_tensor() for k, v in get_model_state_dict(model).items()}
    if rank == 0 and args.out is not None and args.stop_after is None:
        torch.save({**full, "losses": torch.tensor(train.losses, dtype=torch.float64)}, args.out)
        say(f"wrote the final parameters and losses to {args.out}")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ckpt-dir", type=Path, default=None, help="checkpoint root; resume from it if it has a step")
    p.add_argument("--remote", default=None, help="remote tier URL to drain steps to (s3://, az://, file://)")
    p.add_argument("--steps", type=int, default=40, help="training steps in total (default 40)")
    p.add_argument("--every", type=int, default=7, help="save every K steps (default 7)")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this step (to resume later)")
    p.add_argument("--out", type=Path, default=None, help="torch.save the final parameters and losses here")
    args = p.parse_args(argv)
    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    mp.start_processes(run, args=(args, store.port), nprocs=WORLD, start_method="fork")
    return 0


if __name__ == "__main__":
    sys.exit(main())
