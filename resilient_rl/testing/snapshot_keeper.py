"""A :class:`~resilient_rl.workers.snapshots.keeper.SnapshotKeeper` against fake worker groups:
ranks that keep, hold, publish and load snapshots as the workers' snapshot parts do, minus the
tensors, with the faults the tests inject (a rank that dies taking, sealing or loading; a lost
holder; node memory that is unusable or left behind; a corrupt copy)."""

from __future__ import annotations

from types import SimpleNamespace

from ray.exceptions import ActorDiedError

from resilient_rl.errors import WorkerDiedError
from resilient_rl.workers.snapshots.keeper import SnapshotKeeper
from resilient_rl.workers.snapshots.node_memory import NodeCopy


class Ref:
    def __init__(self, value=None, error=None, ready=True):
        self.value, self.error, self.ready = value, error, ready

    def resolve(self):
        if self.error is not None:
            raise self.error
        return self.value


def fake_wait(refs, num_returns, timeout, fetch_local):
    if timeout:  # waited for: the answers in flight arrive
        for r in refs:
            r.ready = True
    ready = [r for r in refs if r.ready]
    return ready, [r for r in refs if not r.ready]


def fake_get(refs, timeout=None):
    return [r.resolve() for r in refs]


class FakeGroup:
    """Ranks that keep snapshots like RankSnapshots, minus the tensors."""

    def __init__(self, n, role="actor"):
        self.world_size, self.role = n, role
        self.own = [dict() for _ in range(n)]  # rank -> step -> state
        self.held = [dict() for _ in range(n)]  # rank -> (owner, step) -> state
        self.store_lost: set[int] = set()
        self.dead_holders: set[int] = set()
        self.dead_loaders: set[int] = set()  # ranks whose process dies when asked to load
        self.loaded: dict[int, tuple] = {}
        self.calls: list[tuple] = []
        self.hold_pending = self.take_pending = self.publish_pending = self.seal_pending = False
        self.take_error: set[int] = set()
        self.died_taking: set[int] = set()  # ranks whose process dies during the take (no copy at all)
        self.died_sealing: set[int] = set()  # ranks whose process dies after its take, before its seal
        self.sealed: set[tuple[int, str]] = set()  # (rank, snapshot id) of the sealed node copies
        self.node: list[dict] = [dict() for _ in range(n)]  # rank -> snapshot id -> state in its node's memory
        self.node_error: set[int] = set()  # ranks whose node memory is unusable
        self.node_lost: set[int] = set()  # ranks now on another node than their node copies
        self.corrupt: set[tuple[int, str]] = set()  # (rank, source) whose copy fails its checksum
        self.siblings: dict[str, "FakeGroup"] = {}  # role -> group sharing this group's processes

    def execute_rank_async(self, rank, method, *args):
        self.calls.append((rank, method, args))
        if method == "take_snapshot":
            step, take_roles, where = args
            if rank in self.take_error:
                return Ref(error=RuntimeError(f"rank {rank} died"))
            if rank in self.died_taking:
                return Ref(error=ActorDiedError())
            failed = {}
            for role in take_roles:  # this process's roles (colocated ones in sibling groups)
                g = self.siblings.get(role, self)
                g.own[rank][step] = f"{role}{rank}@{step}"
                if where is not None and rank in g.node_error:
                    failed[role] = "OSError: [Errno 28] No space left on device"
                elif where is not None:
                    g.node[rank][where["id"]] = (where["dir"], f"{role}{rank}@{step}")
            return Ref({"step": step, "bytes": {role: 10 for role in take_roles}, "node_failed": failed},
                       ready=not self.take_pending)
        if method == "seal_snapshot":
            step, take_roles, _timeout_s = args
            if rank in self.take_error:
                return Ref(error=RuntimeError(f"seal_snapshot: the copy of step {step} is gone"))
            if rank in self.died_taking | self.died_sealing:
                return Ref(error=ActorDiedError())
            for role in take_roles:
                g = self.siblings.get(role, self)
                g.sealed |= {(rank, i) for i, (_, state) in g.node[rank].items() if state.endswith(f"@{step}")}
            return Ref({"step": step, "checksums": {role: "xxh3_64:0" for role in take_roles}},
                       ready=not self.seal_pending)
        if method == "publish_snapshot":
            step, take_roles, _timeout_s = args
            if rank in self.take_error:
                error = RuntimeError(f"publish_snapshot: the copy of step {step} is gone")
                return [Ref(error=error), Ref(error=error)]
            out = {role: {"step": step, "rank": rank, "bytes": 10, "state": f"{role}{rank}@{step}"}
                   for role in take_roles}
            return [Ref({"step": step}, ready=not self.publish_pending),
                    Ref({"step": step, "rank": rank, "roles": out})]
        if method == "hold_snapshot":
            step, owners, takes, _timeout_s = args
            for take in takes:
                if take.error is not None:
                    return Ref(error=take.error)
            for keys, take in zip(owners, takes):
                for owner_role, owner in keys:
                    self.held[rank][(owner_role, owner, step)] = take.value["roles"][owner_role]
            return Ref({"step": step, "kept": sum(map(len, owners))}, ready=not self.hold_pending)
        if method == "held_snapshot":
            step, owner_role, owner = args
            if rank in self.dead_holders:
                return Ref(error=RuntimeError("holder lost"))
            for g in {id(g): g for g in [self, *self.siblings.values()]}.values():  # any role of the process
                if (owner_role, owner, step) in g.held[rank]:
                    return Ref(g.held[rank][(owner_role, owner, step)])
            return Ref(None)
        if method == "node_copy_here":
            step, source = args
            where, state = self.node[rank].get(source.snap_id, (None, None))
            return Ref(rank not in self.node_lost and where == source.run_dir and state is not None)
        if method == "load_snapshot":
            step, source, _timeout = args
            if rank in self.dead_loaders:
                return Ref(error=WorkerDiedError(f"{self.role} rank {rank} died", role=self.role, rank=rank,
                                                 cause="died"))
            if source is None:
                state = self.own[rank].get(step)
                kind = "own"
            elif isinstance(source, NodeCopy):
                where, state = self.node[rank].get(source.snap_id, (None, None))
                if rank in self.node_lost or where != source.run_dir:
                    state = None
                kind = "node"
            elif isinstance(source, list):
                state = None if rank in self.store_lost else source[0].value["roles"][self.role]["state"]
                kind = "object_store"
            else:  # a ref resolved by Ray before the call
                if source.error is not None:
                    return Ref(error=source.error)
                state = source.value["state"] if source.value else None
                kind = "peer"
            if state is None:
                return Ref(False)
            if (rank, kind) in self.corrupt:
                return Ref({"corrupt": f"checksum xxh3_64:1 does not match the recorded xxh3_64:0 ({kind})"})
            self.loaded[rank] = (kind, state)
            return Ref("unsealed" if kind == "node" and (rank, source.snap_id) not in self.sealed else True)
        raise AssertionError(method)

    def get(self, refs, timeout_s=None):
        return fake_get(refs)

    def restart(self, rank):
        self.own[rank], self.held[rank] = {}, {}


class FakeRoles:
    """Each role in its own processes, or (``colocated``) every role's rank r in process r; each
    process on a node of its own unless ``nodes`` ((role, rank) -> node) says otherwise."""

    def __init__(self, *groups, nodes=None, colocated=False):
        self.groups = list(groups)
        self.nodes = nodes or {}
        self.colocated = colocated
        if colocated:
            for g in groups:
                g.siblings = {h.role: h for h in groups}

    def checkpoint_groups(self):
        return [(g.role, g) for g in self.groups]

    def role_processes(self):
        out = {}
        for g in self.groups:
            for r in range(g.world_size):
                pid = f"p{r}" if self.colocated else f"{g.role}{r}"
                out[(g.role, r)] = (pid, self.nodes.get((g.role, r), f"node-of-{pid}"))
        return out


def keeper(every=1, max_task_retries=0, events=None, node_dir="", record_path=None):
    cfg = SimpleNamespace(snapshot_every=every, max_task_retries=max_task_retries, call_timeout_s=10.0,
                          snapshot_node_dir=node_dir, snapshot_hand_over_s=600.0)
    emit = (lambda kind, **f: events.append((kind, f))) if events is not None else (lambda kind, **f: None)
    return SnapshotKeeper(cfg, emit=emit, wait=fake_wait, get=fake_get, run_key="run", record_path=record_path)
