"""Hugging Face safetensors out of and into tiercheck (issue 44), with real ``transformers`` and
``safetensors``: a tiny Llama built from a config (nothing downloaded), trained and saved
tensor-parallel on 2 gloo ranks, exported, and loaded back by ``from_pretrained``."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tiercheck.errors import CorruptCheckpointError, IncompatibleStateError
from tiercheck.format.paths import step_dir
from tiercheck.integrations import hf
from tiercheck.integrations.hf.source import ImportDir

from .distributed import run_ranks
from .ondisk import chunks_of, flip_chunk_byte

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")  # split dim 0
ROW = ("o_proj", "down_proj")  # split dim 1


def tiny_config() -> Any:
    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip


def trained_model(seed: int = 0, steps: int = 3) -> Any:
    """The same model and weights on every rank: a few AdamW steps on fixed tokens."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(tiny_config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))
    for _ in range(steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def tp_dim(name: str) -> int | None:
    if any(k in name for k in COLUMN):
        return 0
    if any(k in name for k in ROW):
        return 1
    return None


def tp_state(model: Any, rank: int, world: int) -> dict[str, Any]:
    """The model's state_dict as this rank's tensor-parallel slices (norms replicated)."""
    out: dict[str, Any] = {}
    for name, t in model.state_dict().items():
        d = tp_dim(name)
        if d is None:
            out[name] = t.clone()
            continue
        n = t.shape[d] // world
        offsets = [0] * t.dim()
        offsets[d] = rank * n
        out[name] = tiercheck.Shard(t.narrow(d, rank * n, n).clone(), global_shape=t.shape, offsets=offsets)
    return out


def _save_tp(rank: int, world: int, root: str) -> dict[str, torch.Tensor] | None:
    model = trained_model()
    state = {"model": tp_state(model, rank, world), "step": 3}
    with tiercheck.Checkpointer(state, local=root) as ck:
        ck.save(3).wait()
    return {k: v.clone() for k, v in model.state_dict().items()} if rank == 0 else None


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor], Path]:
    """Step 3 of the tiny Llama saved TP=2 by 2 ranks into one node directory; the trained weights;
    a directory holding the model's config.json."""
    root = tmp_path_factory.mktemp("tp2") / "ckpt"
    weights = run_ranks(_save_tp, 2, str(root), timeout=180)[0]
    config = tmp_path_factory.mktemp("config")
    tiny_config().save_pretrained(config)
    return root, weights, config / "config.json"


def test_tp_sharded_step_exports_to_from_pretrained_bit_identical(saved: Any, tmp_path: Path) -> None:
    root, weights, config = saved
    seen: list[tuple[int, int]] = []
    result = hf.export(
        root, tmp_path / "out", max_shard_size="40KB", include=[config], progress=lambda d, t: seen.append((d, t))
    )
    files = sorted(os.listdir(tmp_path / "out"))
    assert len(result.files) > 2 and files == sorted([*result.files, "model.safetensors.index.json", "config.json"])
    assert seen[-1] == (result.total_size, result.total_size)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())
    assert set(index["weight_map"]) == set(weights)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    loaded = model.state_dict()
    assert set(loaded) == set(weights)
    for name, t in weights.items():
        assert torch.equal(loaded[name], t), name
    reference = transformers.LlamaForCausalLM(tiny_config())
    reference.load_state_dict(weights)
    tokens = torch.arange(32).reshape(2, 16)
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens).logits, reference(input_ids=tokens).logits)
    # safetensors' own reader agrees, file by file
    for file in result.files:
        for name, t in safetensors_torch.load_file(tmp_path / "out" / file).items():
            assert index["weight_map"][name] == file
            assert torch.equal(t, weights[name]), name


def _save_pp(rank: int, world: int, root: str) -> None:
    """Pipeline stages: rank 0 holds the embedding and layer 0, rank 1 layer 1, the norm and the head."""
    weights = trained_model().state_dict()
    mine = [k for k in weights if ("layers.0." in k or "embed" in k) == (rank == 0)]
    with tiercheck.Checkpointer({"model": {k: weights[k].clone() for k in mine}}, local=root) as ck:
        ck.save(5).wait()


def test_pipeline_stages_export_as_one_model(saved: Any, tmp_path: Path) -> None:
    """Each stage's tree names only its own layers: the export joins every saving rank's."""
    _, weights, _ = saved
    run_ranks(_save_pp, 2, str(tmp_path / "ckpt"), timeout=180)
    hf.export(tmp_path / "ckpt", tmp_path / "out")
    got = safetensors_torch.load_file(tmp_path / "out" / "model.safetensors")
    assert got.keys() == weights.keys() and all(torch.equal(got[k], v) for k, v in weights.items())


def test_bf16_export_equals_the_cast(saved: Any, tmp_path: Path) -> None:
    root, weights, _ = saved
    result = hf.export(root, tmp_path / "out", dtype=torch.bfloat16, buffer_bytes=4096)
    assert result.files == ["model.safetensors"]
    got = safetensors_torch.load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == set(weights)
    for name, t in weights.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], t.to(torch.bfloat16)), name
    assert result.total_size == sum(t.numel() * 2 for t in weights.values())


def test_names_map_prefix_and_only(saved: Any, tmp_path: Path) -> None:
    root, weights, _ = saved
    names = {"lm_head.weight": "output.weight", "norm.weight": None}  # after the prefix is dropped
    hf.export(root, tmp_path / "out", drop_prefix="model.", names=names)
    got = safetensors_torch.load_file(tmp_path / "out" / "model.safetensors")
    expected = {k.removeprefix("model."): v for k, v in weights.items() if k != "model.norm.weight"}
    expected["output.weight"] = expected.pop("lm_head.weight")
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    with pytest.raises(IncompatibleStateError, match="no entry 'optimizer'.*holds: 'model', 'step'"):
        hf.export(root, tmp_path / "other", only=["optimizer"])
    with pytest.raises(IncompatibleStateError, match="would both be exported as 'x'"):
        hf.export(root, tmp_path / "other", names=lambda n: "x")
    with pytest.raises(IncompatibleStateError, match="'step' hold no tensor"):
        hf.export(root, tmp_path / "other", only=["step"])
    (tmp_path / "model.safetensors").write_text("{}")
    with pytest.raises(ValueError, match="model.safetensors would replace a file of the export"):
        hf.export(root, tmp_path / "other", include=[tmp_path / "model.safetensors"])
    assert not (tmp_path / "other").exists()


def test_a_damaged_chunk_fails_the_export_and_leaves_no_directory(saved: Any, tmp_path: Path) -> None:
    root, _, _ = saved
    copy = tmp_path / "ckpt"
    os.system(f"cp -a {root} {copy}")
    step = copy / step_dir(3)
    array = "model/model.layers.1.mlp.down_proj.weight"
    flip_chunk_byte(step, array, chunks_of(step, array)[-1], 5)
    with pytest.raises(CorruptCheckpointError, match=r"down_proj.*checksum|checksum.*down_proj"):
        hf.export(copy, tmp_path / "out", max_shard_size="40KB")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # neither the target nor its hidden temporary


def test_an_existing_directory_is_refused(saved: Any, tmp_path: Path) -> None:
    root, _, _ = saved
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an empty directory"):
        hf.export(root, tmp_path / "out")
    assert os.listdir(tmp_path / "out") == ["keep.txt"]
    (tmp_path / "empty").mkdir()
    hf.export(root, tmp_path / "empty")  # an empty one is filled
    assert os.listdir(tmp_path / "empty") == ["model.safetensors"]


def test_cli_export(saved: Any, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from tiercheck.cli import main

    root, weights, config = saved
    args = ["export", str(root), "--step", "3", "--to", str(tmp_path / "out"), "--dtype", "bfloat16",
            "--max-shard-size", "50KB", "--include", str(config)]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "exported step 3: 21 tensors" in result.output and "peak RSS" in result.output
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    assert all(torch.equal(model.state_dict()[k], v.to(torch.bfloat16)) for k, v in weights.items())
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 1 and "not an empty directory" in again.output


# ------------------------------------------------------------------------------- load_pretrained


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A save_pretrained directory (sharded, with its index) and its weights."""
    model = trained_model(seed=1, steps=1)
    out = tmp_path_factory.mktemp("published")
    model.save_pretrained(out, max_shard_size="50KB")
    assert (out / "model.safetensors.index.json").exists()
    return out, {k: v.clone() for k, v in model.state_dict().items()}


def test_load_pretrained_into_a_module_and_into_shards(published: Any) -> None:
    directory, weights = published
    model = transformers.LlamaForCausalLM(tiny_config())
    filled = hf.load_pretrained(directory, model)
    assert sorted(filled) == sorted(weights)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    # a rank's tensor-parallel slices, bf16 from the fp32 files only with cast=True
    shards = tp_state(transformers.LlamaForCausalLM(tiny_config()), 1, 2)
    before = {k: (v.local if isinstance(v, tiercheck.Shard) else v).clone() for k, v in shards.items()}
    hf.load_pretrained(directory, {"model": shards}, drop_prefix="model.", names=lambda n: n)
    for name, v in shards.items():
        local = v.local if isinstance(v, tiercheck.Shard) else v
        full = weights[name]
        expected = full[tuple(slice(o, o + n) for o, n in zip(v.offsets, local.shape, strict=True))] if isinstance(v, tiercheck.Shard) else full
        assert torch.equal(local, expected), name
        assert not torch.equal(local, before[name]), name
    half = {k: v.to(torch.bfloat16) for k, v in transformers.LlamaForCausalLM(tiny_config()).state_dict().items()}
    with pytest.raises(IncompatibleStateError, match="float32.*bfloat16.*cast=True"):
        hf.load_pretrained(directory, half)
    hf.load_pretrained(directory, half, cast=True)
    assert all(torch.equal(half[k], v.to(torch.bfloat16)) for k, v in weights.items())


def test_load_pretrained_is_all_or_nothing(published: Any, tmp_path: Path) -> None:
    directory, weights = published
    state = {k: torch.zeros_like(v) for k, v in weights.items()}
    state["extra.weight"] = torch.zeros(3)
    with pytest.raises(IncompatibleStateError, match="'extra.weight' are not in the files"):
        hf.load_pretrained(directory, state)
    assert all(not v.any() for v in state.values())
    assert hf.load_pretrained(directory, state, strict=False) == [k for k in state if k != "extra.weight"]
    # a shard whose header claims bytes past its end: refused before anything is written
    broken = tmp_path / "broken"
    os.system(f"cp -a {directory} {broken}")
    victim = json.loads((broken / "model.safetensors.index.json").read_text())["weight_map"]["lm_head.weight"]
    data = (broken / victim).read_bytes()
    (broken / victim).write_bytes(data[: len(data) - 100])
    fresh = {k: torch.zeros_like(v) for k, v in weights.items()}
    with pytest.raises(CorruptCheckpointError, match="past the end of the file"):
        hf.load_pretrained(broken, fresh)
    assert all(not v.any() for v in fresh.values())
    index = broken / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"lm_head.weight": "../escape.safetensors"}}))
    with pytest.raises(tiercheck.errors.UnsafeCheckpointError, match="not a file of the directory"):
        hf.load_pretrained(broken, fresh)


def test_load_pretrained_reads_into_the_live_tensors_and_says_what_a_failure_left(
    published: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default (a job's first state) each whole tensor is read straight into its own memory; a
    read that fails part way (EIO on the third tensor here) raises PartlyRestoredError naming the
    tensors already overwritten. in_place=False reads everything first: the state stays as it was."""
    directory, weights = published
    state = {k: torch.zeros_like(v) for k, v in weights.items()}
    where = {k: v.data_ptr() for k, v in state.items()}
    hf.load_pretrained(directory, state)
    assert all(torch.equal(state[k], v) and state[k].data_ptr() == where[k] for k, v in weights.items())

    calls = {"n": 0}
    read_into = ImportDir.read_into  # how a local directory to import is read

    def failing(self: ImportDir, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.EIO, "Input/output error")
        return read_into(self, *args, **kwargs)

    monkeypatch.setattr(ImportDir, "read_into", failing)
    fresh = {k: torch.zeros_like(v) for k, v in weights.items()}
    with pytest.raises(tiercheck.PartlyRestoredError, match="load_pretrained had already read into tensor"):
        hf.load_pretrained(directory, fresh, io_threads=1)
    calls["n"] = 0
    untouched = {k: torch.zeros_like(v) for k, v in weights.items()}
    with pytest.raises(OSError, match="Input/output error") as info:
        hf.load_pretrained(directory, untouched, io_threads=1, in_place=False)
    assert not isinstance(info.value, tiercheck.PartlyRestoredError)
    assert all(not v.any() for v in untouched.values())


def _load_3(rank: int, world: int, directory: str, ckpt: str) -> int:
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor import distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    weights = safetensors_full(directory)
    state: dict[str, Any] = {}
    for name, t in weights.items():
        d = tp_dim(name)
        if d == 0:  # DTensors: torch cuts 64 rows as 22, 22, 20
            state[name] = distribute_tensor(torch.zeros_like(t), mesh, [DShard(0)])
        elif d == 1:  # Shards of uneven width
            lo, hi = t.shape[1] * rank // world, t.shape[1] * (rank + 1) // world
            state[name] = tiercheck.Shard(torch.zeros(t.shape[0], hi - lo), global_shape=t.shape, offsets=(0, lo))
        else:
            state[name] = torch.zeros_like(t)
    hf.load_pretrained(directory, state)
    for name, v in state.items():
        placed = tiercheck.state.sharding.placement_of(v, where=name)
        local, _, offsets = placed
        box = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape, strict=True))
        assert torch.equal(local, weights[name][box]), name
    with tiercheck.Checkpointer({"model": state}, local=ckpt) as ck:  # then saved as usual
        ck.save(1).wait()
    return len(state)


def safetensors_full(directory: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(safetensors_torch.load_file(f))
    return out


def test_load_pretrained_on_3_ranks_then_save_and_export(published: Any, tmp_path: Path) -> None:
    directory, weights = published
    assert run_ranks(_load_3, 3, str(directory), str(tmp_path / "ckpt"), timeout=180) == [len(weights)] * 3
    hf.export(tmp_path / "ckpt", tmp_path / "again")
    got = safetensors_torch.load_file(tmp_path / "again" / "model.safetensors")
    assert set(got) == set(weights) and all(torch.equal(got[k], v) for k, v in weights.items())


# --------------------------------------------------------------------------- object stores


@pytest.fixture(params=["s3", "azure"])
def bucket(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """A fresh prefix on the SeaweedFS (S3) or Azurite (Azure Blob) server, and its fsspec options."""
    name = f"hf{abs(hash(request.node.nodeid)) % 10**10}"
    if request.param == "s3":
        server = request.getfixturevalue("s3_server")
        server.make_bucket(name)
        return f"s3://{name}/p", server.storage_options()
    server = request.getfixturevalue("azurite_server")
    server.make_container(name)
    return f"az://{name}/p", server.storage_options()


def test_export_from_and_load_from_an_object_store(
    bucket: tuple[str, dict[str, Any]], published: Any, tmp_path: Path
) -> None:
    url, options = bucket
    directory, weights = published
    model = transformers.LlamaForCausalLM(tiny_config())
    model.load_state_dict(weights)
    with tiercheck.Checkpointer({"model": model}, local=tmp_path / "local", remote=f"{url}/ckpt",
                                remote_options=options) as ck:  # fmt: skip
        ck.save(7).wait()
        assert ck.drain()["failed"] == 0
    result = hf.export(f"{url}/ckpt", tmp_path / "out", storage_options=options, max_shard_size="100KB")
    assert result.step == 7 and len(result.files) > 1
    assert safetensors_full(str(tmp_path / "out")).keys() == weights.keys()
    assert all(torch.equal(safetensors_full(str(tmp_path / "out"))[k], v) for k, v in weights.items())
    # a published model in the bucket, read by a rank holding every second row block (ranged reads)
    remote = tiercheck.tiers.remote.open_tier(f"{url}/published", storage_options=options)
    for f in sorted(directory.iterdir()):
        remote.write(f.name, [f.read_bytes()])
    shards = tp_state(transformers.LlamaForCausalLM(tiny_config()), 1, 2)
    hf.load_pretrained(f"{url}/published", shards, storage_options=options)
    for name, v in shards.items():
        local = v.local if isinstance(v, tiercheck.Shard) else v
        offsets = v.offsets if isinstance(v, tiercheck.Shard) else (0,) * local.dim()
        assert torch.equal(local, weights[name][tuple(slice(o, o + n) for o, n in zip(offsets, local.shape, strict=True))])


def test_load_pretrained_fills_tied_weights_saved_once(tmp_path: Path) -> None:
    config = tiny_config()
    config.tie_word_embeddings = True
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "tied")
    assert "lm_head.weight" not in safetensors_full(str(tmp_path / "tied"))
    torch.manual_seed(4)
    fresh = transformers.LlamaForCausalLM(config)
    hf.load_pretrained(tmp_path / "tied", fresh)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


def test_mixed_dtypes_odd_sizes_and_edge_shapes_export_exactly(tmp_path: Path) -> None:
    """Tensors of every itemsize, odd lengths (a bf16 of 3 elements before an fp32), 0-d and empty
    ones, chunked small and written in batches smaller than a tensor: each lands where its header says."""
    g = torch.Generator().manual_seed(5)
    model = {
        "a.bf16": torch.randn(3, generator=g).to(torch.bfloat16),
        "b.f32": torch.randn(300, 7, generator=g),
        "c.i64": torch.arange(5, dtype=torch.int64),
        "d.scalar": torch.tensor(2.5),
        "e.empty": torch.zeros(0, 4),
        "f.u8": torch.arange(11, dtype=torch.uint8),
        "g.f16": torch.randn(129, 3, generator=g).half(),
    }
    opts = tiercheck.WriteOptions(chunk_bytes=4096)  # b.f32 in 3 chunks of rows
    with tiercheck.Checkpointer({"model": model}, local=tmp_path / "ck", write=opts) as ck:
        ck.save(1).wait()
    for dtype in (None, "bfloat16"):
        out = tmp_path / f"out-{dtype}"
        hf.export(tmp_path / "ck", out, dtype=dtype, buffer_bytes=2048, max_shard_size="4KB")
        got = safetensors_full(str(out))
        assert got.keys() == model.keys()
        for k, v in model.items():
            want = v.to(torch.bfloat16) if dtype and v.is_floating_point() else v
            assert got[k].dtype == want.dtype and torch.equal(got[k], want), k


def test_a_slice_of_columns_reads_only_its_own_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(6)
    full = {"w": torch.randn(8, 4096, generator=g), "x": torch.randn(4, 6, 1024, generator=g).to(torch.bfloat16)}
    safetensors_torch.save_file(full, tmp_path / "model.safetensors")
    state = {
        "w": tiercheck.Shard(torch.zeros(8, 2048), global_shape=(8, 4096), offsets=(0, 2048)),
        "x": tiercheck.Shard(torch.zeros(2, 3, 1024, dtype=torch.bfloat16), global_shape=(4, 6, 1024), offsets=(1, 2, 0)),
    }
    read: list[int] = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, views, at: read.append(real(fd, views, at)) or read[-1])
    hf.load_pretrained(tmp_path, state)
    assert torch.equal(state["w"].local, full["w"][:, 2048:])
    assert torch.equal(state["x"].local, full["x"][1:3, 2:5])
    # one read a run, and nothing else (the two tensors are read on threads of their own: in any order)
    assert sorted(read) == sorted([2048 * 4] * 8 + [3 * 1024 * 2] * 2)
