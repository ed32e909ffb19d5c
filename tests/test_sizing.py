"""The checkpoint sizer: parameter counts and bytes against published figures, transfer times,
checkpoint intervals (Young 1974, Daly 2006), and a real bandwidth measurement through our tiers.

Every expected number is hand-computed; the arithmetic is in the comments.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tests.cli import run
from tests.servers import SeaweedS3, open_s3fs
from tiercheck.cli.sizing import (
    DEFAULT_TIERS,
    HOST_MEMORY_TIER,
    ModelSpec,
    Sizes,
    TierProfile,
    daly_interval,
    expected_waste_fraction,
    job_mtbf_s,
    measure,
    plan_table,
    size,
    staging_s,
    times,
    young_daly_interval,
)

# GPT-3 175B (Brown et al. 2020, Table 2.1): 96 layers, d_model 12288; GPT-2's BPE vocabulary, 50257.
GPT3 = ModelSpec(layers=96, hidden=12288, vocab=50257, tp=8, pp=16, dp=8)
# 12·L·h²  = 12 · 96 · 12288² = 1152 · 150,994,944 = 173,946,175,488
# 13·L·h   = 13 · 96 · 12288                        =      15,335,424
# V·h      = 50257 · 12288                          =     617,558,016
# total                                             = 174,579,068,928
GPT3_PARAMS = 174_579_068_928


# --------------------------------------------------------------------------- parameter counts


def test_gpt3_parameter_count_matches_the_published_175b() -> None:
    assert GPT3.n_params == GPT3_PARAMS
    assert GPT3_PARAMS == 12 * 96 * 12288**2 + 13 * 96 * 12288 + 50257 * 12288
    # 174.58e9 / 175e9 - 1 = -0.24 %: within 2 % of the published size.
    assert abs(GPT3.n_params / 175e9 - 1) < 0.02


def test_gpt3_bytes_match_the_literature() -> None:
    s = size(GPT3)
    # bf16 weights: 2 B · 174,579,068,928 = 349,158,137,856 B ≈ 349 GB ("350 GB" in the literature).
    assert s.weights_bytes == 349_158_137_856
    assert abs(s.weights_bytes / 350e9 - 1) < 0.02
    # Adam, mixed precision: 12 B/param (fp32 master, m, v) = 2,094,948,827,136 B.
    assert s.optimizer_bytes == 12 * GPT3_PARAMS == 2_094_948_827_136
    # Full state: 14 B/param = 2,444,106,964,992 B ≈ 2.44 TB ("about 2.4 TB").
    assert s.total_bytes == 2_444_106_964_992
    assert abs(s.total_bytes / 2.45e12 - 1) < 0.02
    # TP 8 · PP 16 · DP 8 = 1024 ranks on 8-GPU nodes = 128 nodes.
    assert (s.ranks, s.nodes) == (1024, 128)
    # Per rank: 2,444,106,964,992 / 1024 = 2,386,823,208 exactly (no remainder: 12288 = 3·2¹²).
    assert s.per_rank_bytes == 2_386_823_208
    assert 2_386_823_208 * 1024 == 2_444_106_964_992
    # Per node: 8 · 2,386,823,208 = 19,094,585,664 B ≈ 19.1 GB.
    assert s.per_node_bytes == 19_094_585_664


def test_7b_parameter_count() -> None:
    spec = ModelSpec(layers=32, hidden=4096, vocab=32000)
    # 12·32·4096² = 384 · 16,777,216 = 6,442,450,944
    # 13·32·4096                     =     1,703,936
    # 32000·4096 (tied embedding)    =   131,072,000
    # total                          = 6,575,226,880 ≈ 6.58e9
    assert spec.n_params == 6_575_226_880
    # An untied output head adds another V·h: 6,575,226,880 + 131,072,000 = 6,706,298,880 ≈ 6.7e9.
    assert ModelSpec(layers=32, hidden=4096, vocab=32000, tied_embeddings=False).n_params == 6_706_298_880
    # bf16 + Adam: 14 · 6,575,226,880 = 92,053,176,320 B ≈ 92 GB of checkpoint.
    assert size(spec).total_bytes == 92_053_176_320


def test_llama2_7b_parameter_count_with_gated_mlp_and_untied_head() -> None:
    spec = ModelSpec(layers=32, hidden=4096, vocab=32000, ffn=11008, gated_mlp=True, tied_embeddings=False)
    # per layer: attention 4·4096² + 4·4096         =  67,108,864 + 16,384
    #            MLP 3·4096·11008 + 2·11008 + 4096  = 135,266,304 + 26,112
    #            two LayerNorms 4·4096              =      16,384
    #            sum                                = 202,434,048
    # 32 · 202,434,048 = 6,477,889,536; + embeddings 2 · 32000 · 4096 = 262,144,000 → 6,740,033,536.
    assert spec.n_params == 6_740_033_536
    # Published (Hugging Face Llama-2-7b): 6,738,415,616. We count biases Llama lacks: +0.024 %.
    assert abs(spec.n_params / 6_738_415_616 - 1) < 0.0003


def test_ffn_width_other_than_4h() -> None:
    # L=2, h=8, V=10, f=20: per layer 4·64 + 4·8 + 2·8·20 + 20 + 8 + 4·8 = 256 + 32 + 320 + 28 + 32 = 668
    # total 2 · 668 + 10 · 8 = 1336 + 80 = 1416
    assert ModelSpec(layers=2, hidden=8, vocab=10, ffn=20).n_params == 1416
    # with f = 4h = 32 it is the closed form: 12·2·64 + 13·2·8 + 80 = 1536 + 208 + 80 = 1824
    assert (
        ModelSpec(layers=2, hidden=8, vocab=10, ffn=32).n_params
        == 1824
        == ModelSpec(layers=2, hidden=8, vocab=10).n_params
    )


def test_params_given_directly_wins() -> None:
    assert ModelSpec(params=123, layers=2, hidden=8, vocab=10).n_params == 123


# --------------------------------------------------------------------------- bytes per optimizer


@pytest.mark.parametrize(
    ("weight_bytes", "optimizer", "weights", "optimizer_bytes"),
    [
        (2, "adam", 2000, 12000),  # 2 B + 12 B (fp32 master, m, v) per param
        (2, "sgd", 2000, 8000),  # 2 B + 8 B (fp32 master, momentum)
        (2, "none", 2000, 0),  # weights only
        (4, "adam", 4000, 8000),  # fp32 weights are the master copy: 4 + 4 + 4 = 12 B, not 16
        (4, "sgd", 4000, 4000),  # 4 + momentum 4
    ],
)
def test_bytes_per_optimizer(weight_bytes: int, optimizer: str, weights: int, optimizer_bytes: int) -> None:
    s = size(ModelSpec(params=1000, weight_bytes=weight_bytes, optimizer=optimizer))
    assert (s.weights_bytes, s.optimizer_bytes, s.total_bytes) == (weights, optimizer_bytes, weights + optimizer_bytes)


def test_uneven_split_takes_the_largest_rank_and_caps_the_node_at_the_total() -> None:
    # 10 params · 14 B = 140 B over 3 ranks: shares 47, 47, 46, the largest 47 = ceil(140 / 3).
    # One node of 8 GPUs holds all 3 ranks: 8 · 47 = 376, capped at the total 140.
    assert size(ModelSpec(params=10, tp=3)) == Sizes(
        total_bytes=140, weights_bytes=20, optimizer_bytes=120, per_rank_bytes=47, per_node_bytes=140, ranks=3, nodes=1
    )
    # 17 ranks on 8-GPU nodes: ceil(17 / 8) = 3 nodes; per rank ceil(140 / 17) = 9; per node 8 · 9 = 72.
    s = size(ModelSpec(params=10, dp=17))
    assert (s.per_rank_bytes, s.per_node_bytes, s.nodes) == (9, 72, 3)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # neither params nor the architecture
        {"layers": 2, "hidden": 8},  # no vocab
        {"params": 0},
        {"params": 10, "optimizer": "adagrad"},
        {"params": 10, "tp": 0},
        {"params": 10, "gpus_per_node": 0},
        {"layers": 2, "hidden": 8, "vocab": 10, "ffn": 0},
    ],
)
def test_bad_specs_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ModelSpec(**kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- times


def test_times_per_node_and_shared_tiers() -> None:
    s = size(GPT3)
    nvme, s3, pfs = DEFAULT_TIERS
    # local NVMe, per node: 19,094,585,664 B / 2e9 B/s = 9.547292832 s; / 3e9 B/s = 6.364861888 s
    assert times(s, nvme) == pytest.approx((9.547292832, 6.364861888), rel=1e-12)
    # S3-like: each node 19,094,585,664 B / 2.5e9 B/s = 7.64 s, but the job's 2,444,106,964,992 B through its
    # 10e9 B/s ceiling take 244.4106964992 s, both ways: the ceiling sets the time
    assert times(s, s3) == pytest.approx((244.4106964992, 244.4106964992), rel=1e-12)
    # parallel FS: 19,094,585,664 / 5e9 = 3.82 s per node; the job through 50e9: 48.88213929984 s
    assert times(s, pfs) == pytest.approx((48.88213929984, 48.88213929984), rel=1e-12)
    # one node on its own shared tier without a ceiling: its own rate, 19,094,585,664 / 5e9 = 3.8189171328 s
    assert times(s, TierProfile("pfs", 5e9, 5e9, shared=True))[0] == pytest.approx(3.8189171328, rel=1e-12)
    # host staging, per GPU: 2,386,823,208 / 25e9 = 0.09547292832 s
    assert staging_s(s, HOST_MEMORY_TIER) == pytest.approx(0.09547292832, rel=1e-12)


def test_a_one_node_job_stalls_less_async_than_blocking_and_gets_a_node_s_share_of_a_shared_tier() -> None:
    """``tiercheck plan --params 7B``: the async stall (a host copy assumed at 10 GB/s per node: 9.8 s) came out
    longer than a blocking parallel-filesystem save (1.96 s: the whole filesystem's 50 GB/s to one node), and S3's
    10 GB/s went to one node too. Each GPU copies its own share to host memory over its own link, and a node
    reaches a shared tier at its own per-node rate, up to the tier's ceiling for the job."""
    plan = plan_table(ModelSpec(params=7 * 10**9), DEFAULT_TIERS, node_mtbf_hours=5000, restart_s=None,
                      staging=HOST_MEMORY_TIER)  # fmt: skip
    nvme, s3, pfs = plan["tiers"]
    # 7e9 · 14 B = 98e9 B, all on one GPU of one node. Per node: NVMe 2 GB/s, S3 2.5 GB/s, parallel FS 5 GB/s.
    assert (nvme["save_s"], s3["save_s"], pfs["save_s"]) == pytest.approx((49.0, 39.2, 19.6), rel=1e-12)
    # The host copy: 98e9 B over one GPU's link at 25 GB/s = 3.92 s, below every blocking save.
    assert pfs["async"]["blocking_s"] == pytest.approx(3.92, rel=1e-12)
    assert all(row["async"]["blocking_s"] < row["save_s"] for row in plan["tiers"])
    # Every figure says where it comes from: stated here (typical figures), or measured.
    assert {row["tier"]["source"] for row in plan["tiers"]} == {"stated"}
    assert plan["staging"]["source"] == "stated"
    table = run("plan", "--params", "7B").stdout
    assert "figures" in table and "stated" in table and "per GPU" in table, table
    # Yours, with a ceiling for the job: 16 nodes (128 GPUs) at 5 GB/s each, at most 20 GB/s in all:
    # 98e9 / 16 = 6.125e9 B per node / 5e9 = 1.225 s, but 98e9 / 20e9 = 4.9 s through the ceiling.
    mine = json.loads(run("plan", "--params", "7B", "--dp", "128", "--tier", "pfs:5:5:shared:20", "--json").stdout)
    [row] = mine["tiers"]
    assert row["save_s"] == pytest.approx(4.9) and row["tier"]["job_bytes_per_s"] == 20e9
    refused = run("plan", "--params", "7B", "--tier", "nvme:2:3:node:20", check=False)  # a node's own: no ceiling
    assert refused.returncode == 2 and "JOB_GBPS" in refused.stderr, refused.stderr


def test_tier_refuses_nonpositive_bandwidth() -> None:
    with pytest.raises(ValueError):
        TierProfile("x", 0.0, 1.0, shared=False)
    with pytest.raises(ValueError):
        TierProfile("x", 1.0, math.inf, shared=True)
    with pytest.raises(ValueError):
        TierProfile("x", 1.0, 1.0, shared=True, job_bytes_per_s=0.0)
    with pytest.raises(ValueError):
        TierProfile("x", 1.0, 1.0, shared=False, job_bytes_per_s=1.0)  # a node's own tier has no job ceiling


# --------------------------------------------------------------------------- intervals and waste


def test_young_interval() -> None:
    # sqrt(2 · 60 s · 86400 s) = sqrt(10,368,000) = 3219.9379 s (~54 min)
    assert young_daly_interval(60, 86400) == pytest.approx(3219.937887599697, rel=1e-12)
    # sqrt(2 · 300 · 86400) = sqrt(51,840,000) = 7200 exactly
    assert young_daly_interval(300, 86400) == 7200.0
    assert young_daly_interval(0, 86400) == 0.0


def test_daly_interval_reproduces_the_papers_figures() -> None:
    # Daly 2006, Figs. 3-5: δ = 5 min, M = 24 h / 6 h / 15 min → τ_opt = 117 / 57 / 9.1 min.
    # M = 86400: C/(2M) = 300/172800 = 1/576, sqrt = 1/24;
    #   7200 · (1 + 1/72 + 1/5184) - 300 = 7200 + 100 + 1.3889 - 300 = 7001.3889 s = 116.69 min
    assert daly_interval(300, 86400) == pytest.approx(7000 + 7200 / 5184, rel=1e-12)
    assert round(daly_interval(300, 86400) / 60) == 117
    # M = 21600: sqrt(2·300·21600) = 3600; C/(2M) = 1/144, sqrt = 1/12;
    #   3600 · (1 + 1/36 + 1/1296) - 300 = 3600 + 100 + 2.7778 - 300 = 3402.7778 s = 56.71 min
    assert daly_interval(300, 21600) == pytest.approx(3400 + 3600 / 1296, rel=1e-12)
    assert round(daly_interval(300, 21600) / 60) == 57
    # M = 900: sqrt(540,000) = 734.8469; C/(2M) = 1/6;
    #   734.8469 · (1 + sqrt(1/6)/3 + 1/54) - 300 = 548.455 s = 9.14 min
    assert daly_interval(300, 900) == pytest.approx(math.sqrt(540_000) * (1 + math.sqrt(1 / 6) / 3 + 1 / 54) - 300)
    assert round(daly_interval(300, 900) / 60, 1) == 9.1
    # C = 60, M = 86400: 3219.9379 · (1 + sqrt(1/2880)/3 + 1/25920) - 60 = 3180.0621 s
    assert daly_interval(60, 86400) == pytest.approx(3180.0621135984475, rel=1e-12)
    # C ≥ 2M: checkpoint every M
    assert daly_interval(200, 100) == 100.0


def test_expected_waste() -> None:
    # C/T + (T/2 + R)/M with T = 3220, C = 60, R = 300, M = 86400:
    #   60/3220 = 0.0186335, (1610 + 300)/86400 = 0.0221065, sum = 0.0407400
    assert expected_waste_fraction(3220, 60, 300, 86400) == pytest.approx(0.04074002185415229, rel=1e-12)
    # T = 7200, C = 300, R = 0, M = 86400: 300/7200 + 3600/86400 = 1/24 + 1/24 = 1/12
    assert expected_waste_fraction(7200, 300, 0, 86400) == pytest.approx(1 / 12, rel=1e-12)
    # Young's interval is the minimum of the first-order waste
    young = young_daly_interval(60, 86400)
    at_young = expected_waste_fraction(young, 60, 300, 86400)
    assert at_young < expected_waste_fraction(0.9 * young, 60, 300, 86400)
    assert at_young < expected_waste_fraction(1.1 * young, 60, 300, 86400)
    with pytest.raises(ValueError):
        expected_waste_fraction(0, 60, 300, 86400)


def test_job_mtbf() -> None:
    # 1000 h · 3600 s/h / 128 nodes = 28,125 s
    assert job_mtbf_s(1000, 128) == 28125.0
    with pytest.raises(ValueError):
        job_mtbf_s(0, 1)
    with pytest.raises(ValueError):
        job_mtbf_s(10, 0)


# --------------------------------------------------------------------------- the plan


def test_plan_table_gpt3() -> None:
    plan = plan_table(GPT3, DEFAULT_TIERS, node_mtbf_hours=1280, restart_s=None, staging=HOST_MEMORY_TIER)
    json.dumps(plan, allow_nan=False)  # what the CLI prints
    assert plan["model"]["n_params"] == GPT3_PARAMS
    assert plan["sizes"]["total_bytes"] == 2_444_106_964_992
    # 1280 h · 3600 / 128 nodes = 36,000 s
    assert plan["job_mtbf_s"] == 36000.0
    nvme, s3, pfs = plan["tiers"]
    assert [r["tier"]["name"] for r in plan["tiers"]] == ["local-nvme", "s3", "parallel-fs"]

    # local NVMe: C = 9.547292832 s, R = restore = 6.364861888 s
    assert nvme["bytes_per_writer"] == 19_094_585_664
    assert (nvme["save_s"], nvme["restore_s"], nvme["restart_s"]) == pytest.approx(
        (9.547292832, 6.364861888, 6.364861888), rel=1e-12
    )
    # Young: sqrt(2 · 9.547292832 · 36000) = sqrt(687,405.083904) = 829.0989 s
    assert nvme["young_interval_s"] == pytest.approx(math.sqrt(687_405.083904), rel=1e-12)
    assert nvme["young_interval_s"] == pytest.approx(829.0989, abs=1e-4)
    # Daly: 829.0989 · (1 + sqrt(9.547292832/72000)/3 + 9.547292832/648000) - 9.547292832 = 822.7463 s
    x = 9.547292832 / 72000
    assert nvme["daly_interval_s"] == pytest.approx(
        math.sqrt(687_405.083904) * (1 + math.sqrt(x) / 3 + x / 9) - 9.547292832
    )
    assert nvme["daly_interval_s"] == pytest.approx(822.7463, abs=1e-4)
    # waste at Young: 9.5473/829.0989 + (414.5495 + 6.3649)/36000 = 0.0115153 + 0.0116920 = 0.0232073
    assert nvme["waste_fraction_young"] == pytest.approx(
        9.547292832 / math.sqrt(687_405.083904) + (math.sqrt(687_405.083904) / 2 + 6.364861888) / 36000, rel=1e-12
    )
    assert nvme["waste_fraction_young"] == pytest.approx(0.0232073, abs=1e-7)

    # S3: C = R = 244.4106964992 s; Young sqrt(2 · 244.4106964992 · 36000) = sqrt(17,597,570.1479) = 4194.95 s
    assert s3["save_s"] == s3["restart_s"] == pytest.approx(244.4106964992, rel=1e-12)
    assert s3["young_interval_s"] == pytest.approx(math.sqrt(17_597_570.14794240), rel=1e-12)
    # parallel FS: C = 48.88213929984 s; Young sqrt(2 · 48.88213929984 · 36000) = sqrt(3,519,514.02959) = 1876.04 s
    assert pfs["young_interval_s"] == pytest.approx(math.sqrt(3_519_514.02958848), rel=1e-12)

    # The fastest save is the node-local NVMe (9.5 s < 48.9 s < 244.4 s).
    assert plan["fastest"]["tier"] == "local-nvme"
    assert plan["fastest"]["daly_interval_s"] == nvme["daly_interval_s"]

    # Async: the training waits only for staging, each GPU its 2,386,823,208 B at 25e9 B/s = 0.09547292832 s;
    # Young sqrt(2 · 0.09547292832 · 36000) = sqrt(6,874.05083904) = 82.9099 s ≥ the 9.5 s write.
    a = nvme["async"]
    assert a["blocking_s"] == pytest.approx(0.09547292832, rel=1e-12)
    assert a["interval_s"] == pytest.approx(math.sqrt(6_874.05083904), rel=1e-12)
    # waste: 0.0955/82.9099 + (41.4549 + 9.5473 + 6.3649)/36000 = 0.0011515 + 0.0015935 = 0.0027450
    assert a["waste_fraction"] == pytest.approx(
        0.09547292832 / math.sqrt(6_874.05083904)
        + (math.sqrt(6_874.05083904) / 2 + 9.547292832 + 6.364861888) / 36000,
        rel=1e-12,
    )
    # S3's 244 s write is above Young's 82.9 s for staging, so its async interval is its own write time:
    # one save is written before the next. The same with a 1 GB/s ceiling for the job:
    # 2,444,106,964,992 / 1e9 = 2444.1 s > 82.9 s.
    assert s3["async"]["interval_s"] == pytest.approx(244.4106964992, rel=1e-12)
    slow = plan_table(
        GPT3, [TierProfile("slow", 1e9, 1e9, shared=True, job_bytes_per_s=1e9)], node_mtbf_hours=1280, restart_s=600,
        staging=HOST_MEMORY_TIER,
    )  # fmt: skip
    row = slow["tiers"][0]
    assert row["restart_s"] == 600
    assert row["async"]["interval_s"] == pytest.approx(2444.106964992, rel=1e-12)


def test_plan_table_without_staging_and_with_a_given_restart() -> None:
    plan = plan_table(ModelSpec(params=10**9), DEFAULT_TIERS[:1], node_mtbf_hours=24, restart_s=120)
    json.dumps(plan, allow_nan=False)
    # 1e9 · 14 B = 14e9 B on one node; NVMe 2e9 B/s → 7 s; MTBF 24 h · 3600 = 86,400 s
    row = plan["tiers"][0]
    assert row["save_s"] == 7.0 and row["restart_s"] == 120
    # Young sqrt(2 · 7 · 86400) = sqrt(1,209,600) = 1099.82 s
    assert row["young_interval_s"] == pytest.approx(math.sqrt(1_209_600), rel=1e-12)
    assert "async" not in row and plan["staging"] is None
    with pytest.raises(ValueError):
        plan_table(ModelSpec(params=10), [], node_mtbf_hours=24, restart_s=None)


# --------------------------------------------------------------------------- measuring a real tier


def _everything_under(root: Path) -> list[str]:
    return [os.path.relpath(os.path.join(d, f), root) for d, dirs, files in os.walk(root) for f in [*dirs, *files]]


def test_measure_a_local_directory_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "keep").write_text("mine")
    tier = measure(str(tmp_path), nbytes=4 * 2**20)
    assert tier.shared is False and tier.source == "measured"
    assert tier.name == f"measured:{tmp_path}"
    assert 0 < tier.write_bytes_per_s < math.inf and 0 < tier.read_bytes_per_s < math.inf
    assert _everything_under(tmp_path) == ["keep"]  # only what was there before
    tier = measure(f"file://{tmp_path}", nbytes=1000)
    assert tier.shared is False and _everything_under(tmp_path) == ["keep"]


def test_measure_refuses_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        measure(str(tmp_path / "nope"), nbytes=1000)
    assert not (tmp_path / "nope").exists()


def test_measure_s3(s3_server: SeaweedS3, s3_bucket: str) -> None:
    options = s3_server.storage_options()
    # 40 MiB: above the tier's 2 · 16 MiB threshold, so the multipart upload path is measured too
    tier = measure(f"s3://{s3_bucket}/ckpt", nbytes=40 * 2**20, storage_options=options)
    assert tier.shared is True and tier.source == "measured" and tier.job_bytes_per_s is None
    assert tier.write_bytes_per_s > 0 and tier.read_bytes_per_s > 0
    with open_s3fs(**options) as fs:
        assert fs.find(s3_bucket) == []


@pytest.mark.parametrize(
    ("text", "count"),
    [("7B", 7_000_000_000), ("7b", 7_000_000_000), ("70e9", 70_000_000_000), ("1.5T", 1_500_000_000_000),
     ("350M", 350_000_000), ("125k", 125_000), ("6738415616", 6_738_415_616), ("1_000", 1000)],
)  # fmt: skip
def test_plan_takes_a_parameter_count_as_people_write_it(text: str, count: int) -> None:
    result = run("plan", "--params", text, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["model"]["n_params"] == count


def test_plan_prints_one_unit_per_column_and_counts_in_words() -> None:
    result = run("plan", "--params", "7B")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].endswith("TP=1 PP=1 DP=1 on 1 GPU, 1 node"), lines[0]
    header = next(line for line in lines if line.startswith("tier "))
    for heading in ("write/node (GB/s)", "read/node (GB/s)", "job max (GB/s)", "save (s)", "restore (s)",
                    "lost work (%)"):  # fmt: skip
        assert heading in header, header
    rows = lines[lines.index(header) + 1 : lines.index(header) + 4]
    for row in rows:  # units live in the headings: a cell is a number
        _, kind, source, *cells = row.replace("node's own", "own").split()
        assert kind in ("own", "shared") and source == "stated", row
        assert all(cell.replace(".", "").isdigit() or cell == "-" for cell in cells), row
    gpt3 = run("plan", "--layers", "96", "--hidden", "12288", "--vocab", "50257", "--tp", "8", "--pp", "16", "--dp", "8")
    assert "on 1024 GPUs, 128 nodes" in gpt3.stdout and "async interval (min)" in gpt3.stdout, gpt3.stdout


# ------------------------------------------------------------------ a replaced node's restart (--link-gbps)


def _bench_json(path: Path, summaries: list[dict[str, float]]) -> Path:
    """What bench/replace_node.py writes, with only the figures read here."""
    path.write_text(json.dumps({"jobs": [{"nodes": 2 + i, "summary": s} for i, s in enumerate(summaries)]}))
    return path


def test_a_replaced_nodes_restart_takes_its_bytes_over_the_link_at_the_measured_ratio_plus_the_fixed_costs(
    tmp_path: Path,
) -> None:
    from tiercheck.cli.replacing import bytes_in, load_figures, replace_node

    figures = load_figures(_bench_json(tmp_path / "r.json", [{"transfer_vs_gloo": 2.0, "fixed_s": 0.2},
                                                             {"transfer_vs_gloo": 1.5, "fixed_s": 0.3}]))  # fmt: skip
    assert (figures.transfer_ratio, figures.fixed_s, figures.source) == (2.0, 0.3, str(tmp_path / "r.json"))
    got = replace_node(nbytes=50_000_000_000, link_gbps=400, figures=figures)  # 400 Gb/s = 50 GB/s: 1 s, x 2
    assert (got["link_bytes_per_s"], got["transfer_s"], got["fixed_s"]) == (50e9, 2.0, 0.3)
    assert got["replace_s"] == pytest.approx(2.3) and str(tmp_path / "r.json") in got["assumptions"][1]
    # GPT-3 at TP 8 x PP 16 x DP 8: a rank holds 1/128 of the weights and 1/1024 of Adam's state; 8 ranks a node.
    n = 174_579_068_928
    got_in = bytes_in(weights=2 * n, optimizer=12 * n, tp=8, pp=16, dp=8, ranks_on_node=8)
    assert got_in == 8 * (-(-2 * n // 128) + -(-12 * n // 1024))
    # TP 1 x DP 8 a node: the weights once (its ranks share them), Adam's state a share each; at most the whole state.
    assert bytes_in(weights=16, optimizer=96, tp=1, pp=1, dp=16, ranks_on_node=8) == 16 + 8 * 6
    assert bytes_in(weights=10, optimizer=20, tp=1, pp=1, dp=1, ranks_on_node=8) == 30


def test_a_replaced_nodes_figures_come_from_the_bench_where_found_else_stated_and_a_bad_file_is_named(
    tmp_path: Path,
) -> None:
    from tiercheck.cli.replacing import RESULTS, STATED, default_figures, load_figures
    from tiercheck.errors import InvalidArgumentError

    found = tmp_path / RESULTS
    found.parent.mkdir(parents=True)
    _bench_json(found, [{"transfer_vs_gloo": 1.25, "fixed_s": 0.5}])
    assert default_figures(tmp_path).transfer_ratio == 1.25 and default_figures(tmp_path).source == str(found)
    assert STATED.source == "stated" and (STATED.transfer_ratio, STATED.fixed_s) == (1.5, 1.0)
    found.write_text('{"jobs": []}')
    with pytest.raises(InvalidArgumentError, match=f"{found}: not bench/replace_node.py's measurements"):
        load_figures(found)
    _bench_json(found, [{"transfer_vs_gloo": 0, "fixed_s": 0.5}])
    with pytest.raises(InvalidArgumentError, match="transfer_vs_gloo must be above 0"):
        load_figures(found)


def test_plan_gives_the_replacement_time_at_a_link_speed_and_says_which_figures_it_assumed(tmp_path: Path) -> None:
    args = ("plan", "--params", "7e9", "--dp", "16", "--link-gbps", "400")
    got = json.loads(run(*args, "--replace-figures", "stated", "--json").stdout)["replace"]
    # A node of 8 DP replicas: the 7e9 bf16 weights once (14 GB) + 8 shares of Adam's 84 GB split over 16 (42 GB):
    # 56 GB in over 50 GB/s, x 1.5, + 1 s.
    assert got["bytes_in"] == 56_000_000_000 and got["replace_s"] == pytest.approx(56 / 50 * 1.5 + 1.0)
    assert got["figures"] == {"transfer_ratio": 1.5, "fixed_s": 1.0, "source": "stated"}
    text = run(*args, "--replace-figures", "stated").stdout
    assert "replacing a node (its memory lost, restored from its peers' memory): 2.7 s = 1.7 s transfer" in text
    assert text.rstrip().endswith("+ 1.0 s agree, plan, verify, place (stated)"), text
    measured = _bench_json(tmp_path / "r.json", [{"transfer_vs_gloo": 2.0, "fixed_s": 0.25}])
    assert f"(measured: {measured})" in run(*args, "--replace-figures", str(measured)).stdout
    bad = run(*args, "--replace-figures", str(tmp_path / "none.json"), check=False)
    assert bad.returncode == 1 and f"{tmp_path / 'none.json'}: not bench/replace_node.py's measurements" in bad.stderr
