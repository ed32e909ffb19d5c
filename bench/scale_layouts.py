"""Layouts for bench/scale_sim.py: every rank's tensor descriptions in a GPT-3 175B job under
Megatron (TP x PP x DP), a Llama-3 405B job under torchtitan (TP x PP x HSDP) and a Llama-70B job
under FSDP2, without tensors."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

from tiercheck.cluster.assign import LeafDesc

GPT3_TP, GPT3_PP = 8, 16
GPT3_DPS = (1, 8, 32, 128)
LLAMA_WORLDS = (128, 512, 2048)
OPT_STATES = ("fp32_param", "exp_avg", "exp_avg_sq")
Layout = list[list[LeafDesc]]



def _split(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``n`` cut into ``parts`` as torch.chunk does: (offset, extent), maybe empty."""
    size = -(-n // parts)
    start = min(i * size, n)
    return start, min(start + size, n) - start


def _desc(path: str, dtype: str, shape: tuple[int, ...], dim: int | None, parts: int, i: int) -> LeafDesc:
    """Piece ``i`` of ``parts`` of a global array cut along ``dim`` (None: the whole array)."""
    offsets, local = [0] * len(shape), list(shape)
    if dim is not None:
        offsets[dim], local[dim] = _split(shape[dim], parts, i)
    return LeafDesc(path, dtype, "tensor", shape, tuple(offsets), tuple(local), False)


def gpt3(tp: int = GPT3_TP, pp: int = GPT3_PP, dp: int = 1, stage: int | None = None) -> Layout:
    """GPT-3 175B under Megatron: every rank's descriptions, in Megatron's rank order.

    Column-parallel weights are cut on rows over TP, row-parallel ones on columns; biases of
    row-parallel layers and layernorms are replicated; the padded embedding sits on the first
    stage, the final layernorm on the last. bf16 parameters are replicated over DP. The
    distributed optimizer keeps, per (tp, pp) rank, three flat fp32 buffers (master weights and
    Adam moments) as long as that rank's parameters, split into DP contiguous parts. With
    ``stage``, only the ranks of that pipeline stage are described (the others get no leaves).
    """
    h, layers, vocab = 12288, 96, 50257
    if layers % pp:
        raise ValueError(f"{layers} layers do not split evenly over {pp} pipeline stages")
    vocab_padded = -(-vocab // (tp * 128)) * (tp * 128)
    per_stage = layers // pp
    params: dict[tuple[int, int], list[LeafDesc]] = {}
    for p in range(pp):
        for t in range(tp):
            spec: list[tuple[str, tuple[int, ...], int | None]] = []
            if p == 0:
                spec.append(("embedding.word_embeddings.weight", (vocab_padded, h), 0))
            for layer in range(p * per_stage, (p + 1) * per_stage):
                pre = f"decoder.layers.{layer}."
                spec += [
                    (pre + "input_layernorm.weight", (h,), None),
                    (pre + "input_layernorm.bias", (h,), None),
                    (pre + "self_attention.linear_qkv.weight", (3 * h, h), 0),
                    (pre + "self_attention.linear_qkv.bias", (3 * h,), 0),
                    (pre + "self_attention.linear_proj.weight", (h, h), 1),
                    (pre + "self_attention.linear_proj.bias", (h,), None),
                    (pre + "pre_mlp_layernorm.weight", (h,), None),
                    (pre + "pre_mlp_layernorm.bias", (h,), None),
                    (pre + "mlp.linear_fc1.weight", (4 * h, h), 0),
                    (pre + "mlp.linear_fc1.bias", (4 * h,), 0),
                    (pre + "mlp.linear_fc2.weight", (h, 4 * h), 1),
                    (pre + "mlp.linear_fc2.bias", (h,), None),
                ]
            if p == pp - 1:
                spec += [("decoder.final_layernorm.weight", (h,), None), ("decoder.final_layernorm.bias", (h,), None)]
            params[p, t] = [_desc(f"model/{name}", "bfloat16", shape, dim, tp, t) for name, shape, dim in spec]
    numel = {key: sum(math.prod(d.shape) for d in descs) for key, descs in params.items()}
    ranks: Layout = []
    for r in range(tp * pp * dp):
        t, d, p = r % tp, (r // tp) % dp, r // (tp * dp)
        if stage is not None and p != stage:
            ranks.append([])
            continue
        n = numel[p, t]
        opt = [_desc(f"optimizer/tp{t}.pp{p}/{s}", "float32", (n,), 0, dp, d) for s in OPT_STATES]
        ranks.append(params[p, t] + opt)
    return ranks


def llama70b_fsdp2(world: int) -> Layout:
    """A Llama-70B-like model under FSDP2: every parameter (bf16) and both Adam moments (fp32)
    cut on dim 0 over all ``world`` ranks, torch.chunk style; trailing ranks may hold empty pieces."""
    h, ffn, kv, vocab, layers = 8192, 28672, 1024, 128256, 80
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        pre = f"model.layers.{i}."
        shapes += [
            (pre + "self_attn.q_proj.weight", (h, h)),
            (pre + "self_attn.k_proj.weight", (kv, h)),
            (pre + "self_attn.v_proj.weight", (kv, h)),
            (pre + "self_attn.o_proj.weight", (h, h)),
            (pre + "mlp.gate_proj.weight", (ffn, h)),
            (pre + "mlp.up_proj.weight", (ffn, h)),
            (pre + "mlp.down_proj.weight", (h, ffn)),
            (pre + "input_layernorm.weight", (h,)),
            (pre + "post_attention_layernorm.weight", (h,)),
        ]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    arrays = [(f"model/{name}", "bfloat16", shape) for name, shape in shapes]
    for state in ("exp_avg", "exp_avg_sq"):
        arrays += [(f"optim/state/{name}/{state}", "float32", shape) for name, shape in shapes]
    ranks: Layout = []
    for r in range(world):
        boxes: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for shape in {shape for _, _, shape in arrays}:
            off, ext = _split(shape[0], world, r)
            boxes[shape] = ((off,) + (0,) * (len(shape) - 1), (ext, *shape[1:]))
        out = [LeafDesc(path, dtype, "tensor", shape, *boxes[shape], False) for path, dtype, shape in arrays]
        ranks.append(out)
    return ranks


LLAMA405_TP, LLAMA405_PP, LLAMA405_SHARD = 8, 16, 64
LLAMA405_WORLDS = (1024, 16384, 131072)


def llama405b_hsdp(world: int, stage: int | None = None, *, pad_vocab: bool = False) -> Layout:
    """Llama-3 405B under torchtitan's 4-D parallelism: TP 8 (inside a node), PP 16, and HSDP, FSDP2
    sharding dim 0 of each TP piece over a group of up to 64 ranks, the groups replicas of each other.
    The mesh is ``[pp, dp_replicate, dp_shard, tp]``, tp innermost. Column-parallel weights (q, k, v,
    gate, up, the vocabulary-parallel embedding and output) are cut on rows over TP, row-parallel ones (o,
    down) on columns, norms replicated over TP; bf16 parameters and both fp32 Adam moments alike. With
    ``stage``, only the ranks of that pipeline stage are described (the others get no leaves).

    The vocabulary (128,256) cut over TP 8 and then 64 FSDP ranks gives pieces of 251 rows beside TP cuts
    every 16,032 rows: no chunk extent but one row divides them all, so the embedding and output weights
    (and their moments) are cut into 128,256 one-row chunks each. ``pad_vocab`` pads the vocabulary to a
    multiple of TP x 64 (128,512), as Megatron pads its own, for even pieces."""
    h, ffn, kv, vocab, layers = 16384, 53248, 1024, 128256, 126
    if pad_vocab:
        vocab = -(-vocab // (LLAMA405_TP * LLAMA405_SHARD)) * (LLAMA405_TP * LLAMA405_SHARD)
    tp, pp = LLAMA405_TP, LLAMA405_PP
    shard = min(LLAMA405_SHARD, world // (tp * pp))
    if shard < 1 or world % (tp * pp * shard):
        raise SystemExit(f"llama405: --ranks {world} is not a multiple of TP*PP*shard = {tp * pp * shard}")
    replicas = world // (tp * pp * shard)
    per_stage = -(-layers // pp)
    specs: list[list[tuple[str, tuple[int, ...], int | None]]] = []
    for p in range(pp):
        spec: list[tuple[str, tuple[int, ...], int | None]] = []
        if p == 0:
            spec.append(("tok_embeddings.weight", (vocab, h), 0))
        for layer in range(p * per_stage, min((p + 1) * per_stage, layers)):
            pre = f"layers.{layer}."
            spec += [(pre + "attention.wq.weight", (h, h), 0), (pre + "attention.wk.weight", (kv, h), 0),
                     (pre + "attention.wv.weight", (kv, h), 0), (pre + "attention.wo.weight", (h, h), 1),
                     (pre + "feed_forward.w1.weight", (ffn, h), 0), (pre + "feed_forward.w3.weight", (ffn, h), 0),
                     (pre + "feed_forward.w2.weight", (h, ffn), 1), (pre + "attention_norm.weight", (h,), None),
                     (pre + "ffn_norm.weight", (h,), None)]  # fmt: skip
        if p == pp - 1:
            spec += [("norm.weight", (h,), None), ("output.weight", (vocab, h), 0)]
        specs.append(spec)
    ranks: Layout = []
    for r in range(world):
        t, f, p = r % tp, (r // tp) % shard, r // (tp * shard * replicas)
        if stage is not None and p != stage:
            ranks.append([])
            continue
        out: list[LeafDesc] = []
        for name, shape, dim in specs[p]:
            offsets, local = [0] * len(shape), list(shape)
            if dim is not None:  # the TP piece
                offsets[dim], local[dim] = _split(shape[dim], tp, t)
            start, rows = _split(local[0], shard, f)  # FSDP2: dim 0 of the TP piece, torch.chunk style
            offsets[0], local[0] = offsets[0] + start, rows
            for path, dtype in ((f"model/{name}", "bfloat16"), (f"optim/state/{name}/exp_avg", "float32"),
                                (f"optim/state/{name}/exp_avg_sq", "float32")):  # fmt: skip
                out.append(LeafDesc(path, dtype, "tensor", shape, tuple(offsets), tuple(local), False))
        ranks.append(out)
    return ranks


def worlds(layout: str, ranks: Sequence[int] | None, *, stage: int | None) -> list[tuple[int, Callable[[], Layout]]]:
    """The (world size, generator) pairs to run for ``layout`` (gpt3: describing the ranks of pipeline
    ``stage`` only, when given)."""
    if layout == "gpt3":
        unit = GPT3_TP * GPT3_PP
        dps = GPT3_DPS if not ranks else [n // unit for n in ranks]
        for n in ranks or ():
            if n % unit:
                raise SystemExit(f"gpt3: --ranks {n} is not a multiple of TP*PP = {unit}")
        return [(unit * dp, partial(gpt3, GPT3_TP, GPT3_PP, dp, stage)) for dp in dps]
    if layout.startswith("llama405"):
        pad = layout == "llama405-padded"  # unpadded, 131,072 ranks do not fit in 23 GiB (the one-row chunks)
        default = LLAMA405_WORLDS if pad else LLAMA405_WORLDS[:2]
        return [(n, partial(llama405b_hsdp, n, stage, pad_vocab=pad)) for n in (ranks or default)]
    return [(n, partial(llama70b_fsdp2, n)) for n in (ranks or LLAMA_WORLDS)]


