"""remote_bench's tables: markdown from the report's records (medians, ratios, CPU per GiB)."""

from __future__ import annotations

from typing import Any

import harness as h
from harness import GiB, MiB
from remote_peers import render_peers


def _med(recs: list[dict[str, Any]], key: str) -> float | None:
    return h.median([r.get(key) for r in recs])


def _cols(spec: str) -> list[str]:
    return spec.split("|")


CPU_HEAD = _cols("client CPU s|client CPU s/GiB|server CPU s|CPU ms/MiB|ours %|other %")
UPLOAD_HEAD = _cols("remote|method|MiB|s|MiB/s|x put|x big object") + CPU_HEAD + ["runs"]
PHASE_HEAD = _cols(
    "remote|drain s|before uploads s|uploads s|marker + COMMIT s|retention s|files|requests|"
    "small put / get / exists / listing ms|one chunk: RemoteTier.write / pipe_file s"
)
RESTORE_HEAD = _cols("remote|method|s|MiB/s|x fs.get|x fs.cat|remote chunk reads") + CPU_HEAD + ["verified", "runs"]


def _cpu_cols(recs: list[dict[str, Any]], s: float | None, ncpu: int) -> list[str]:
    cli, srv, other = _med(recs, "client_cpu_s"), _med(recs, "server_cpu_s"), _med(recs, "other_cpu_share")
    ours = ((cli or 0) + (srv or 0)) / (s * ncpu) if s and cli is not None else None
    per_mib = [
        1000 * (r["client_cpu_s"] + (r.get("server_cpu_s") or 0)) / (r["bytes"] / MiB)
        for r in recs
        if r.get("client_cpu_s") is not None and r.get("bytes")
    ]
    per_gib = [
        r["client_cpu_s"] / (r["bytes"] / GiB) for r in recs if r.get("client_cpu_s") is not None and r.get("bytes")
    ]
    pct = [h.fmt(100 * x if x is not None else None, ".0f") for x in (ours, other)]
    return [h.fmt(cli, ".1f"), h.fmt(h.median(per_gib)), h.fmt(srv, ".1f"), h.fmt(h.median(per_mib), ".1f"), *pct]


def _good(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in recs if "error" not in r]


def _runs(recs: list[dict[str, Any]]) -> str:
    bad = len(recs) - len(_good(recs))
    return f"{len(recs) - bad} ({bad} failed)" if bad else str(len(recs))


UPLOAD_LABELS = {"put": "fs.put (recursive)", "pipe": "pipe_file loop (sequential)"}
RESTORE_LABELS = {
    "restore_local": "Checkpointer + restore(), local dir",
    "restore_remote": "Checkpointer + restore(), empty local dir",
    "load": "tiercheck.load(URL)",
    "fs_get": "fs.get (to disk)",
    "fs_cat": "fs.cat (into memory)",
}


def _upload_rows(kind: str, res: dict[str, Any], ncpu: int) -> list[list[Any]]:
    name, ups, big = res["name"], res["uploads"], res["limits"]["put_big"]
    put_s, limit = _med(_good(ups.get("put", [])), "s"), big["mib_s"]
    order = [k for k in ("drain c=8", "drain c=4", "drain c=1", "put", "pipe") if k in ups]
    rows = []
    for key in order + [k for k in ups if k not in order and k.startswith("drain")]:
        recs, label = (
            _good(ups[key]),
            UPLOAD_LABELS.get(key, f"tiercheck {key}") + (" (default)" * (key == "drain c=8")),
        )
        if not recs:
            rows.append([name, label, "FAILED: " + ups[key][-1]["error"][:100], *["-"] * 10, _runs(ups[key])])
            continue
        s, nbytes = _med(recs, "s"), _med(recs, "bytes")
        limit_s = nbytes / MiB / limit if nbytes and limit else None
        row = [name, label, h.fmt(nbytes and nbytes / MiB, ".0f"), h.fmt(s), h.fmt(_med(recs, "mib_s"), ".0f")]
        rows.append(
            [*row, h.fmt(h.ratio(s, put_s)), h.fmt(h.ratio(s, limit_s)), *_cpu_cols(recs, s, ncpu), _runs(ups[key])]
        )
    what = f"one big pipe_file ({big['bytes'] / MiB:.0f} MiB)" if kind != "file" else "fsync'd write, one file"
    row = [name, what, f"{big['bytes'] / MiB:.0f}", h.fmt(big["s"]), h.fmt(limit, ".0f"), "-", "1.00"]
    return [*rows, [*row, *_cpu_cols([big], big["s"], ncpu), 1]]


def _phase_row(res: dict[str, Any]) -> list[Any]:
    d = _good(res["uploads"].get("drain c=8", []))
    ph = [r["phases"] for r in d if r.get("phases")]
    req, one = res["limits"]["requests"], res["limits"].get("one_chunk")
    row = [res["name"], h.fmt(_med(d, "s"))]
    row += [h.fmt(_med(ph, k)) for k in ("before_upload_s", "upload_s", "marker_and_commit_s", "after_commit_s")]
    row += [res.get("step_files", "-"), h.fmt(_med(d, "requests"), ".0f")]
    row += [" / ".join(f"{req[k]:.1f}" for k in ("put_1k", "get_1k", "exists", "sizes_40"))]
    return [*row, f"{one['tiercheck_write']['s']:.2f} / {one['pipe_file']['s']:.2f}" if one else "-"]


def _restore_rows(res: dict[str, Any], ncpu: int) -> list[list[Any]]:
    name, rs, rows = res["name"], res["restores"], []
    get_s, cat_s = _med(_good(rs.get("fs_get", [])), "s"), _med(_good(rs.get("fs_cat", [])), "s")
    for key, label in RESTORE_LABELS.items():
        if key not in rs:
            continue
        recs = _good(rs[key])
        if not recs:
            rows.append([name, label, "FAILED: " + rs[key][-1]["error"][:100], *["-"] * 11, _runs(rs[key])])
            continue
        s = _med(recs, "s")
        row = [name, label, h.fmt(s), h.fmt(_med(recs, "mib_s"), ".0f"), h.fmt(h.ratio(s, get_s))]
        row += [h.fmt(h.ratio(s, cat_s)), recs[0].get("remote_reads", "-"), *_cpu_cols(recs, s, ncpu)]
        rows.append([*row, recs[0].get("verified_tensors", "bytes"), _runs(rs[key])])
    g = res["limits"]["get_big"]
    row = [name, "one big cat_file", h.fmt(g["s"]), h.fmt(g["mib_s"], ".0f"), "-", "-", "-"]
    return [*rows, [*row, *_cpu_cols([g], g["s"], ncpu), "-", 1]]


ROUND_WHAT = {
    "off": "drain c=8 / fs.put / pipe_file loop",
    "on": "drain c=8 / fs.put / pipe_file loop / peers",
    "only": "drain c=8 / peers",
}


def render(report: dict[str, Any]) -> str:
    cfg, m, lim = report["config"], report["machine"], report["limits"]
    ncpu = m["cpu_count"] or 1
    up_rows, phase_rows, rs_rows = [], [], []
    for kind, res in report["remotes"].items():
        if "error" in res:
            up_rows.append([res.get("name", kind), "FAILED: " + res["error"][:100]] + ["-"] * (len(UPLOAD_HEAD) - 2))
        elif "limits" in res:  # not with --peers only: its rows are in the peers table
            up_rows += _upload_rows(kind, res, ncpu)
            phase_rows.append(_phase_row(res))
            rs_rows += _restore_rows(res, ncpu)
    out = [
        f"State: {cfg['state_bytes'] / MiB:.0f} MiB in {cfg['n_tensors']} tensors ({cfg['big_tensors']} of <= 64 MiB, "
        f"the rest 16 KiB vectors and scalars); {cfg['n']} round(s) of {ROUND_WHAT[cfg.get('peers', 'off')]}, median "
        f"shown. {h.machine_line(m)}. Page cache dropped before each timed read: {cfg['drop_caches'] or 'NO'}.",
        f"Machine limits: TCP loopback {lim['tcp_loopback']['mib_s']:.0f} MiB/s, cold sequential read of the step "
        f"{lim['cold_read']['gib_s'] * 1024:.0f} MiB/s, fsync'd write {lim['disk_write']['gib_s'] * 1024:.0f} MiB/s.",
        "",
    ]
    if up_rows:
        out += [
            "**Upload** (drain: `handle.wait()` -> `handle.drained.result()`; x put, x big object: time ratios at "
            "the same bytes, > 1 slower)",
            "",
            h.table(UPLOAD_HEAD, up_rows),
            "",
        ]
    if phase_rows:
        out += [
            "**Where the default drain's time goes** (drainer's log lines; requests = RemoteTier calls; small "
            "requests through RemoteTier, median ms; one chunk file of 64 MiB + 4 B uploaded by "
            "`RemoteTier.write` vs one `pipe_file` with the client's defaults)",
            "",
            h.table(PHASE_HEAD, phase_rows),
            "",
            "**Restore** (page cache dropped before each; a fresh client each time; every result compared bit for bit)",
            "",
            h.table(RESTORE_HEAD, rs_rows),
            "",
        ]
    peers = render_peers(report)
    out += [peers, ""] if peers else []
    out.append(
        f"Run took {report['elapsed_s']:.0f} s; load average at start {report['loadavg_start']}, at end "
        f"{report['loadavg_end']}. ours % = (client + server CPU) / (wall x CPUs); other % = processes "
        "outside this benchmark; client CPU s/GiB = this process's CPU per GiB moved."
    )
    for res in report["remotes"].values():
        if "foreign_load" in res:
            out += h.noise_warnings(res["name"], res["foreign_load"])
    return "\n".join(out)


