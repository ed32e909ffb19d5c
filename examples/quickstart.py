"""A first training loop with tiercheck: the one the README and docs/getting-started.md show.

    python examples/quickstart.py

trains a tiny model on the CPU in a temporary directory (no GPU, no server): once for 120 steps,
checkpointing every 50, and once stopped after step 59 and run again, which restores step 50 and
ends with every parameter bit-identical to the uninterrupted run's. The test suite runs this file
as written (tests/test_examples.py), so change the loop here, not in the pages that show it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

import tiercheck

BATCH = 8


class MyModel(nn.Module):
    """A tiny regression model whose forward pass returns the loss of a batch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's data, drawn from the step number: a resumed run sees what an uninterrupted one saw."""
    x = torch.randn(BATCH, 16, generator=torch.Generator().manual_seed(step))
    return x, x.sum(dim=1, keepdim=True)


def train(directory: Path, total_steps: int) -> tuple[int | None, nn.Module]:
    """Train up to ``total_steps``, resuming from the newest step committed in ``directory``.
    Returns the step restored (None when there was none) and the model."""
    torch.manual_seed(0)  # the initial weights: a restore overwrites them
    # --8<-- [start:loop]
    model = MyModel()
    optimizer = torch.optim.AdamW(model.parameters())
    progress = {"epoch": 0, "samples_seen": 0}

    with tiercheck.Checkpointer(
        {"model": model, "optimizer": optimizer, "progress": progress, "rng": tiercheck.RNGState()},
        local=directory,                         # node-local directory (fast disk)
        # remote="s3://bucket/run1",             # optional: committed steps drain here in the background
    ) as ckpt:
        last = ckpt.restore()                    # newest committed step, restored in place; None if there is none
        for step in range(0 if last is None else last + 1, total_steps):
            loss = model(batch(step))
            loss.backward()
            optimizer.step()                     # lazy mode: waits only if the last snapshot is still being copied
            optimizer.zero_grad()
            progress["samples_seen"] += BATCH
            if step % 50 == 0:
                ckpt.save(step, metadata={"loss": loss.item()})
    # leaving the block waits for in-flight saves and drains
    # --8<-- [end:loop]
    return last, model


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        straight_dir, resumed_dir = Path(tmp, "straight"), Path(tmp, "resumed")
        _, straight = train(straight_dir, 120)
        train(resumed_dir, 60)  # stops after step 59: its newest checkpoint is step 50
        restored, resumed = train(resumed_dir, 120)
        assert restored == 50, f"the second run restored step {restored}, not 50"
        for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
            assert torch.equal(a, b), f"{name} differs between the uninterrupted and the resumed run"
        state = tiercheck.load(resumed_dir)  # the newest step as a plain nested dict of CPU tensors
        print(f"resumed from step {restored}: every parameter bit-identical to the uninterrupted run")
        print(f"tiercheck.load: step 100's model holds {sorted(state['model'])}")


if __name__ == "__main__":
    main()
