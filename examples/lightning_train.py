"""PyTorch Lightning checkpointing through tiercheck's tiers: one plugin in the Trainer.

    trainer = pl.Trainer(plugins=[TiercheckCheckpointIO(local=<dir>/local, remote=<url>)],
                         callbacks=[ModelCheckpoint(dirpath=<dir>/ckpts, monitor="val_loss", save_top_k=2,
                                                    save_last=True)])
    trainer.fit(model, ckpt_path="last")       # resumes from last.ckpt; a fresh start in an empty directory

Each save is tiercheck step ``global_step`` (staged before ``save_checkpoint`` returns, written and drained in the
background); ``<dir>/ckpts/*.ckpt`` are small JSON pointers Lightning finds, sorts and deletes as usual. Stop a run
midway (``--stop-after-epoch``, the process exits at once) and start it again: it resumes from ``last.ckpt``.

    python examples/lightning_train.py --dir runs/pl --epochs 4
    python examples/lightning_train.py --dir runs/pl2 --epochs 4 --stop-after-epoch 2
    python examples/lightning_train.py --dir runs/pl2 --epochs 4          # resumes at epoch 2, same weights
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tiercheck.integrations.lightning import TiercheckCheckpointIO


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class StopAfter(pl.Callback):
    """Ends the process at the start of an epoch, as a preemption would (the saves so far committed first)."""

    def __init__(self, epoch: int, io: TiercheckCheckpointIO) -> None:
        self.epoch, self.io = epoch, io

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            self.io.wait()
            os._exit(0)


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--remote", default=None, help="a remote URL (default: <dir>/remote as file://)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--stop-after-epoch", type=int, default=None)
    args = p.parse_args()
    pl.seed_everything(0, verbose=False)

    # The lines a Lightning user adds: the plugin (and ModelCheckpoint as usual).
    io = TiercheckCheckpointIO(args.dir / "local", remote=args.remote or (args.dir / "remote").absolute().as_uri())
    ckpts = ModelCheckpoint(dirpath=args.dir / "ckpts", monitor="val_loss", save_top_k=2, save_last=True)
    callbacks: list[pl.Callback] = [ckpts]
    if args.stop_after_epoch is not None:
        callbacks.append(StopAfter(args.stop_after_epoch, io))
    trainer = pl.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=1, plugins=[io], callbacks=callbacks,
                         logger=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    model = Regressor()
    trainer.fit(model, data(), data(), ckpt_path="last")
    digest = sum(float(v.double().sum()) for v in model.state_dict().values())
    print(f"done at global step {trainer.global_step}; weights digest {digest!r}; best {ckpts.best_model_path}")


if __name__ == "__main__":
    main()
