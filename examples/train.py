"""Train a tiny GPT on CPU, checkpointing asynchronously with tiercheck.

The run is fully deterministic: the same command gives bit-identical parameters whether it runs
uninterrupted or is killed at any moment and restarted from its last committed checkpoint.
``examples/demo.py`` shows exactly that.

    python examples/train.py --steps 200                              # no checkpoints
    python examples/train.py --steps 200 --ckpt-dir runs/tiny-gpt    # checkpoint every 10 steps,
                                                                       # resume if one exists
    python examples/train.py --steps 200 --ckpt-dir runs/tiny-gpt --memory /dev/shm/tiny-gpt
                                      # every step to memory that outlives the process, every 10th also to disk

Each training step prints one line, ``step 17 loss 4.123456``. A run with ``--ckpt-dir`` first says
where its checkpoints go (``checkpoints: DIR, memory tier under PATH ...``, or ``no memory tier``).
A run that resumes prints ``restart: step N restored from memory in T ms`` (or ``from the local
directory``): the time of the Checkpointer's start and its ``restore()``.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tiercheck import Checkpointer, MemoryOptions, RetentionOptions, SaveHandle

# --- model sizes and data ---------------------------------------------------------------------
VOCAB = 256  # byte-level tokens
SEQ_LEN = 64
D_MODEL = 64
N_HEADS = 4
N_LAYERS = 2
BATCH = 16
LR = 3e-3
WARMUP_STEPS = 20  # without warm-up and clipping, early Adam steps make the loss spike
GRAD_CLIP = 1.0
SEED = 1234


# --- output -----------------------------------------------------------------------------------
_print_lock = threading.Lock()


def log(line: str) -> None:
    """Write one whole line at a time: commit callbacks print from tiercheck's threads."""
    with _print_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


# --- data -------------------------------------------------------------------------------------
def make_corpus(n_bytes: int = 1 << 17, seed: int = SEED) -> torch.Tensor:
    """A byte corpus of made-up words, generated from a seeded ``torch.Generator``.

    A fixed lexicon of random lowercase "words" is sampled with Zipf-like frequencies and joined
    by spaces. Predicting the next byte needs the bytes before it (which word are we in?), so
    attention has something to learn and the loss keeps falling for a few hundred steps.
    """
    g = torch.Generator().manual_seed(seed)
    n_words = 96
    lengths = torch.randint(2, 8, (n_words,), generator=g)
    lexicon = [bytes((torch.randint(0, 26, (int(n),), generator=g) + ord("a")).tolist()) for n in lengths]
    zipf = 1.0 / torch.arange(1, n_words + 1, dtype=torch.float64)
    picks = torch.multinomial(zipf, n_bytes // 4, replacement=True, generator=g).tolist()
    text = b" ".join(lexicon[i] for i in picks)[:n_bytes]
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def lr_at(step: int) -> float:
    """Linear warm-up, then constant. A function of the step alone, so it needs no checkpoint
    of its own (an ``LRScheduler`` object would have to go into the checkpoint state)."""
    return LR * min(1.0, (step + 1) / WARMUP_STEPS)


def get_batch(corpus: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of training step ``step``: a function of the step number alone.

    It uses its own generator rather than the global RNG, so a resumed run sees exactly the
    batches the uninterrupted run saw, whatever happened before the restart.
    """
    g = torch.Generator().manual_seed(SEED * 1_000_003 + step)
    starts = torch.randint(0, corpus.numel() - SEQ_LEN - 1, (BATCH,), generator=g)
    offsets = torch.arange(SEQ_LEN + 1)
    window = corpus[starts[:, None] + offsets]
    return window[:, :-1], window[:, 1:]


# --- model ------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        # (b, t, d) -> (b, heads, t, d/heads)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Decoder-only transformer; the output head is tied to the token embedding.

    No dropout: the forward pass draws no random numbers, so nothing but parameters and
    optimizer state must survive a restart to continue bit-identically.
    """

    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D_MODEL)
        self.pos_emb = nn.Embedding(SEQ_LEN, D_MODEL)
        self.blocks = nn.ModuleList(Block(D_MODEL, N_HEADS) for _ in range(N_LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.tok_emb.weight)  # tied head: logits (b, t, vocab)


# --- training ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--ckpt-dir",
        type=Path,
        default=None,
        help="checkpoint directory; resume from it if it holds a committed step (omit: no checkpointing)",
    )
    p.add_argument("--steps", type=int, default=200, help="training steps in total (default 200)")
    p.add_argument("--every", type=int, default=10, help="save a checkpoint every K steps (default 10)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="torch.save the final parameters, optimizer state and losses here",
    )
    p.add_argument(
        "--step-sleep",
        type=float,
        default=0.0,
        help="sleep this many seconds per step, to slow the run down (default 0)",
    )
    p.add_argument(
        "--memory",
        type=Path,
        default=None,
        help="a tmpfs directory for tiercheck's memory tier: save every step there (it outlives the\n"
        "process), and every --every steps to --ckpt-dir too (omit: no memory tier)",
    )
    p.add_argument("--keep-last", type=int, default=3, help="committed steps kept in --ckpt-dir (0: all; default 3)")
    p.add_argument(
        "--restore-step",
        type=int,
        default=None,
        help="restore this step rather than the newest (with --steps STEP+1: restore it, train nothing)",
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.every < 1 or args.step_sleep < 0 or args.keep_last < 0:
        p.error("--steps and --every must be >= 1, --step-sleep and --keep-last >= 0")
    if (args.memory is not None or args.restore_step is not None) and args.ckpt_dir is None:
        p.error("--memory and --restore-step need --ckpt-dir")
    return args


class RestoredFrom(logging.Handler):
    """When a restore from memory had read its step: tiercheck logs it (from the restoring thread); it
    then persists the step to the local directory beside training. Which tier served it, ``stats()`` says."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.memory_read_at: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("restored step %d from memory"):
            self.memory_read_at = time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    # Bit-identical results across processes need the same kernels with the same reduction
    # order: deterministic algorithms, and a fixed intra-op thread count (CPU kernels split
    # reductions by thread, so a different count can change the last bits of a sum).
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(SEED)

    corpus = make_corpus()
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"tiny GPT: {n_params:,} parameters, {N_LAYERS} blocks, d_model {D_MODEL}, "
        f"corpus {corpus.numel():,} bytes, {args.steps} steps"
    )

    # Everything a restart needs to continue bit-identically. Plain dicts are updated in place
    # by restore(). The global RNG state is kept even though this model draws no random
    # numbers after initialisation, so that adding e.g. dropout keeps resumes exact.
    progress: dict[str, Any] = {"step": -1, "loss": math.nan}
    rng: dict[str, torch.Tensor] = {"torch": torch.get_rng_state()}
    state = {"model": model, "optimizer": optimizer, "progress": progress, "rng": rng}

    # With the memory tier, every step is saved to memory and every `--every`th also to the directory.
    memory = MemoryOptions(path=args.memory, persist_every=args.every) if args.memory is not None else None
    save_every = 1 if memory is not None else args.every
    logging.getLogger("tiercheck").addHandler(restored_from := RestoredFrom())
    logging.getLogger("tiercheck").setLevel(logging.INFO)
    t_open = time.perf_counter()
    ckpt_cm = (
        Checkpointer(
            state, local=args.ckpt_dir, memory=memory, retention=RetentionOptions(keep_last=args.keep_last or None)
        )
        if args.ckpt_dir is not None
        else nullcontext(None)
    )
    losses: dict[int, float] = {}
    with ckpt_cm as ckpt:
        first = 0
        if ckpt is not None:
            log(_checkpoints(args))
            start = ckpt.restore(args.restore_step)
            restart_ms = (time.perf_counter() - t_open) * 1e3
            if start is None:
                log(f"no checkpoint in {args.ckpt_dir}: starting from scratch")
            else:
                torch.set_rng_state(rng["torch"])
                first = start + 1
                log(
                    f"RESUMED from checkpoint step {start} in {args.ckpt_dir} "
                    f"(its loss {progress['loss']:.6f}); continuing at step {first}"
                )
                log(f"restart: step {start} restored from {_restart(ckpt, restored_from, restart_ms, t_open)}")

        for step in range(first, args.steps):
            inputs, targets = get_batch(corpus, step)
            logits = model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            optimizer.step()

            losses[step] = loss.item()
            log(f"step {step} loss {losses[step]:.6f}")
            progress.update(step=step, loss=losses[step])

            if ckpt is not None and step > 0 and step % save_every == 0:
                rng["torch"] = torch.get_rng_state()
                t0 = time.perf_counter()
                handle = ckpt.save(step)
                blocked_ms = (time.perf_counter() - t0) * 1e3
                if step % args.every == 0:  # the others go to memory only: one line a step is enough
                    log(f"  ckpt: save({step}) returned after {blocked_ms:.1f} ms; writing in the background")
                    handle.persisted.add_done_callback(_report_commit(handle, t0))

            if args.step_sleep:
                time.sleep(args.step_sleep)
        # Leaving the block closes the Checkpointer, which waits for in-flight saves.

    if args.out is not None:
        torch.save(
            {
                "final_step": progress["step"],
                "final_loss": progress["loss"],
                "losses": losses,  # only the steps this process ran
                "params": model.state_dict(),
                "optimizer": optimizer.state_dict(),
            },
            args.out,
        )
        log(f"wrote final parameters and loss to {args.out}")
    log(f"done: final step {progress['step']} loss {progress['loss']:.6f}")
    return 0


def _checkpoints(args: argparse.Namespace) -> str:
    """The start-up line: where the checkpoints go, the memory tier named."""
    if args.memory is None:
        return f"checkpoints: {args.ckpt_dir}, no memory tier (a step every {args.every})"
    return (
        f"checkpoints: {args.ckpt_dir}, memory tier under {args.memory} "
        f"(every step; every {args.every} steps also to the directory)"
    )


def _restart(ckpt: Checkpointer, restored_from: RestoredFrom, restart_ms: float, t_open: float) -> str:
    """Where the restart read its step from and how long it took (the Checkpointer's start and restore())."""
    if not ckpt.stats()["restore_from_memory"]:
        return f"the local directory in {restart_ms:.1f} ms"
    if restored_from.memory_read_at is None:
        return f"memory in {restart_ms:.1f} ms"
    read_ms = (restored_from.memory_read_at - t_open) * 1e3
    return f"memory in {restart_ms:.1f} ms ({read_ms:.1f} ms to read it; persisted to disk beside training)"


def _report_commit(handle: SaveHandle, t0: float) -> Callable[[Future[bool]], None]:
    """A done-callback for ``handle.persisted`` (runs on one of tiercheck's threads)."""

    def callback(fut: Future[bool]) -> None:
        err = fut.exception() if not fut.cancelled() else RuntimeError("cancelled")
        if err is not None:
            log(f"  ckpt: step {handle.step} FAILED: {err!r}")
        else:
            ms = (time.perf_counter() - t0) * 1e3
            log(
                f"  ckpt: step {handle.step} committed ({handle.nbytes / 2**20:.2f} MiB of tensor chunks, durable {ms:.0f} ms after save())"
            )

    return callback


if __name__ == "__main__":
    sys.exit(main())
