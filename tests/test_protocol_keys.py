"""The store-key registry (``tiercheck.cluster.keys``) is the only place a key or scope is built,
every family it defines says exactly the key it always said, and ``docs/protocol.md`` names each."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tiercheck.cluster import keys
from tiercheck.cluster.coordination import Coordinator
from tiercheck.cluster.keys import nodes as nk
from tiercheck.cluster.keys import restore as rk
from tiercheck.cluster.keys import save as sk
from tiercheck.cluster.keys import tiering as tk

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tiercheck"
REGISTRY = PACKAGE / "cluster" / "keys"

# Methods of Coordinator and functions of cluster.hierarchy / restore.agree whose first argument is a
# key, a scope or a bucket (``wait``, ``delete``, ``multi_get``: every positional argument; ``multi_set``:
# its dict's keys); ``Barrier``'s first too.
FIRST = {
    "arrive",
    "finish",
    "post",
    "collect",
    "report",
    "check",
    "decide",
    "fetch",
    "get",
    "set",
    "add",
    "append",
    "has",
    "waited",
    "Barrier",
}
ALL = {"wait", "delete", "multi_get", "multi_set"}
SCOPED = {
    "verdict": 2,
    "settle": 1,
    "fold": 2,
    "tell": 2,
    "gather_at_leader": 1,
    "leave_node": 2,
    "agree_on_step": 1,
    "holders_of": 1,
}  # fmt: skip  (the scope's position)
# A method call counts where its receiver is a coordinator (not a dict's get, a set's add, gc.collect).
COORDINATOR = re.compile(r"(^|\.|_)(coord|node|shared|waiter|signal|on)\b|node_of\(")
# A scope built by hand, in a module that talks to the store (imports tiercheck.cluster): an f-string
# that begins with a scope or key variable and goes on with '/' or '.' and more.
SCOPE_VARS = {"name", "root", "scope", "bucket", "key", "base", "attempt", "self.name", "where"}


def _built(node: ast.expr) -> bool:
    """Whether an argument is a key made on the spot: a string literal, an f-string, a concatenation
    or a join/format of strings (registry calls and variables are not)."""
    if isinstance(node, ast.Starred):
        return _built(node.value)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return any(_built(e) for e in node.elts)
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
        return _built(node.elt)
    if isinstance(node, ast.DictComp):
        return _built(node.key)
    if isinstance(node, ast.Dict):
        return any(k is not None and _built(k) for k in node.keys)
    if isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        return True
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("join", "format")


def _hand_scope(node: ast.JoinedStr) -> bool:
    first = node.values[:2]
    return (
        len(first) == 2
        and isinstance(first[0], ast.FormattedValue)
        and ast.unparse(first[0].value) in SCOPE_VARS
        and isinstance(first[1], ast.Constant)
        and str(first[1].value)[:1] in ("/", ".")
        and (len(str(first[1].value)) > 1 or len(node.values) > 2)
    )


def _talks_to_the_store(tree: ast.AST) -> bool:
    return any(
        isinstance(n, ast.ImportFrom) and (n.module or "").startswith("tiercheck.cluster") for n in ast.walk(tree)
    )


def key_builders(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Each place in a module that builds a store key or scope outside the registry: line, and why."""
    store = _talks_to_the_store(tree)
    for node in ast.walk(tree):
        if store and isinstance(node, ast.JoinedStr) and _hand_scope(node):
            yield node.lineno, f"a scope built by hand: {ast.unparse(node)}"
        if store and isinstance(node, ast.Assign) and isinstance(node.value, ast.JoinedStr):
            names = {ast.unparse(t) for t in node.targets} & (SCOPE_VARS - {"where"})
            if names:
                yield node.lineno, f"a scope built by hand: {ast.unparse(node)[:80]}"
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if isinstance(func, ast.Attribute) and name == "key":
            yield node.lineno, f"a key joined outside the registry: {ast.unparse(node)[:80]}"
            continue
        if isinstance(func, ast.Attribute) and not COORDINATOR.search(ast.unparse(func.value)):
            continue
        if name in SCOPED:
            args = node.args[SCOPED[name] : SCOPED[name] + 1]
        elif name in ALL:
            args = node.args
        elif name in FIRST:
            args = node.args[:1]
        else:
            continue
        if name not in ("Barrier", *SCOPED) and not isinstance(func, ast.Attribute):
            continue  # a function of that name, not a coordinator's method
        for arg in args:
            if _built(arg):
                yield node.lineno, f"a key made on the spot for {name}(): {ast.unparse(arg)[:80]}"


def test_no_module_builds_a_key_outside_the_registry() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if REGISTRY in path.parents:
            continue
        for line, why in key_builders(ast.parse(path.read_text(), filename=str(path))):
            found.append(f"{path.relative_to(ROOT)}:{line}: {why}")
    assert found == []


@pytest.mark.parametrize(
    "source",
    [
        'coord.set(coord.key("drain", step), "ok")',
        'coord.arrive(f"{root}/holders", what="x")',
        'coord.add(f"{key}/seen", 1)',
        'coord.report("lock", e)',
        'node.delete(key, f"{key}/tried")',
        'self._waiter.wait([key + "/x"], what="y")',
        'coord.multi_set({f"{name}/want/{w}": "1" for w in ws})',
        'where = f"{name}/in/{rank}"',
        'yield from settle(job, f"{root}/tree", failure)',
        'yield Barrier("plan/open", "x", coord)',
        'name = f"plan{generation}"',
    ],
)
def test_the_scan_finds_a_key_built_by_hand(source: str) -> None:
    module = f"from tiercheck.cluster.job import Job\n{source}"
    assert list(key_builders(ast.parse(module))) != [], source


@pytest.mark.parametrize(
    "source",
    [
        "coord.set(open_key(coord, name), '1')",
        "coord.arrive(part_scope(root, 'holders'), what='x')",
        "self._cond.wait()",
        "seen.add(f'{path}/x')",
        "parts.append(f'{d}/{name}')",
        "tier.write(f'{d}/{part_file(rank)}', [b''])",
        "coord.decide(key, f'rank {rank} failed')",
        "coord.wait([key], what=f'rank {leader} to set aside step {step}')",
        "gc.collect('GC collection for checkpoint loading.')",
        "names = [n for n in names if n.startswith(f'{scope}/')]",
        "where = f'{tier.url}: step {step}'",
    ],
)
def test_the_scan_leaves_other_strings_alone(source: str) -> None:
    module = f"from tiercheck.cluster.job import Job\n{source}"
    assert list(key_builders(ast.parse(module))) == [], source


def _expected(on: Coordinator, node: Coordinator) -> dict[str, tuple[Callable[[], str], str]]:
    """Each family, called once, and the key or scope it must say: byte for byte the wire's."""
    j, n = "tiercheck/local", "tiercheck/local/node3"
    lineage = f"{j}/lineage/restored/2"
    return {
        "job_namespace": (lambda: keys.job_namespace("0-1", 2), "g0-1/ckpt2"),
        "node_namespace": (lambda: keys.node_namespace("g0-1/ckpt2", 3), "g0-1/ckpt2/node3"),
        "arrived_key": (lambda: keys.arrived_key(on, "plan0/posted"), f"{j}/plan0/posted/arrived"),
        "open_key": (lambda: keys.open_key(on, "plan0/posted"), f"{j}/plan0/posted/open"),
        "error_key": (lambda: keys.error_key(on, "plan0"), f"{j}/plan0/error"),
        "finished_key": (lambda: keys.finished_key(on, "plan0"), f"{j}/plan0/finished"),
        "bucket_n_key": (lambda: keys.bucket_n_key(on, "plan0/in/5"), f"{j}/plan0/in/5/n"),
        "bucket_item_key": (lambda: keys.bucket_item_key(on, "plan0/in/5", 7), f"{j}/plan0/in/5/7"),
        "node_in_scope": (lambda: keys.node_in_scope("save/4/0"), "save/4/0/in"),
        "out_key": (lambda: keys.out_key(node, "lineage"), f"{n}/lineage/out"),
        "left_key": (lambda: keys.left_key(node, "lineage"), f"{n}/lineage/left"),
        "all_left_key": (lambda: keys.all_left_key(node, "lineage"), f"{n}/lineage/left/all"),
        "scope_key": (lambda: keys.scope_key(node, "plan0/holders"), f"{n}/plan0/holders"),
        "up_key": (lambda: keys.up_key(on, "restore1/step/held", 33), f"{j}/restore1/step/held/up/33"),
        "answer_key": (lambda: keys.answer_key(on, "restore1/step/step"), f"{j}/restore1/step/step/answer"),
        "nodes_scope": (lambda: nk.nodes_scope("joined"), "nodes/joined"),
        "node_members_bucket": (lambda: nk.node_members_bucket("ab12"), "nodes/ab12"),
        "leaders_bucket": (nk.leaders_bucket, "nodes/leaders"),
        "nodes_count_key": (lambda: nk.nodes_count_key(on), f"{j}/nodes/count"),
        "run_key": (lambda: nk.run_key(on), f"{j}/nodes/run"),
        "node_number_key": (lambda: nk.node_number_key(on, 8), f"{j}/nodes/number/8"),
        "channel_key": (lambda: nk.channel_key(on, 3), f"{j}/nodes/channel/3"),
        "channel_tried_key": (lambda: nk.channel_tried_key(on, 3), f"{j}/nodes/channel/3/tried"),
        "channel_whole_key": (lambda: nk.channel_whole_key(on, 3), f"{j}/nodes/channel/3/whole"),
        "lock_scope": (nk.lock_scope, "lock/taken"),
        "plan_scope": (lambda: sk.plan_scope(4), "plan4"),
        "plan_round_scope": (lambda: sk.plan_round_scope("plan4", "offered"), "plan4/offered"),
        "pieces_bucket": (lambda: sk.pieces_bucket("plan4", 9), "plan4/in/9"),
        "pieces_n_key": (lambda: sk.pieces_n_key(on, "plan4", 9, "d1"), f"{j}/plan4/in/9/d1/n"),
        "holders_key": (lambda: sk.holders_key(on, "plan4", 9, "d1"), f"{j}/plan4/in/9/d1/ranks"),
        "plan_holders_scope": (lambda: sk.plan_holders_scope("plan4"), "plan4/holders"),
        "offer_key": (
            lambda: sk.offer_key(on, "plan4", 9, "d1") + " " + sk.offer_key(on, "plan4", 9, "d1", 0),
            f"{j}/plan4/offer/9/d1 {j}/plan4/offer/9/d1/0",
        ),
        "took_bucket": (lambda: sk.took_bucket("plan4", 9), "plan4/took/9"),
        "vote_scope": (lambda: sk.vote_scope("memory", 12, 1), "memory/12/1"),
        "vote_key": (
            lambda: " ".join(sk.vote_key(on, "save/12/0", k) for k in sk.VOTE_KEYS),
            " ".join(f"{j}/save/12/0/{k}" for k in ("meta", "outcome", "arrived", "nodes", "committed")),
        ),
        "vote_node_key": (lambda: sk.vote_node_key(node, "save/12/0", "committed"), f"{n}/save/12/0/committed"),
        "restore_scope": (lambda: rk.restore_scope(2), "restore2"),
        "retry_scope": (lambda: rk.retry_scope("restore2", 1), "restore2.1"),
        "memory_scope": (
            lambda: rk.memory_scope("restore2", 0) + " " + rk.memory_scope("restore2", 3),
            "restore2/m restore2/m3",
        ),
        "memory_choice_scope": (
            lambda: rk.memory_choice_scope("restore2", 0) + " " + rk.memory_choice_scope("restore2", 1),
            "restore2/memory restore2/memory1",
        ),
        "disk_scope": (lambda: rk.disk_scope("restore2"), "restore2/disk"),
        "part_scope": (lambda: rk.part_scope("restore2.1", "reads"), "restore2.1/reads"),
        "agree_scope": (lambda: rk.agree_scope("restore2/step", "held"), "restore2/step/held"),
        "copies_bucket": (lambda: rk.copies_bucket("restore2", 40), "restore2/copies/40"),
        "step_index_key": (lambda: rk.step_index_key(on, "restore2"), f"{j}/restore2/index"),
        "holder_key": (lambda: rk.holder_key(on, "restore2", 17), f"{j}/restore2/holder/17"),
        "node_holds_key": (lambda: rk.node_holds_key(on, "restore2", 8), f"{j}/restore2/node/8"),
        "fetch_scope": (lambda: rk.fetch_scope("restore2", "trees"), "restore2/trees"),
        "fetch_round_scope": (lambda: rk.fetch_round_scope("restore2/trees", "served"), "restore2/trees/served"),
        "want_key": (lambda: rk.want_key(on, "restore2/arrays", "rank", 5), f"{j}/restore2/arrays/want/rank/5"),
        "manifest_file_key": (
            lambda: rk.manifest_file_key(on, "restore2/arrays", "arrays", 5),
            f"{j}/restore2/arrays/file/arrays/5",
        ),
        "reads_round_scope": (lambda: rk.reads_round_scope("restore2/reads", "planned"), "restore2/reads/planned"),
        "needs_bucket": (lambda: rk.needs_bucket("r/reads", 6), "r/reads/needs/6"),
        "needs_n_key": (lambda: rk.needs_n_key(on, "r/reads", 6, "d2"), f"{j}/r/reads/needs/6/d2/n"),
        "needs_ranks_key": (lambda: rk.needs_ranks_key(on, "r/reads", 6, "d2"), f"{j}/r/reads/needs/6/d2/ranks"),
        "groups_scope": (lambda: rk.groups_scope("r/reads"), "r/reads/groups"),
        "sig_key": (lambda: rk.sig_key(on, "r/reads", 6, "s1"), f"{j}/r/reads/sig/6/s1"),
        "sig_n_key": (lambda: rk.sig_n_key(on, "r/reads", 6, "s1"), f"{j}/r/reads/sig/6/s1/n"),
        "signatures_key": (lambda: rk.signatures_key(on, "r/reads", 6), f"{j}/r/reads/sigs/6"),
        "route_key": (lambda: rk.route_key(on, "r/reads", 6, "d2"), f"{j}/r/reads/route/6/d2"),
        "work_bucket": (lambda: rk.work_bucket("r/reads", 11), "r/reads/work/11"),
        "lineage_restored_key": (lambda: tk.lineage_restored_key(on, 2), lineage),
        "lineage_agreed_key": (lambda: tk.lineage_agreed_key(node, lineage), f"{n}/{lineage}/agreed"),
        "lineage_read_scope": (lambda: tk.lineage_read_scope(lineage), f"{lineage}/read"),
        "lineage_found_scope": (lambda: tk.lineage_found_scope(lineage), f"{lineage}/found"),
        "drain_decision_key": (lambda: tk.drain_decision_key(on, 30), f"{j}/drain/30/decision"),
        "drain_node_key": (lambda: tk.drain_node_key(on, 30, 8), f"{j}/drain/30/node/8"),
        "remote_commit_key": (lambda: tk.remote_commit_key(on, 30), f"{j}/drain/30/remote-commit"),
        "drain_aside_key": (lambda: tk.drain_aside_key(on, 30, "ab"), f"{j}/drain/30/ab/aside"),
        "held_key": (lambda: tk.held_key(on, 30, "ab"), f"{j}/drain/30/ab/held"),
        "held_count_key": (lambda: tk.held_count_key(on), f"{j}/drain/held"),
        "held_all_key": (lambda: tk.held_all_key(on), f"{j}/drain/held/all"),
        "set_aside_key": (lambda: tk.set_aside_key(on, 1, 30, 8), f"{j}/aside/1/30/8"),
        "pair_prefix": (lambda: tk.pair_prefix(on, "replicate", 2, 5), f"{j}/replicate/pair/2-5"),
        "parity_group_prefix": (lambda: tk.parity_group_prefix(on, "memory-parity", 6), f"{j}/memory-parity/group/6"),
        "copies_done_key": (
            lambda: tk.copies_done_key(on, "memory-replicate", 8, 30),
            f"{j}/memory-replicate/done/8/30",
        ),
        "copies_seen_key": (
            lambda: tk.copies_seen_key(on, "memory-replicate", 8, 30),
            f"{j}/memory-replicate/done/8/30/seen",
        ),
        "whole_holding_key": (lambda: tk.whole_holding_key(on, "r1", 3), f"{j}/memory-whole/r1/holding/3"),
        "whole_done_key": (lambda: tk.whole_done_key(on, "r1", 3), f"{j}/memory-whole/r1/whole/3"),
        "whole_left_key": (lambda: tk.whole_left_key(on, "r1"), f"{j}/memory-whole/r1/left"),
    }


def test_every_family_says_the_key_it_always_said() -> None:
    on = Coordinator.single(5.0)
    node = on.fork(on.store, rank=0, world_size=1, namespace=keys.node_namespace(on.namespace, 3))
    expected = _expected(on, node)
    assert sorted(expected) == sorted(keys.FAMILIES)  # a new family comes with the key it says
    assert {name: call() for name, (call, _) in expected.items()} == {name: s for name, (_, s) in expected.items()}


def test_every_family_is_in_the_protocol_page() -> None:
    page = (ROOT / "docs" / "protocol.md").read_text()
    assert [name for name in keys.FAMILIES if f"`{name}`" not in page] == []


def test_a_digest_is_as_wide_as_the_wire_says() -> None:
    d = keys.digest("pieces")
    assert re.fullmatch(rf"[0-9a-f]{{{keys.DIGEST_HEX}}}", d)
    assert keys.digest("pieces") == d != keys.digest("pieces ")
