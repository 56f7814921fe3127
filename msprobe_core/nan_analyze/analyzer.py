"""Find where NaN/Inf first appeared in a multi-rank dump and how it reached the other ranks.

For each step the ranks' records are replayed together in an order that respects their communication:
each rank runs up to its next ``Distributed.*`` call, and a call runs once every rank that recorded it
has reached it (the n-th ``all_reduce`` on one process group is one call; a send meets its receive).
Along the way:

* a record whose outputs hold NaN/Inf while its inputs (arguments and parameters) do not **made** it;
  a module that made it is narrowed down to the first call inside it (construct.json) that did;
* a record whose inputs hold NaN on a rank where nothing made or brought any means it came **from
  outside the dumped calls** (the data, the weights, an operation the dump does not cover);
* a communication call carries NaN from the ranks whose contribution held it to the ranks it writes
  into. If the call recorded its result (``output``), the NaN is seen arriving there; in-place calls
  such as ``all_reduce`` may record no output (or statistics taken before the call), so the arrival is
  then inferred and shown at the first later record on the receiving rank that holds NaN. A
  collective whose result holds Inf/NaN though no rank sent any made it itself (an overflow in the sum).

The first origin is the earliest of these in the first step that has one, ordered by the collectives
before it, then its position in its rank. Tensor statistics suffice; tensor files are read for
summaries without Max/Min and to count the NaN/Inf of the records named.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from msprobe_core.dumpdir.layout import DumpUnit, discover
from msprobe_core.dumpdir.rank_dump import RankDump, data_file, load_rank_dump
from msprobe_core.dumpdir.record_info import is_descendant, parent_chain, record_stack, tensor_file_summary
from msprobe_core.dumpdir.record_leaves import Leaf, flatten_record
from msprobe_core.nan_analyze import comm
from msprobe_core.nan_analyze.values import leaf_is_bad, signature

COMPUTED = "computed"          # outputs NaN/Inf from finite inputs
FROM_OUTSIDE = "from_outside"  # inputs already NaN/Inf and nothing on the rank made or brought it
COLLECTIVE = "collective"      # a collective's result is NaN/Inf though no rank sent any
OUTPUT = "output"              # the receiving call recorded the NaN in its output
INFERRED = "inferred"          # the call recorded no usable output; first later NaN on that rank


@dataclass
class Call:
    """One record of one rank, in execution order."""

    index: int
    name: str
    record: Any
    inputs: list[Leaf]
    outputs: list[Leaf]
    api: Optional[str] = None
    key: Optional[tuple] = None


@dataclass
class Origin:
    """Where NaN/Inf first appeared on one rank."""

    step: str
    rank: str
    record: str
    kind: str
    index: int
    collectives_before: int
    parent: Optional[str] = None
    parent_chain: list[str] = field(default_factory=list)
    stack: list[str] = field(default_factory=list)
    stack_note: str = ""
    tensors: list[dict] = field(default_factory=list)

    def describe(self) -> str:
        """One sentence saying what happened."""
        how = {COMPUTED: "its outputs hold NaN/Inf while its inputs do not",
               FROM_OUTSIDE: "its inputs already hold NaN/Inf and no earlier dumped call on this rank made or "
                             "received any (the data, the weights or an operation outside the dump)",
               COLLECTIVE: "the collective's result holds NaN/Inf though no rank sent any"}[self.kind]
        parent = f" in {self.parent}" if self.parent else ""
        return f"{self.step} {self.rank}: {self.record}{parent}: {how}"

    def to_dict(self) -> dict:
        return {"step": self.step, "rank": self.rank, "record": self.record, "kind": self.kind,
                "explanation": self.describe(), "position": self.index,
                "collectives_before": self.collectives_before, "parent": self.parent,
                "parent_chain": self.parent_chain, "stack": self.stack, "stack_note": self.stack_note,
                "tensors": self.tensors}


@dataclass
class Hop:
    """NaN carried by one communication call to one rank."""

    step: str
    to_rank: str
    via: str
    from_ranks: list[str]
    sender_records: dict[str, str]
    evidence: str
    first_seen: Optional[str] = None
    note: str = ""

    def describe(self) -> str:
        seen = f", first seen at {self.first_seen}" if self.first_seen and self.first_seen != self.via else ""
        how = "its output holds NaN/Inf" if self.evidence == OUTPUT else "inferred: the call recorded no usable output"
        return (f"{', '.join(self.from_ranks)} -> {self.to_rank} via {self.via} ({how}){seen}"
                + (f"; {self.note}" if self.note else ""))

    def to_dict(self) -> dict:
        return {"from_ranks": self.from_ranks, "to_rank": self.to_rank, "via": self.via,
                "sender_records": self.sender_records, "evidence": self.evidence, "first_seen": self.first_seen,
                "note": self.note, "description": self.describe()}


@dataclass
class StepResult:
    """The analysis of one step over all its ranks."""

    step: str
    ranks: list[str]
    paths: list[str] = field(default_factory=list)
    origins: list[Origin] = field(default_factory=list)
    hops: list[Hop] = field(default_factory=list)
    status: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def first(self) -> Optional[Origin]:
        """The earliest origin of the step (by collectives before it, position, rank)."""
        if not self.origins:
            return None
        return min(self.origins, key=lambda o: (o.collectives_before, o.index, self.ranks.index(o.rank)))

    def to_dict(self) -> dict:
        return {"step": self.step, "ranks": self.ranks, "first_nan": self.first.to_dict() if self.first else None,
                "origins": [o.to_dict() for o in self.origins], "propagation": [h.to_dict() for h in self.hops],
                "rank_status": self.status, "notes": self.notes}


@dataclass
class NanAnalysis:
    """The whole dump's analysis: one ``StepResult`` per step, in step order."""

    dump_path: str
    steps: list[StepResult]

    @property
    def first(self) -> Optional[tuple[StepResult, Origin]]:
        """The first origin of the first step that has one."""
        for step in self.steps:
            if step.first is not None:
                return step, step.first
        return None

    def to_dict(self) -> dict:
        found = self.first
        return {"dump_path": self.dump_path,
                "first_nan": found[1].to_dict() if found else None,
                "propagation": [h.to_dict() for h in found[0].hops] if found else [],
                "rank_status": found[0].status if found else {},
                "steps": [s.to_dict() for s in self.steps]}


class _RankState:
    """What the replay knows about one rank."""

    def __init__(self, label: str, number: int, dump: RankDump, calls: list[Call]):
        self.label = label
        self.number = number
        self.dump = dump
        self.calls = calls
        self.cursor = 0
        self.tainted = False
        self.pending: Optional[Hop] = None
        self.stale: dict[tuple, Hop] = {}
        self.collectives = 0
        self.origins: list[Origin] = []
        self.reached: Optional[Hop] = None
        self.reached_index = 1 << 62
        """Position of the call that brought NaN to this rank (origins after it are consequences)."""

    @property
    def tensor_dir(self) -> Optional[str]:
        d = self.dump.tensor_dir
        return str(d) if d.is_dir() else None

    def bad(self, leaves: list[Leaf], inputs: bool) -> tuple[bool, Optional[Hop]]:
        """Whether any leaf holds NaN/Inf; for inputs, also the hop whose stale statistics a leaf carries."""
        for leaf in leaves:
            if inputs and self.stale:
                sig = signature(leaf.summary)
                if sig in self.stale:
                    return True, self.stale[sig]
            if leaf_is_bad(leaf, self.tensor_dir):
                return True, None
        return False, None


def _calls(dump: RankDump) -> list[Call]:
    calls = []
    p2p_counts: dict[tuple, int] = {}
    for i, (name, record) in enumerate(dump.data.items()):
        leaves = flatten_record(record)
        call = Call(i, name, record, [l for l in leaves if l.role in ("input", "parameters")],
                    [l for l in leaves if l.role in ("output", "parameters_grad")], comm.comm_api(name))
        calls.append(call)
        if call.api is not None:
            call.key = _sync_key(call, p2p_counts)
    return calls


def _sync_key(call: Call, p2p_counts: dict[tuple, int]) -> tuple:
    spec = comm.COMM_SPECS[call.api]
    if not spec.p2p:
        return ("collective-pending", comm.group_ranks(call.record))
    return ("p2p-pending", spec.p2p, comm.root_rank(call.record, spec))


def _resolve_collectives(states: list[_RankState]) -> Optional[str]:
    """Give each collective the key that pairs it: (api, group's ranks, n) for the n-th call of ``api`` on
    that group, the default group being the world (the dumped ranks and every recorded group's ranks).
    Where some record names a process group without its ranks (older dumps), every collective of the step
    pairs by its name's call count instead, and the returned note says so."""
    pending = [(st, call) for st in states for call in st.calls
               if call.key is not None and call.key[0] == "collective-pending"]
    if any(call.key[1] == comm.UNKNOWN_GROUP for _, call in pending):
        for _, call in pending:
            call.key = ("collective", call.api, comm.call_count(call.name))
        return ("the dump records process groups without their ranks: collectives are paired by API and call "
                "count, so calls on different groups may be mispaired")
    world = {st.number for st in states}
    for _, call in pending:
        world.update(call.key[1] or ())
    everyone = tuple(sorted(world))
    counts: dict[tuple, int] = {}
    for st, call in pending:
        group = call.key[1]
        group = everyone if group is None or tuple(sorted(group)) == everyone else group
        n = counts.get((st.number, call.api, group), 0)
        counts[(st.number, call.api, group)] = n + 1
        call.key = ("collective", call.api, group, n)
    return None


def _resolve_p2p(states: list[_RankState]) -> None:
    """Give each send/recv the key that pairs it: (src, dst, k) for the k-th message from src to dst."""
    for st in states:
        counts: dict[tuple, int] = {}
        for call in st.calls:
            if call.key is None or call.key[0] != "p2p-pending":
                continue
            _, role, peer = call.key
            if peer is None:
                call.key = ("p2p-unpaired", st.label, call.index)
                continue
            pair = (st.number, peer) if role == "send" else (peer, st.number)
            k = counts.get(pair, 0)
            counts[pair] = k + 1
            call.key = ("p2p", *pair, k)


def _record_tensors(st: _RankState, call: Call) -> list[dict]:
    out = []
    for leaf in call.inputs + call.outputs:
        if not leaf.is_tensor:
            continue
        bad = leaf_is_bad(leaf, st.tensor_dir)
        entry = {"path": leaf.path, "nan_or_inf": bad, "dtype": leaf.summary.get("dtype"),
                 "shape": leaf.summary.get("shape"), "Max": leaf.summary.get("Max"), "Min": leaf.summary.get("Min")}
        path = data_file(leaf.summary, st.tensor_dir)
        if path is not None and bad:
            counts = tensor_file_summary(path)
            entry.update(numel=counts["numel"], nan=counts["nan"], inf=counts["inf"])
        out.append(entry)
    return out


class _StepReplay:
    """Replays one step's ranks together (see the module docstring)."""

    def __init__(self, step: str, units: list[DumpUnit]):
        self.step = step
        self.states: list[_RankState] = []
        for i, unit in enumerate(units):
            dump = load_rank_dump(unit.path)
            label = unit.rank or unit.path.name
            number = comm.rank_number(label)
            self.states.append(_RankState(label, number if number is not None else i, dump, _calls(dump)))
        _resolve_p2p(self.states)
        pairing_note = _resolve_collectives(self.states)
        self.by_number = {st.number: st for st in self.states}
        self.members: dict[tuple, set[int]] = {}
        for st in self.states:
            for call in st.calls:
                if call.key is not None:
                    self.members.setdefault(call.key, set()).add(st.number)
        self.result = StepResult(step, [st.label for st in self.states], [str(u.path) for u in units])
        if pairing_note:
            self.result.notes.append(pairing_note)

    # ------------------------------------------------------------------ replay
    def run(self) -> StepResult:
        while True:
            for st in self.states:
                self._advance(st)
            waiting = [st for st in self.states if st.cursor < len(st.calls)]
            if not waiting:
                break
            ready = self._ready(waiting)
            if ready is None:  # ranks disagree on the order of their calls: run one rank's call alone
                st = waiting[0]
                call = st.calls[st.cursor]
                self.result.notes.append(f"{st.label}: {call.name} has no matching call on "
                                         f"{self._missing(call.key)} at this point; taken alone")
                ready = {st.number: call}
            self._communicate(ready)
            for number in ready:
                self.by_number[number].cursor += 1
        self._finish()
        return self.result

    def _missing(self, key: tuple) -> str:
        present = {st.number for st in self.states if st.cursor < len(st.calls) and st.calls[st.cursor].key == key}
        missing = sorted(self.members.get(key, set()) - present)
        return ", ".join(self.by_number[n].label for n in missing) or "the other ranks"

    def _ready(self, waiting: list[_RankState]) -> Optional[dict[int, Call]]:
        at = {st.number: st.calls[st.cursor] for st in waiting}
        for number, call in at.items():
            members = self.members.get(call.key, {number})
            if all(m in at and at[m].key == call.key for m in members):
                return {m: at[m] for m in sorted(members)}
        return None

    def _advance(self, st: _RankState) -> None:
        while st.cursor < len(st.calls) and st.calls[st.cursor].key is None:
            self._compute(st, st.calls[st.cursor])
            st.cursor += 1

    def _compute(self, st: _RankState, call: Call) -> None:
        in_bad, stale_hop = st.bad(call.inputs, inputs=True)
        out_bad, _ = st.bad(call.outputs, inputs=False)
        if st.pending is not None and (in_bad or out_bad):
            self._arrived(st, call, stale_hop, in_bad)
        elif stale_hop is not None and not out_bad:
            pass  # the collective's NaN sits in a tensor whose statistics predate it; nothing new here
        elif out_bad and not in_bad:
            self._origin(st, call, COMPUTED)
        elif in_bad and not st.tainted:
            self._origin(st, call, FROM_OUTSIDE)

    def _arrived(self, st: _RankState, call: Call, stale_hop: Optional[Hop], in_bad: bool) -> None:
        hop = st.pending
        assert hop is not None
        hop.first_seen = call.name
        if stale_hop is not None:
            hop.note = (f"{call.name} reads the collective's buffer with the statistics it had before the call "
                        "(the in-place change was not seen by the dump)")
        elif not in_bad:
            hop.note = (f"the input statistics of {call.name} show no NaN (taken before the collective changed the "
                        "tensor in place); its output holds NaN")
        st.pending = None
        st.tainted = True

    def _origin(self, st: _RankState, call: Call, kind: str) -> None:
        construct = st.dump.construct
        chain = parent_chain(call.name, construct)
        stack, note = record_stack(st.dump, call.name)
        st.origins.append(Origin(self.step, st.label, call.name, kind, call.index, st.collectives,
                                 chain[0] if chain else None, chain, stack, note, _record_tensors(st, call)))
        st.tainted = True

    # ------------------------------------------------------------------ communication
    def _communicate(self, ready: dict[int, Call]) -> None:
        specs = {n: comm.COMM_SPECS[c.api] for n, c in ready.items()}
        root = next((r for r in (comm.root_rank(c.record, specs[n]) for n, c in ready.items()) if r is not None),
                    None)
        sources: list[int] = []
        for number, call in ready.items():
            st = self.by_number[number]
            bad, stale_hop = st.bad(comm.slot_leaves(call.inputs, specs[number].send), inputs=True)
            if bad and st.pending is not None:
                self._arrived(st, call, stale_hop, bad)
            elif bad and not st.tainted:
                self._origin(st, call, FROM_OUTSIDE)
            if bad and comm.sends(specs[number], number, root):
                sources.append(number)
        made_here: list[int] = []
        for number, call in ready.items():
            st, spec = self.by_number[number], specs[number]
            if not comm.receives(spec, number, root):
                continue
            outputs = [leaf for leaf in call.outputs if leaf.is_tensor]
            out_bad = st.bad(outputs, inputs=False)[0] if outputs else None
            from_ranks = [n for n in sources if n != number]
            if from_ranks and not st.tainted and st.pending is None:
                hop = self._receive(st, call, ready, from_ranks, out_bad)
                if not out_bad:  # later reads of the buffer may carry statistics taken before the call
                    self._mark_stale(st, call, spec, hop)
            elif not sources and out_bad:
                made_here.append(number)
        for number in made_here:
            st = self.by_number[number]
            if not st.tainted:
                self._origin(st, ready[number], COLLECTIVE)
        for number in ready:
            self.by_number[number].collectives += 1

    def _receive(self, st: _RankState, call: Call, ready: dict[int, Call], from_ranks: list[int],
                 out_bad: Optional[bool]) -> Hop:
        labels = [self.by_number[n].label for n in from_ranks]
        hop = Hop(self.step, st.label, call.name, labels, {self.by_number[n].label: ready[n].name for n in from_ranks},
                  OUTPUT if out_bad else INFERRED)
        if out_bad:
            hop.first_seen = call.name
            st.tainted = True
        else:
            if out_bad is False:
                hop.note = "the call's recorded output holds no NaN/Inf"
            st.pending = hop
        st.reached = hop
        st.reached_index = call.index
        self.result.hops.append(hop)
        return hop

    @staticmethod
    def _mark_stale(st: _RankState, call: Call, spec: comm.CommSpec, hop: Hop) -> None:
        for leaf in comm.slot_leaves(call.inputs, spec.recv):
            sig = signature(leaf.summary)
            if sig is not None:
                st.stale[sig] = hop

    # ------------------------------------------------------------------ per-rank outcome
    def _finish(self) -> None:
        for st in self.states:
            origin = _narrowed(st.origins, st.dump.construct)
            if st.pending is not None:
                st.pending.note = st.pending.note or "no later record on this rank shows the NaN"
            if origin is not None and origin.index < st.reached_index:
                self.result.origins.append(origin)
                self.result.status[st.label] = f"origin: {origin.record} ({origin.kind})"
            elif st.reached is not None:
                self.result.status[st.label] = (f"reached from {', '.join(st.reached.from_ranks)} via "
                                                f"{st.reached.via}")
                later = [o.record for o in st.origins if o.index > st.reached_index]
                if later:
                    self.result.notes.append(f"{st.label}: after the NaN arrived, {later[0]} also made NaN/Inf "
                                             "from finite inputs")
            else:
                self.result.status[st.label] = "no NaN/Inf"


def _narrowed(origins: list[Origin], construct: dict) -> Optional[Origin]:
    """The rank's first origin; a module is replaced by the first origin inside it, repeatedly."""
    if not origins:
        return None
    chosen = origins[0]
    for o in origins[1:]:
        if is_descendant(o.record, chosen.record, construct):
            chosen = o
    return chosen


def analyze(dump_path: str | Path, on_step: Optional[Callable[[StepResult], None]] = None) -> NanAnalysis:
    """Analyse every step and rank under ``dump_path`` (a dump path, a step folder or a rank folder)."""
    level, units = discover(Path(dump_path))
    steps: dict[str, list[DumpUnit]] = {}
    for unit in units:
        steps.setdefault(unit.step or "", []).append(unit)
    results = []
    for step, step_units in steps.items():
        result = _StepReplay(step or "-", step_units).run()
        results.append(result)
        if on_step is not None:
            on_step(result)
    return NanAnalysis(str(dump_path), results)
