"""Checkpoint sizing from first principles: how many bytes a training state holds, how long a tier
takes to write and read them, and how often to checkpoint.

Pure arithmetic (stdlib only, no torch) except :func:`measure`, which times a real write and read
through tiercheck's own storage tier. Units: bytes, seconds, bytes per second (decimal: 1 GB = 1e9 B).

Sources of the formulas:

* Parameter count of a GPT-style decoder: ``12·L·h² + 13·L·h + V·h`` (Kaplan et al., "Scaling Laws
  for Neural Language Models", 2020, Table 1 gives ``N ≈ 12·L·h²``; Narayanan et al., "Efficient
  Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21, Section 5.1, gives
  ``12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))``, i.e. the same plus ``s·h`` position embeddings; the
  BigScience notes (bigscience-workshop/bigscience, experiments/gpt2-utils.md) itemise the terms).
  See :attr:`ModelSpec.n_params` for exactly what is counted.
* Bytes of training state under mixed-precision Adam: 2 B of bf16/fp16 weights plus 12 B of fp32
  master weights, first and second moments per parameter (Rajbhandari et al., "ZeRO: Memory
  Optimizations Toward Training Trillion Parameter Models", SC'20, Section 3.1: "K = 12").
* Checkpoint interval: Young, "A first order approximation to the optimum checkpoint interval",
  CACM 17(9), 1974: ``T = sqrt(2·C·M)``; Daly, "A higher order estimate of the optimum checkpoint
  interval for restart dumps", Future Generation Computer Systems 22(3), 2006 (doi:10.1016/j.future.2004.11.016):
  ``T = sqrt(2·C·M)·(1 + sqrt(C/(2M))/3 + C/(18M)) - C`` for ``C < 2M``, else ``T = M`` (its Figs. 3-5:
  C = 5 min with M = 24 h, 6 h, 15 min gives 117, 57, 9.1 min).
* Expected waste (first order, same model as Young's): per interval of ``T`` seconds of work we pay
  ``C`` to checkpoint; a failure (rate ``1/M``) costs ``R`` to restart plus, on average, ``T/2`` of
  lost work. Waste fraction ``≈ C/T + (T/2 + R)/M``; its minimum over ``T`` is Young's interval.
* Job MTBF with ``n`` nodes failing independently (exponential lifetimes): ``M_job = M_node / n``.
"""


from __future__ import annotations

import math
import os
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "DEFAULT_TIERS",
    "HOST_MEMORY_TIER",
    "OPTIMIZER_BYTES_PER_PARAM",
    "ModelSpec",
    "Sizes",
    "TierProfile",
    "daly_interval",
    "expected_waste_fraction",
    "job_mtbf_s",
    "measure",
    "plan_table",
    "size",
    "staging_s",
    "times",
    "young_daly_interval",
]

#: Optimizer-state bytes per parameter under mixed precision (weights kept in 2-byte bf16/fp16):
#: ``adam``: fp32 master weights + fp32 first and second moments = 4 + 4 + 4 (ZeRO paper's K = 12);
#: ``sgd``: fp32 master weights + fp32 momentum = 4 + 4; ``none``: nothing (weights only, e.g. inference).
#: With 4-byte (fp32) weights the weights *are* the master copy and its 4 B are not counted again.
OPTIMIZER_BYTES_PER_PARAM = {"adam": 12, "sgd": 8, "none": 0}
_MASTER_BYTES = 4  # the fp32 master copy inside the figures above


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model and its parallel layout. Give ``params`` directly, or ``layers``, ``hidden`` and
    ``vocab`` (and optionally ``ffn``) to have them counted; ``params`` wins when both are given.

    ``tp``, ``pp``, ``dp``: tensor-, pipeline- and data-parallel degrees; ranks = tp·pp·dp, placed
    ``gpus_per_node`` to a node. ``tied_embeddings=False`` counts a separate output head (another
    V·h, as in Llama); ``gated_mlp=True`` counts three MLP matrices (SwiGLU, as in Llama) instead of two.
    """

    params: int | None = None
    layers: int | None = None
    hidden: int | None = None
    vocab: int | None = None
    ffn: int | None = None
    weight_bytes: int = 2
    optimizer: str = "adam"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    gpus_per_node: int = 8
    tied_embeddings: bool = True
    gated_mlp: bool = False

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_BYTES_PER_PARAM:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_BYTES_PER_PARAM)}, not {self.optimizer!r}")
        for name in ("weight_bytes", "tp", "pp", "dp", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.params is not None:
            if self.params < 1:
                raise ValueError(f"params must be at least 1, not {self.params}")
            return
        missing = [n for n in ("layers", "hidden", "vocab") if getattr(self, n) is None]
        if missing:
            raise ValueError(f"give params, or layers, hidden and vocab (missing: {', '.join(missing)})")
        for name in ("layers", "hidden", "vocab", "ffn"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, not {value}")

    @property
    def n_params(self) -> int:
        """``params`` if given, else the parameters of a GPT-style decoder, counted as follows.

        Per layer, with hidden size ``h`` and MLP width ``f`` (``ffn``, default ``4h``):

        * attention: Q, K, V and output projections, ``4·h²`` weights + ``4·h`` biases
          (full multi-head attention; for grouped-query attention give ``params`` instead);
        * MLP: up and down projections, ``2·h·f`` weights + ``f + h`` biases
          (gated: gate, up and down, ``3·h·f`` weights + ``2·f + h`` biases);
        * two LayerNorms, each with a gain and a bias: ``4·h``.

        Plus the token embedding ``V·h``, shared with the output head (``tied_embeddings``; untied
        adds another ``V·h``). With ``f = 4h`` and no gating the total is exactly
        ``12·L·h² + 13·L·h + V·h``. Not counted (each well under 0.1 % for billion-parameter models):
        learned position embeddings (``seq·h``; none with rotary embeddings), the final LayerNorm
        (``2h``). Biases and LayerNorm biases are counted even for models without them (Llama):
        an overcount of about ``L·(9h + f)``, 0.02 % at 7B.
        """
        if self.params is not None:
            return self.params
        assert self.layers is not None and self.hidden is not None and self.vocab is not None  # __post_init__
        L, h, V = self.layers, self.hidden, self.vocab  # the papers' names
        f = self.ffn if self.ffn is not None else 4 * h
        attention = 4 * h * h + 4 * h
        mlp = (3 * h * f + 2 * f + h) if self.gated_mlp else (2 * h * f + f + h)
        norms = 4 * h
        embeddings = V * h * (1 if self.tied_embeddings else 2)
        return L * (attention + mlp + norms) + embeddings

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class Sizes:
    """Bytes of one checkpoint. ``per_rank_bytes``: the largest rank's share of the unique bytes,
    i.e. ``ceil(total / (tp·pp·dp))``: model and optimizer state are split over TP·PP ranks, and
    tiercheck spreads the writing of replicated shards over the DP replicas, so over DP too (ZeRO
    partitions are split over DP anyway). Assumes balanced pipeline stages. ``per_node_bytes``:
    ``per_rank · gpus_per_node``, at most ``total``."""

    total_bytes: int
    weights_bytes: int
    optimizer_bytes: int
    per_rank_bytes: int
    per_node_bytes: int
    ranks: int
    nodes: int


def size(spec: ModelSpec) -> Sizes:
    """The bytes a checkpoint of ``spec`` holds: weights (``n_params · weight_bytes``) plus optimizer
    state (``n_params`` times :data:`OPTIMIZER_BYTES_PER_PARAM`, less the fp32 master copy when the
    weights are fp32 themselves), and how they spread over ranks and nodes."""
    n = spec.n_params
    weights = n * spec.weight_bytes
    per_param = OPTIMIZER_BYTES_PER_PARAM[spec.optimizer]
    if per_param and spec.weight_bytes >= _MASTER_BYTES:
        per_param -= _MASTER_BYTES
    optimizer = n * per_param
    total = weights + optimizer
    ranks = spec.ranks
    per_rank = -(-total // ranks)  # ceil: the largest rank's share
    per_node = min(per_rank * spec.gpus_per_node, total)
    nodes = -(-ranks // spec.gpus_per_node)
    return Sizes(
        total_bytes=total,
        weights_bytes=weights,
        optimizer_bytes=optimizer,
        per_rank_bytes=per_rank,
        per_node_bytes=per_node,
        ranks=ranks,
        nodes=nodes,
    )


@dataclass(frozen=True)
class TierProfile:
    """The bandwidth of a place checkpoints go (a profile for sizing, not a storage
    :class:`tiercheck.tiers.base.Tier`). ``write_bytes_per_s`` and ``read_bytes_per_s`` are what one
    node gets (its link, its clients). ``shared=False``: the tier is the node's own (local NVMe), so
    the job's aggregate grows with the nodes; ``True``: one service all nodes share (an object store,
    a parallel filesystem), which gives the whole job at most ``job_bytes_per_s`` (None: no ceiling
    known, as for a figure measured from one node). ``source``: ``"stated"`` (a figure given: a
    typical one, or yours) or ``"measured"`` (:func:`measure`)."""

    name: str
    write_bytes_per_s: float
    read_bytes_per_s: float
    shared: bool
    job_bytes_per_s: float | None = None
    source: str = "stated"

    def __post_init__(self) -> None:
        for name in ("write_bytes_per_s", "read_bytes_per_s", "job_bytes_per_s"):
            value = getattr(self, name)
            if (value is not None or name != "job_bytes_per_s") and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{self.name}: {name} must be a positive finite number, not {value}")
        if self.job_bytes_per_s is not None and not self.shared:
            raise ValueError(f"{self.name}: a job ceiling (job_bytes_per_s) is a shared tier's")
        if self.source not in ("stated", "measured"):
            raise ValueError(f"{self.name}: source must be 'stated' or 'measured', not {self.source!r}")


#: Host staging: each GPU copying its share of the state to (pinned) host memory, over its own
#: link, all at once: the only part of a tiercheck save the training thread waits for. Its figure is
#: per GPU. STATED, not measured: 25 GB/s, a pinned device-to-host copy over PCIe Gen4 x16; tiercheck's
#: own run on one H200 (PCIe Gen5) measured 54.9 GB/s, and staging ran at 0.966x that
#: (``bench/results/gpu-nvidia-h200.json``, docs/performance.md). Not a storage tier (nothing survives
#: a crash there), so it is not in :data:`DEFAULT_TIERS`.
HOST_MEMORY_TIER = TierProfile("host-memory", 25e9, 25e9, shared=False)

#: Typical figures, STATED (not measured): override them with yours (``--tier``) or :func:`measure`.
#: Every figure is per node; a shared tier's ceiling for the whole job is ``job_bytes_per_s``:
#:
#: * ``local-nvme``: 2 GB/s write, 3 GB/s read per node (one datacenter PCIe Gen4 NVMe drive,
#:   sustained, with fsync; RAIDs of several drives do proportionally better);
#: * ``s3``: 2.5 GB/s per node (a node's parts in flight: 16 streams of 100-300 MB/s), at most
#:   10 GB/s for the job (an S3-like object store; real limits depend on request rates per prefix,
#:   the number of clients and the network);
#: * ``parallel-fs``: 5 GB/s per node (one client of a Lustre / GPFS class filesystem), at most
#:   50 GB/s for the job.
DEFAULT_TIERS: list[TierProfile] = [
    TierProfile("local-nvme", 2e9, 3e9, shared=False),
    TierProfile("s3", 2.5e9, 2.5e9, shared=True, job_bytes_per_s=10e9),
    TierProfile("parallel-fs", 5e9, 5e9, shared=True, job_bytes_per_s=50e9),
]


def times(sizes: Sizes, tier: TierProfile) -> tuple[float, float]:
    """(save seconds, restore seconds) of one checkpoint on ``tier``: every node moves its own
    ``per_node_bytes`` in parallel at the tier's per-node bandwidth; on a shared tier the job's
    ``total_bytes`` also pass through its ceiling for the job, and the slower of the two sets the
    time. Ignores latency and per-request overheads."""
    write = sizes.per_node_bytes / tier.write_bytes_per_s
    read = sizes.per_node_bytes / tier.read_bytes_per_s
    if tier.job_bytes_per_s is None:
        return write, read
    ceiling = sizes.total_bytes / tier.job_bytes_per_s
    return max(write, ceiling), max(read, ceiling)


def staging_s(sizes: Sizes, staging: TierProfile) -> float:
    """Seconds the training waits for an async save: each GPU copies its own ``per_rank_bytes`` to
    host memory at ``staging``'s per-GPU bandwidth, all GPUs at once."""
    return sizes.per_rank_bytes / staging.write_bytes_per_s


def young_daly_interval(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Young's (1974) optimum interval between checkpoints: ``sqrt(2·C·M)``, with ``C`` the cost
    of one checkpoint and ``M`` the mean time between failures."""
    _check_cost_mtbf(checkpoint_cost_s, mtbf_s)
    return math.sqrt(2 * checkpoint_cost_s * mtbf_s)


def daly_interval(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Daly's (2006) higher-order optimum interval: for ``C < 2M``,
    ``sqrt(2·C·M)·(1 + sqrt(C/(2M))/3 + C/(9·2M)) - C``; otherwise ``M``."""
    _check_cost_mtbf(checkpoint_cost_s, mtbf_s)
    c, m = checkpoint_cost_s, mtbf_s
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


def expected_waste_fraction(interval_s: float, checkpoint_cost_s: float, restart_s: float, mtbf_s: float) -> float:
    """First-order expected fraction of time lost: ``C/T + (T/2 + R)/M`` (checkpointing overhead plus,
    per failure, half an interval of lost work and the restart). Only meaningful while it is well
    below 1 (``T``, ``C``, ``R`` all small against ``M``)."""
    if not interval_s > 0:
        raise ValueError(f"interval_s must be positive, not {interval_s}")
    if restart_s < 0:
        raise ValueError(f"restart_s must not be negative, not {restart_s}")
    _check_cost_mtbf(checkpoint_cost_s, mtbf_s)
    return checkpoint_cost_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s


def job_mtbf_s(node_mtbf_hours: float, nodes: int) -> float:
    """The job's mean time between failures in seconds when any one of ``nodes`` independent nodes
    (exponential lifetimes, mean ``node_mtbf_hours``) failing interrupts it: ``M_node / nodes``."""
    if not (node_mtbf_hours > 0 and math.isfinite(node_mtbf_hours)):
        raise ValueError(f"node_mtbf_hours must be a positive finite number, not {node_mtbf_hours}")
    if nodes < 1:
        raise ValueError(f"nodes must be at least 1, not {nodes}")
    return node_mtbf_hours * 3600.0 / nodes


def _check_cost_mtbf(checkpoint_cost_s: float, mtbf_s: float) -> None:
    if not (checkpoint_cost_s >= 0 and math.isfinite(checkpoint_cost_s)):
        raise ValueError(f"checkpoint_cost_s must be a non-negative finite number, not {checkpoint_cost_s}")
    if not (mtbf_s > 0 and math.isfinite(mtbf_s)):
        raise ValueError(f"mtbf_s must be a positive finite number, not {mtbf_s}")


def measure(
    url_or_dir: str, *, nbytes: int = 256 * 2**20, storage_options: dict[str, Any] | None = None
) -> TierProfile:
    """Measure a tier: write ``nbytes`` of random data as one file through tiercheck's own tier
    (:func:`tiercheck.tiers.remote.open_tier`: fsync'd for local paths, a multipart PUT with retries
    for remote URLs), read it back, and delete it. Everything goes under a unique temporary prefix
    (``.tiercheck-measure-<random>``) that is removed afterwards, also on failure.

    Caveats: one file from one process measures *one client's* bandwidth, taken as the node's. For a
    shared tier (a remote URL: ``shared=True``) the service's ceiling for the whole job is not known
    from one client (``job_bytes_per_s`` None): with many nodes the times are optimistic where the
    service is the limit; a node with several writers at once gets more than one client. A local directory's
    read-back is not made cold (no cache is dropped): it is likely served from the page cache and
    then overstates the disk's read bandwidth. A local directory must exist.
    """
    from tiercheck.tiers.remote import open_tier  # here, not at the top: the sizing arithmetic needs no storage stack

    if nbytes < 1:
        raise ValueError(f"nbytes must be at least 1, not {nbytes}")
    scheme = urlsplit(url_or_dir).scheme
    local = scheme in ("", "file", "local")
    if local:
        path = url_or_dir[len("file://") :] if url_or_dir.startswith("file://") else url_or_dir
        if not os.path.isdir(os.path.expanduser(path)):
            raise FileNotFoundError(f"cannot measure {url_or_dir}: no such directory")
    tier = open_tier(url_or_dir, storage_options=storage_options)
    prefix = f".tiercheck-measure-{uuid.uuid4().hex}"
    data = os.urandom(nbytes)  # incompressible, so a compressing filesystem cannot flatter the figure
    try:
        start = time.perf_counter()
        tier.write(f"{prefix}/data", [data])
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        back = tier.read(f"{prefix}/data")
        read_s = time.perf_counter() - start
    finally:
        tier.delete_tree(prefix)
    if len(back) != nbytes or back != data:
        raise OSError(f"{tier.url}: the {nbytes} bytes read back differ from those written")
    tiny = 1e-9  # a clock tick, so a very fast tier cannot divide by zero
    return TierProfile(
        f"measured:{tier.url}",
        nbytes / max(write_s, tiny),
        nbytes / max(read_s, tiny),
        shared=not local,
        source="measured",
    )


def plan_table(
    spec: ModelSpec,
    tiers: list[TierProfile],
    *,
    node_mtbf_hours: float,
    restart_s: float | None,
    staging: TierProfile | None = None,
) -> dict[str, Any]:
    """Everything ``tiercheck plan`` prints, as a JSON-serializable dict.

    For each tier: save and restore seconds (:func:`times`), the Young and Daly intervals taking
    the tier's save time as the checkpoint cost ``C`` (a *synchronous* save: the training waits
    for the write), and the expected waste at each. ``R`` is ``restart_s`` when given, else the tier's
    restore time. ``fastest`` names the tier with the shortest save and repeats its figures.

    With ``staging`` (e.g. :data:`HOST_MEMORY_TIER`), each tier also gets an ``async`` entry for
    tiercheck's asynchronous saves: the training waits only for staging (``C_b`` = per-rank bytes at
    the staging bandwidth per GPU, :func:`staging_s`) while the write to the tier (``W`` seconds)
    goes on in the background.
    A first-order extension of the waste model (ours, not from the papers above): a step is
    restorable only ``W`` after it is taken, so a failure loses on average ``T/2 + W`` of work:
    waste ``≈ C_b/T + (T/2 + W + R)/M``, minimal at Young's ``sqrt(2·C_b·M)``; the interval is also
    kept at least ``W``, so one save is written before the next (else saves queue up).
    """
    if not tiers:
        raise ValueError("plan_table needs at least one tier")
    if restart_s is not None and restart_s < 0:
        raise ValueError(f"restart_s must not be negative, not {restart_s}")
    sizes = size(spec)
    mtbf = job_mtbf_s(node_mtbf_hours, sizes.nodes)
    blocking_s = None if staging is None else staging_s(sizes, staging)
    rows: list[dict[str, Any]] = []
    for tier in tiers:
        save_s, restore_s = times(sizes, tier)
        r = restore_s if restart_s is None else restart_s
        young = young_daly_interval(save_s, mtbf)
        daly = daly_interval(save_s, mtbf)
        row: dict[str, Any] = {
            "tier": asdict(tier),
            "bytes_per_writer": sizes.per_node_bytes,
            "save_s": save_s,
            "restore_s": restore_s,
            "restart_s": r,
            "young_interval_s": young,
            "daly_interval_s": daly,
            "waste_fraction_young": _waste(young, save_s, r, mtbf),
            "waste_fraction_daly": _waste(daly, save_s, r, mtbf),
        }
        if blocking_s is not None:
            interval = max(young_daly_interval(blocking_s, mtbf), save_s)
            row["async"] = {
                "blocking_s": blocking_s,
                "interval_s": interval,
                "waste_fraction": _waste(interval, blocking_s, r + save_s, mtbf),
            }
        rows.append(row)
    fastest = min(rows, key=lambda row: row["save_s"])
    return {
        "model": {**asdict(spec), "n_params": spec.n_params},
        "sizes": asdict(sizes),
        "node_mtbf_hours": node_mtbf_hours,
        "job_mtbf_s": mtbf,
        "restart_s": restart_s,
        "staging": None if staging is None else asdict(staging),
        "tiers": rows,
        "fastest": {
            "tier": fastest["tier"]["name"],
            "save_s": fastest["save_s"],
            "young_interval_s": fastest["young_interval_s"],
            "daly_interval_s": fastest["daly_interval_s"],
            "waste_fraction_daly": fastest["waste_fraction_daly"],
        },
        "assumptions": [
            "bandwidths are per node, stated (DEFAULT_TIERS are typical values) or measured, as each tier's "
            "source says; the host copy's is per GPU",
            "every node moves its per_node_bytes in parallel at its per-node bandwidth; on a shared tier the "
            "job's total_bytes also pass through the tier's ceiling for the job (job_bytes_per_s), when known",
            "state is split evenly over tp*pp*dp ranks (balanced pipeline stages; replicas share the writing)",
            "nodes fail independently: job MTBF = node MTBF / nodes",
            "intervals are seconds of training between checkpoints (Young 1974, Daly 2006); waste is first order",
        ],
    }


def _waste(interval_s: float, cost_s: float, restart_s: float, mtbf_s: float) -> float | None:
    """The waste fraction, or None where the interval is 0 (a free checkpoint: nothing to optimise)."""
    return expected_waste_fraction(interval_s, cost_s, restart_s, mtbf_s) if interval_s > 0 else None
