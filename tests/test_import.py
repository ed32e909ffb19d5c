"""``tiercheck import``: a DCP checkpoint (made by ``dcp.save`` on 2 ranks, its tensors sharded) and
``torch.save`` files (a loop's ``.pt``, Lightning's ``.ckpt`` by Lightning's own writer) become a step that
``Checkpointer.restore()`` reads back bit-identical; what needs pickle is refused without the opt-in; the
command a ``ForeignCheckpointError`` names does what it says."""

from __future__ import annotations

import io
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import tiercheck
from tests.cli import run
from tests.conftest import assert_identical
from tiercheck.errors import CorruptCheckpointError, ForeignCheckpointError, UnsafeCheckpointError
from tiercheck.integrations.dcp import TiercheckReader
from tiercheck.integrations.importer import import_checkpoint

from .distributed import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _full_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(8, 6, generator=g), "b": torch.randn(6, generator=g).to(torch.bfloat16)},
        "optim": {"lr": 0.5, "state": [torch.arange(5, dtype=torch.int64)]},
        "step": seed,
        "name": "run1",
    }


def _save_sharded(rank: int, world: int, path: str) -> None:
    """``dcp.save`` on 2 ranks: the weight a DTensor sharded by rows, each rank writing its half."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _full_state(10)
    state = {"model": {"w": distribute_tensor(full["model"]["w"], mesh, [Shard(0)]), "b": full["model"]["b"]},
             "step": full["step"]}  # fmt: skip
    dcp.save(state, checkpoint_id=path)


def test_a_dcp_checkpoint_saved_sharded_by_2_ranks_imports_and_restores_bit_identical(tmp_path: Path) -> None:
    src = tmp_path / "titan" / "step-10"
    run_ranks(_save_sharded, 2, str(src))
    assert sorted(p.name for p in src.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    ran = run("import", str(src), "--to", str(tmp_path / "ck"))
    assert "as step 10 of" in ran.stdout and "2 tensors" in ran.stdout

    full = _full_state(10)
    # Checkpointer.restore(): DCP's flattened names, each tensor whole; the int a DCP byte item, as stored
    state: dict[str, Any] = {"model.w": torch.zeros(8, 6), "model.b": torch.zeros(6, dtype=torch.bfloat16),
                             "step": b""}  # fmt: skip
    with tiercheck.Checkpointer(state, local=tmp_path / "ck") as ck:
        assert ck.restore() == 10
    assert_identical({"w": state["model.w"], "b": state["model.b"]}, full["model"], "restored", any_order=True)
    assert torch.load(io.BytesIO(state["step"]), weights_only=True) == 10
    # dcp.load through tiercheck's reader: the nested state as dcp.save had it
    nested = {"model": {"w": torch.zeros(8, 6), "b": torch.zeros(6, dtype=torch.bfloat16)}, "step": 0}
    dcp.load(nested, storage_reader=TiercheckReader(tmp_path / "ck"), no_dist=True)
    assert_identical(nested, {"model": full["model"], "step": 10}, "dcp.load", any_order=True)


def test_a_torch_save_file_imports_and_restores_bit_identical(tmp_path: Path) -> None:
    torch.save(_full_state(7), tmp_path / "model_1000.pt")
    run("import", str(tmp_path / "model_1000.pt"), "--to", str(tmp_path / "ck"))
    state = _full_state(0)
    with tiercheck.Checkpointer(state, local=tmp_path / "ck") as ck:
        assert ck.steps() == [1000]
        assert ck.restore() == 1000
    assert_identical(state, _full_state(7), "restored", any_order=True)


def test_a_large_torch_save_file_streams_through_a_bounded_pool(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    source = {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(8)}  # 32 MiB in 4 MiB tensors
    torch.save(source, tmp_path / "big_5.pt")
    bound = 4 << 20
    done = import_checkpoint(tmp_path / "big_5.pt", tmp_path / "ck", max_host_bytes=bound)
    assert done.step == 5 and done.nbytes == 32 << 20
    assert done.staged_peak_bytes is not None and 0 < done.staged_peak_bytes <= bound, done
    state = {k: torch.zeros_like(v) for k, v in source.items()}
    with tiercheck.Checkpointer(state, local=tmp_path / "ck") as ck:
        assert ck.restore() == 5
    assert_identical(state, source, "restored", any_order=True)


def test_a_lightning_ckpt_imports_at_its_step(tmp_path: Path) -> None:
    TorchCheckpointIO = pytest.importorskip("lightning.pytorch.plugins.io").TorchCheckpointIO

    ckpt = {"state_dict": _full_state(3)["model"], "global_step": 400, "epoch": 1}
    TorchCheckpointIO().save_checkpoint(ckpt, tmp_path / "epoch=1-step=400.ckpt")
    done = import_checkpoint(tmp_path / "epoch=1-step=400.ckpt", tmp_path / "ck")
    assert (done.step, done.kind, done.tensors) == (400, "torch", 2)
    state: dict[str, Any] = {"state_dict": _full_state(0)["model"], "global_step": 0, "epoch": 0}
    with tiercheck.Checkpointer(state, local=tmp_path / "ck") as ck:
        assert ck.restore() == 400
    assert_identical(state, ckpt, "restored", any_order=True)


def _save_big_sharded(rank: int, world: int, path: str) -> None:
    """32 MiB through ``dcp.save`` on 2 ranks: half of it whole on one rank, half sharded by rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    big = _big_state()
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) if k.startswith("s") else v for k, v in big.items()}
    dcp.save(state, checkpoint_id=path)


def _big_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    whole = {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(4)}  # 4 MiB each, saved by one rank
    return {**whole, "wt": torch.randn(1024, 1024, generator=g).t(), "s0": torch.randn(1024, 1024, generator=g),
            "b": torch.randn(3, generator=g).to(torch.bfloat16)}  # fmt: skip


def _mapped_file(address: int) -> str:
    """The file mapped at ``address`` in this process ("" for anonymous memory), from /proc/self/maps."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, _, _, _, _, *path = line.split(maxsplit=5)
        start, stop = (int(x, 16) for x in span.split("-"))
        if start <= address < stop:
            return path[0] if path else ""
    return ""


def test_a_large_dcp_checkpoint_streams_its_tensors_from_their_files(tmp_path: Path) -> None:
    from tiercheck.integrations.dcp.source import read_dcp

    src = tmp_path / "step-5"
    run_ranks(_save_big_sharded, 2, str(src))
    # each tensor saved whole is a view of its file, not read into memory; one saved in pieces lies in a
    # scratch file, already unlinked
    (tmp_path / "scratch").mkdir()
    state = read_dcp(src, tmp_path / "scratch")
    mapped = {name: _mapped_file(value.data_ptr()) for name, value in state.items()}
    files = {str(src / "__0_0.distcp"), str(src / "__1_0.distcp")}  # DCP spreads the whole ones over its ranks
    assert {mapped[f"w{i}"] for i in range(4)} | {mapped["wt"], mapped["b"]} <= files, mapped
    assert Path(mapped["s0"]).name.startswith(".tiercheck-import-") and mapped["s0"].endswith(" (deleted)"), mapped
    assert list((tmp_path / "scratch").iterdir()) == []
    assert_identical(state, _big_state(), "read", any_order=True)
    del state
    bound = 4 << 20
    done = import_checkpoint(src, tmp_path / "ck", max_host_bytes=bound)
    assert done.step == 5 and done.nbytes == (24 << 20) + 6 and done.kind == "dcp"
    assert done.staged_peak_bytes is not None and 0 < done.staged_peak_bytes <= bound, done
    state = {k: torch.zeros_like(v) for k, v in _big_state().items()}
    with tiercheck.Checkpointer(state, local=tmp_path / "ck") as ck:
        assert ck.restore() == 5
    assert_identical(state, _big_state(), "restored", any_order=True)


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [("relative_path", "../outside.distcp", "outside the checkpoint's directory"),
     ("offset", 1 << 40, "of a file of"),
     ("length", 12, "is not a tensor torch.save wrote")],
)  # fmt: skip
def test_a_dcp_metadata_placing_a_tensor_where_it_cannot_be_is_refused(
    tmp_path: Path, field: str, value: object, said: str
) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    dcp.save({"w": torch.ones(4)}, checkpoint_id=tmp_path / "d", no_dist=True)
    (tmp_path / "outside.distcp").write_bytes((tmp_path / "d" / "__0_0.distcp").read_bytes())
    with open(tmp_path / "d" / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the test's own file
    info = metadata.storage_data[MetadataIndex("w", torch.Size([0]))]
    setattr(info, field, value)
    (tmp_path / "d" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CorruptCheckpointError, match=f"{tmp_path}.*w.*{said}"):
        import_checkpoint(tmp_path / "d", tmp_path / "ck")
    assert not any((tmp_path / "ck").iterdir())


def test_scratch_space_the_disk_has_not_is_refused_before_anything_is_mapped(tiny_tmpfs: Path) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    from tiercheck.errors import StorageError
    from tiercheck.integrations.dcp.mapped import scratch_tensors

    size = torch.Size([4 << 20])  # 16 MiB of float32 on an 8 MiB tmpfs
    md = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), size, [ChunkStorageMetadata(torch.Size([0]), size)]
    )
    with pytest.raises(StorageError, match=r"needs 16,777,216 bytes of scratch space .* and the disk has [\d,]+ free"):
        scratch_tensors({"w": md}, tiny_tmpfs)
    assert list(tiny_tmpfs.iterdir()) == []


class _Config:
    def __init__(self) -> None:
        self.depth = 3


def test_what_needs_pickle_is_refused_without_the_opt_in(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2), "cfg": _Config()}, tmp_path / "a.pt")
    ran = run("import", str(tmp_path / "a.pt"), "--to", str(tmp_path / "ck"), check=False)
    assert ran.returncode == 1 and "--allow-pickle" in ran.stderr
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())
    # a DCP byte item of a class of the caller's: the same
    dcp.save({"w": torch.ones(2), "cfg": _Config()}, checkpoint_id=tmp_path / "d", no_dist=True)
    with pytest.raises(UnsafeCheckpointError, match="cfg needs unpickling"):
        import_checkpoint(tmp_path / "d", tmp_path / "ck2")


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_a_truncated_torch_save_file_is_named_damaged_with_or_without_allow_pickle(tmp_path: Path, zipped: bool) -> None:
    """A .pt cut short (a copy interrupted) was said to need unpickling, "import it with --allow-pickle" (false),
    and with --allow-pickle torch's own error ended the command with a traceback."""
    whole = tmp_path / "whole.pt"
    torch.save({"w": torch.randn(256, 64)}, whole, _use_new_zipfile_serialization=zipped)
    cut = tmp_path / "model_10.pt"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    for extra in ([], ["--allow-pickle"]):
        ran = run("import", str(cut), "--to", str(tmp_path / "ck"), *extra, check=False)
        assert ran.returncode == 1, ran
        assert ran.stderr.startswith(f"tiercheck: error: {cut} is truncated or damaged: torch.load cannot read it ("), ran
        assert len(ran.stderr.splitlines()) == 1 and "--allow-pickle" not in ran.stderr, ran.stderr
        assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def test_a_pickle_naming_what_is_not_importable_here_is_one_line_with_allow_pickle(tmp_path: Path) -> None:
    main = sys.modules["__main__"]
    gone = type("Gone", (), {"__module__": "__main__"})
    main.Gone = gone  # type: ignore[attr-defined]  # pickled by reference, as a script's own class is
    try:
        torch.save({"w": torch.ones(2), "cfg": gone()}, tmp_path / "a.pt")
    finally:
        del main.Gone  # type: ignore[attr-defined]
    ran = run("import", str(tmp_path / "a.pt"), "--to", str(tmp_path / "ck"), "--allow-pickle", check=False)
    assert ran.returncode == 1 and len(ran.stderr.splitlines()) == 1, ran
    assert "cannot be unpickled here: it names what this process cannot import" in ran.stderr, ran.stderr


def test_dcp_metadata_naming_anything_but_dcp_classes_is_refused(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "d", no_dist=True)

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (print, ("unpickled",))

    (tmp_path / "d" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(UnsafeCheckpointError, match=r"names builtins\.print"):
        import_checkpoint(tmp_path / "d", tmp_path / "ck")


def test_the_command_the_foreign_checkpoint_error_names_imports_and_the_run_resumes(tmp_path: Path) -> None:
    for step in (5, 10):
        dcp.save({"model": _full_state(step)["model"]}, checkpoint_id=tmp_path / f"step-{step}", no_dist=True)
    state: dict[str, Any] = {"model.w": torch.zeros(8, 6), "model.b": torch.zeros(6, dtype=torch.bfloat16)}
    with pytest.raises(ForeignCheckpointError) as e, tiercheck.Checkpointer(state, local=tmp_path) as ck:
        ck.restore()
    command = str(e.value).split("`")[1].split()
    assert command[:2] == ["tiercheck", "import"]
    run(*command[1:])
    with tiercheck.Checkpointer(state, local=tmp_path) as ck:
        assert ck.restore() == 10
    assert_identical({"w": state["model.w"], "b": state["model.b"]}, _full_state(10)["model"], "resumed", any_order=True)


def test_export_to_dcp_loads_with_dcp_load_bit_identical(tmp_path: Path) -> None:
    saved = _full_state(4)
    with tiercheck.Checkpointer(saved, local=tmp_path / "ck") as ck:
        ck.save(4).wait()
    ran = run("export", str(tmp_path / "ck"), "--to", str(tmp_path / "out"), "--format", "dcp")
    assert "exported step 4 as a DCP checkpoint: 3 tensors" in ran.stdout
    assert (tmp_path / "out" / ".metadata").is_file()
    back = _full_state(0)
    dcp.load(back, checkpoint_id=tmp_path / "out", no_dist=True)  # DCP's own reader, no tiercheck
    assert_identical(back, saved, "dcp.load", any_order=True)
    # --only, and the safetensors options refused by name
    run("export", str(tmp_path / "ck"), "--to", str(tmp_path / "model"), "--format", "dcp", "--only", "model")
    model = {"model": _full_state(0)["model"]}
    dcp.load(model, checkpoint_id=tmp_path / "model", no_dist=True)
    assert_identical(model, {"model": saved["model"]}, "--only model", any_order=True)
    ran = run("export", str(tmp_path / "ck"), "--to", str(tmp_path / "x"), "--format", "dcp", "--dtype", "float16",
              check=False)  # fmt: skip
    assert ran.returncode == 2 and "--dtype: safetensors' options" in ran.stderr


def test_a_dcp_checkpoint_imported_then_exported_is_what_dcp_saved(tmp_path: Path) -> None:
    src = tmp_path / "step-10"
    run_ranks(_save_sharded, 2, str(src))
    import_checkpoint(src, tmp_path / "ck")
    run("export", str(tmp_path / "ck"), "--to", str(tmp_path / "out"), "--format", "dcp")
    back = {"model": {"w": torch.zeros(8, 6), "b": torch.zeros(6, dtype=torch.bfloat16)}, "step": 0}
    dcp.load(back, checkpoint_id=tmp_path / "out", no_dist=True)  # its byte items written back as DCP stored them
    full = _full_state(10)
    assert_identical(back, {"model": full["model"], "step": 10}, "round trip", any_order=True)


def test_dcp_load_through_tiercheck_where_only_dcp_checkpoints_lie_names_the_import(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "step-3", no_dist=True)
    with pytest.raises(CheckpointException) as e:  # DCP wraps every error, quoting it
        dcp.load({"w": torch.zeros(2)}, storage_reader=TiercheckReader(tmp_path), no_dist=True)
    assert f"`tiercheck import {tmp_path}/step-3 --to {tmp_path} --step 3`" in str(e.value)


def test_import_to_a_url_drains_the_step_there(tmp_path: Path) -> None:
    torch.save(_full_state(5), tmp_path / "ckpt_5.pt")
    remote = (tmp_path / "remote").as_uri()
    run("import", str(tmp_path / "ckpt_5.pt"), "--to", remote)
    state = _full_state(0)
    with tiercheck.Checkpointer(state, local=tmp_path / "new-node", remote=remote) as ck:  # an empty local directory
        assert ck.restore() == 5
    assert_identical(state, _full_state(5), "from the remote", any_order=True)
