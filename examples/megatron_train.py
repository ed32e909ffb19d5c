"""Train a tiny tensor-parallel MLP on CPU, checkpointing with Megatron-core's dist_checkpointing through tiercheck.

Two ranks (TP=2, gloo) split a two-layer MLP the Megatron way: the first layer by rows (column parallel),
the second by columns (row parallel, its outputs summed over the TP group), the output bias replicated.
The sharded state dict is built by hand from ``ShardedTensor``s (parameters and Adam state) and a
``ShardedObject`` (progress); every ``--every`` iterations it is saved asynchronously:

    tiercheck.integrations.megatron.install(local=<ckpt-dir>/local)        # once, on every rank
    request = dist_checkpointing.save(sd, <ckpt-dir>/iter_0000020, sharded_strategy=("tiercheck", 1),
                                      async_sharded_save=True)
    async_queue.schedule_async_request(request)                              # Megatron's AsyncCallsQueue

``save`` returns once the state is in host memory; tiercheck writes and commits in the background, and
``async_queue.maybe_finalize_async_calls()`` (every iteration) finalizes a committed save on the training
thread: ``tiercheck.json``, Megatron's ``metadata.json``, then ``latest_checkpointed_iteration.txt``, as
Megatron's training loop does. At start the run resumes from the iteration that file names, so a run
killed at any moment and started again ends bit-identical to an uninterrupted one
(``scripts/demo_megatron.sh`` shows it).

    python examples/megatron_train.py --steps 60                                # no checkpoints
    python examples/megatron_train.py --steps 60 --ckpt-dir runs/mg/ckpt --out final.pt

Each iteration prints ``step 17 loss 0.123456`` (rank 0).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:
    import tiercheck
except ImportError:  # running from a checkout where tiercheck is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import tiercheck
from tiercheck.integrations import megatron as tc_megatron  # first: it imports megatron-core without its warnings

from megatron.core import dist_checkpointing  # isort: skip
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor  # isort: skip
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # isort: skip

TP = 2
D_IN, HIDDEN, D_OUT = 16, 64, 8
BATCH = 32
LR = 3e-3
SEED = 1234
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's name for "the newest finished checkpoint"


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of iteration ``step``, a function of the step alone (so a resumed run sees the same data)."""
    g = torch.Generator().manual_seed(SEED * 1_000_003 + step)
    x = torch.randn(BATCH, D_IN, generator=g)
    mix = torch.randn(D_IN, D_OUT, generator=torch.Generator().manual_seed(SEED))
    return x, torch.sin(x @ mix)


class _ReduceFromTP(torch.autograd.Function):
    """Sum the row-parallel partial outputs over the TP group; gradients pass through unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class TPMLP(torch.nn.Module):
    """This rank's half of ``Linear(D_IN, HIDDEN) -> GELU -> Linear(HIDDEN, D_OUT)``."""

    def __init__(self, tp_rank: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(SEED)  # the global weights, then this rank's slices
        w1, w2 = torch.randn(HIDDEN, D_IN, generator=g) * 0.2, torch.randn(D_OUT, HIDDEN, generator=g) * 0.1
        rows = slice(tp_rank * HIDDEN // TP, (tp_rank + 1) * HIDDEN // TP)
        self.w1 = torch.nn.Parameter(w1[rows].clone())
        self.b1 = torch.nn.Parameter(torch.zeros(HIDDEN // TP))
        self.w2 = torch.nn.Parameter(w2[:, rows].clone())
        self.b2 = torch.nn.Parameter(torch.zeros(D_OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(x @ self.w1.T + self.b1)
        return _ReduceFromTP.apply(h @ self.w2.T) + self.b2


# How each parameter is split over TP: (axis, fragments) for from_rank_offsets; None = replicated.
SPLITS = {"w1": (0, TP), "b1": (0, TP), "w2": (1, TP), "b2": None}


def sharded_state_dict(
    model: TPMLP, optimizer: torch.optim.Adam, tp_rank: int, progress: dict[str, Any]
) -> dict[str, Any]:
    """Parameters and Adam moments as ShardedTensors (views of the live tensors: loading fills them in place)."""

    def sharded(key: str, t: torch.Tensor, split: tuple[int, int] | None) -> ShardedTensor:
        if split is None:
            return ShardedTensor.from_rank_offsets(key, t, replica_id=tp_rank)
        return ShardedTensor.from_rank_offsets(key, t, (split[0], tp_rank, split[1]))

    sd: dict[str, Any] = {"model": {}, "optimizer": {}}
    for name, p in model.named_parameters():
        sd["model"][name] = sharded(f"model.{name}", p.detach(), SPLITS[name])
        state = optimizer.state[p]
        sd["optimizer"][name] = {
            "exp_avg": sharded(f"optimizer.{name}.exp_avg", state["exp_avg"], SPLITS[name]),
            "exp_avg_sq": sharded(f"optimizer.{name}.exp_avg_sq", state["exp_avg_sq"], SPLITS[name]),
            "step": sharded(f"optimizer.{name}.step", state["step"], None),
        }
    sd["progress"] = ShardedObject("progress", dict(progress), (1,), (0,), replica_id=tp_rank)
    return sd


def _cpu_only() -> None:
    """Megatron's async save calls torch.cuda.synchronize() and torch.cuda.current_device() (to place two
    flag tensors); a CPU build of torch raises in both. Without CUDA, make them no-ops (flags on the CPU)."""
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


def run(rank: int, args: argparse.Namespace, port: int) -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    _cpu_only()
    store = dist.TCPStore("127.0.0.1", port, TP, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=TP)
    say = print if rank == 0 else (lambda *a, **k: None)

    model = TPMLP(rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for p in model.parameters():  # Adam's state as its first step would create it: loading needs it in place
        optimizer.state[p] = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    progress: dict[str, Any] = {"iteration": -1, "loss": None}
    losses: dict[int, float] = {}

    backend, queue, first = None, AsyncCallsQueue(persistent=False), 0
    if args.ckpt_dir is not None:
        ckpt_dir: Path = args.ckpt_dir.absolute()
        # A node-local tiercheck root (on a cluster: local NVMe); every Megatron checkpoint directory points into it.
        backend = tc_megatron.install(local=ckpt_dir / "local", retention=tiercheck.RetentionOptions(keep_last=3))
        tracker = ckpt_dir / TRACKER
        if tracker.exists():
            it = int(tracker.read_text())
            loaded = dist_checkpointing.load(
                sharded_state_dict(model, optimizer, rank, progress), str(ckpt_dir / f"iter_{it:07d}")
            )
            progress.update(loaded["progress"])
            first = it + 1
            say(f"RESUMED from iteration {it} (its loss {progress['loss']:.6f}); continuing at {first}", flush=True)

    for step in range(first, args.steps):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses[step] = loss.item()
        progress.update(iteration=step, loss=losses[step])
        say(f"step {step} loss {losses[step]:.6f}", flush=True)

        queue.maybe_finalize_async_calls(blocking=False)  # finalizes saves already committed, on this thread
        if backend is not None and step > 0 and step % args.every == 0:
            target = ckpt_dir / f"iter_{step:07d}"
            if rank == 0:
                target.mkdir(parents=True, exist_ok=True)  # exists after a crash: Megatron overwrites it
            dist.barrier()
            t0 = time.perf_counter()
            request = dist_checkpointing.save(
                sharded_state_dict(model, optimizer, rank, progress),
                str(target),
                sharded_strategy=("tiercheck", 1),
                async_sharded_save=True,
            )
            request.add_finalize_fn(lambda step=step: _write_tracker(ckpt_dir, step, rank))
            queue.schedule_async_request(request)
            say(
                f"  ckpt: iteration {step} staged in {(time.perf_counter() - t0) * 1e3:.0f} ms; writing in the background",
                flush=True,
            )
        if args.step_sleep:
            time.sleep(args.step_sleep)  # pacing, so that a demo can kill the run mid-way

    queue.close()  # finalizes the saves still in flight
    if backend is not None:
        backend.close()
    local = dict(model.state_dict())
    local.update({f"{n}.{k}": v for n, p in model.named_parameters() for k, v in optimizer.state[p].items()})
    gathered: list[Any] = [None] * TP
    dist.all_gather_object(gathered, local)
    if rank == 0 and args.out is not None:
        torch.save({"final_loss": progress["loss"], "losses": losses, "ranks": gathered}, args.out)
        say(f"wrote the final state of both ranks to {args.out}")
    say(f"done: final iteration {progress['iteration']} loss {progress['loss']:.6f}", flush=True)
    dist.destroy_process_group()


def _write_tracker(ckpt_dir: Path, step: int, rank: int) -> None:
    """Runs after the save is finalized (tiercheck.json and metadata.json written): now it may be resumed from."""
    if rank == 0:
        tmp = ckpt_dir / f".{TRACKER}.tmp"
        tmp.write_text(f"{step}\n")
        os.replace(tmp, ckpt_dir / TRACKER)
        print(f"  ckpt: iteration {step} finalized", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ckpt-dir", type=Path, default=None, help="checkpoint root; resume from it if it has one")
    p.add_argument("--steps", type=int, default=60, help="training iterations in total (default 60)")
    p.add_argument("--every", type=int, default=10, help="save every K iterations (default 10)")
    p.add_argument("--out", type=Path, default=None, help="torch.save the final state of both ranks here")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per iteration (default 0)")
    args = p.parse_args(argv)
    # This process serves the ranks' rendezvous store on a port the OS picks (no race for a free port), and
    # forks the ranks, which so share its imports (megatron-core's alone takes seconds).
    store = dist.TCPStore("127.0.0.1", 0, TP, is_master=True, wait_for_workers=False)
    mp.start_processes(run, args=(args, store.port), nprocs=TP, start_method="fork")
    return 0


if __name__ == "__main__":
    sys.exit(main())
