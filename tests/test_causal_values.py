"""Causal limits and chain resolution as pure values (issue #15: chaining)."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from taproute.native import make_descriptors
from taproute.routing import ConfigError, Layout, RecordSchema, Route, RoutingConfig
from taproute.routing.causal import CausalLimits, root_ids
from taproute.routing.chains import ChainCycle, ChainError
from taproute.routing.errors import PlanErrors
from taproute.routing.plan import RoutePlan
from taproute.routing.processors import ProcessorRegistry, stateless_processor
from taproute.routing.root_ledger import RootLedger

SCHEMA = RecordSchema(
    [
        Layout("vec", [("values", "Array(Float32)")]),
        Layout("norm", [("key", "Int64"), ("norm", "Float32")]),
        Layout("label", [("key", "Int64"), ("name", "String")]),
    ]
)
REGISTRY = ProcessorRegistry()


@stateless_processor("v.norm", input="vec", output="norm", registry=REGISTRY)
def _norm(records):  # pragma: no cover - never run here
    return None


@stateless_processor("v.again", input="norm", output="norm", registry=REGISTRY)
def _again(records):  # pragma: no cover
    return None


@stateless_processor("v.label", input="vec", output="label", registry=REGISTRY)
def _label(records):  # pragma: no cover
    return None


def plan(*routes: Route, allow_cycles: bool = False) -> RoutePlan:
    return RoutePlan(
        RoutingConfig(routes, allow_cycles=allow_cycles),
        SCHEMA,
        destinations=["d"],
        unmatched="drop",
        registry=REGISTRY,
    )


def stateless(name: str, outputs, processor: str, **kw) -> Route:
    return Route(name, outputs, "d", mode="stateless", processor=processor, **kw)


# -- chains -------------------------------------------------------------------------


def test_then_and_route_outputs_resolve_to_one_graph():
    p = plan(
        stateless("norms", "layers.*", "v.norm", then=("again",)),
        stateless("again", "route:norms", "v.again"),
        Route("raw_norms", "route:norm*", "d"),
    )
    assert p.chains.targets == ((1, 2), (), ())
    assert p.chains.cycles == ()
    # A derived hook matches only the chained routes; hook globs never match it.
    assert p.routes_for("route:norms") == (1, 2)
    assert p.routes_for("layers.0") == (0,)
    everything = plan(Route("all", "*", "d"))
    assert everything.routes_for("route:all") == ()


def test_cycle_is_refused_at_build_naming_its_routes():
    with pytest.raises(ChainCycle) as refused:
        plan(
            stateless("a", "layers.*", "v.norm", then=("b",)),
            stateless("b", "route:a", "v.again", then=("c",)),
            stateless("c", "route:b", "v.again", then=("b",)),
        )
    assert "routes b -> c -> b form a cycle" in str(refused.value)
    assert "allow_cycles" in str(refused.value)
    assert refused.value.where == "routes"
    with pytest.raises(ChainCycle, match=r"routes loop -> loop form a cycle"):
        plan(stateless("loop", ["layers.*", "route:loop"], "v.again"))
    allowed = plan(
        stateless("a", "layers.*", "v.norm", then=("b",)),
        stateless("b", "route:a", "v.again", then=("c",)),
        stateless("c", "route:b", "v.again", then=("b",)),
        allow_cycles=True,
    )
    assert allowed.chains.cyclic == {(1, 2), (2, 1)}
    assert allowed.chains.cycles == (("b", "c"),)


def test_chain_problems_are_all_reported_with_their_key_paths():
    with pytest.raises(PlanErrors) as refused:
        plan(
            stateless("norms", "layers.*", "v.norm", then=("nope",)),
            stateless("labels", "layers.*", "v.label", then=("raw",)),
            stateless("wrong", "route:labels", "v.again"),
            Route("raw", "route:missing*", "d"),
        )
    located = {where: message for message, where in refused.value.located()}
    assert "then names 'nope', which is not a route" in located["routes[0].then[0]"]
    assert "names no route" in located["routes[3].outputs[0]"]
    assert "reads layout 'norm', but 'labels' emits 'label'" in located["routes[2]"]
    assert "variable-length column(s) name" in located["routes[1]"]
    assert all(isinstance(e, ChainError) for e in refused.value.errors)


def test_causal_limits_are_bounded_like_every_config_value():
    with pytest.raises(ConfigError, match=r"causal limits: max_depth must be"):
        CausalLimits(max_depth=0)
    with pytest.raises(ConfigError, match=r"per_root_per_minute must be"):
        CausalLimits(per_root_per_minute=2**40)
    with pytest.raises(ConfigError, match=r"max_roots must be an int in \[16, 2\*\*26\], got 8"):
        CausalLimits(max_roots=8)
    with pytest.raises(ConfigError, match=r"max_roots must be an int"):
        CausalLimits(max_roots=1.5)  # type: ignore[arg-type]
    assert CausalLimits().max_roots == 65536


# -- the root ledger ------------------------------------------------------------------


def test_root_ids_are_stable_per_record_identity_and_differ_between_records():
    d = make_descriptors(3, 4, count=4, keys=[1, 1, 2, 2], timestamps_ns=5)
    first, again = root_ids(d), root_ids(d.copy())
    assert first.tolist() == again.tolist()
    assert len(set(first.tolist())) == 4
    assert root_ids(d[[2]]).tolist() == [first[2]]


def _root_ids_reference(descriptors: np.ndarray) -> np.ndarray:
    """The root ids as the vectorised numpy form computed them before they
    were native: splitmix64's finaliser folded over five fields."""
    mix1, mix2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
    golden = np.uint64(0x9E3779B97F4A7C15)

    def mix(value: np.ndarray) -> np.ndarray:
        value = (value ^ (value >> np.uint64(30))) * mix1
        value = (value ^ (value >> np.uint64(27))) * mix2
        return value ^ (value >> np.uint64(31))

    with np.errstate(over="ignore"):
        h = np.full(len(descriptors), golden, dtype=np.uint64)
        for field in ("output_id", "key", "step", "seq", "timestamp_ns"):
            h = mix(h ^ (descriptors[field].astype(np.int64).view(np.uint64) + golden))
    return h.view(np.int64)


def test_native_root_ids_equal_the_numpy_hash_over_the_whole_int64_range():
    rng = np.random.default_rng(11)
    n = 2000
    d = make_descriptors(2**32 - 1, 4, count=n, keys=rng.integers(-(2**63), 2**63 - 1, n))
    for field in ("step", "seq", "timestamp_ns"):
        d[field] = rng.integers(-(2**63), 2**63 - 1, n)
    d["output_id"] = rng.integers(0, 2**32, n)
    assert root_ids(d).tolist() == _root_ids_reference(d).tolist()
    strided = d[::7]  # not contiguous: copied for the native pass
    assert root_ids(strided).tolist() == _root_ids_reference(strided).tolist()
    assert root_ids(d[:0]).dtype == np.int64 and len(root_ids(d[:0])) == 0


def test_ledger_depth_and_rate_in_one_vectorised_pass():
    ledger = RootLedger()
    limits = CausalLimits(max_depth=3, per_root_per_minute=2)
    roots = np.array([7, 7, 8, 7, 7], np.int64)
    depths = np.array([1, 4, 1, 2, 3], np.int32)
    result = ledger.admit(roots, depths, 60.0, limits)
    # Root 7: depth 4 refused first and spends no token; then two accepted, the third over rate.
    assert result.too_deep.tolist() == [False, True, False, False, False]
    assert result.accepted.tolist() == [True, False, True, True, False]
    assert result.over_rate.tolist() == [False, False, False, False, True]
    assert ledger.used(7, 119.9) == 2 and ledger.used(8, 60) == 1
    # The next minute restores rate capacity only.
    nxt = ledger.admit(np.array([7, 7, 7]), np.array([1, 4, 2], np.int32), 120.0, limits)
    assert nxt.accepted.tolist() == [True, False, True]


def test_limits_are_pinned_per_root_at_its_first_accepted_derived_record():
    ledger = RootLedger()
    old = CausalLimits(max_depth=2, per_root_per_minute=1)
    new = CausalLimits(max_depth=5, per_root_per_minute=3)
    refused_first = ledger.admit(np.array([9]), np.array([3], np.int32), 0.0, old)
    assert not refused_first.accepted[0] and ledger.pinned(9) is None  # refused: not pinned
    ledger.admit(np.array([1]), np.array([1], np.int32), 0.0, old)
    assert ledger.pinned(1) == CausalLimits(max_depth=2, per_root_per_minute=1)
    later = ledger.admit(np.array([1, 1, 2, 2]), np.array([3, 1, 3, 1], np.int32), 61.0, new)
    # Root 1 keeps depth 2 / 1 per minute; root 2 is new and gets the new limits.
    assert later.accepted.tolist() == [False, True, True, True]
    assert ledger.pinned(2) == new
    # Forgotten after its retention; derives again under the limits then in force.
    ledger.admit(np.array([3]), np.array([1], np.int32), 60.0 * 17, new)
    assert ledger.pinned(1) is None and ledger.pinned(3) == new


def test_ledger_matches_a_per_record_reference_model_through_growth_and_minutes():
    """The vectorised hash table against the rules applied one record at a time."""
    rng = np.random.default_rng(7)
    limits = [CausalLimits(max_depth=5, per_root_per_minute=3), CausalLimits(per_root_per_minute=4)]
    ledger = RootLedger(capacity=16)  # grows many times
    pinned: dict[int, CausalLimits] = {}
    counts: dict[int, tuple[int, int]] = {}  # root -> (minute, count)
    pool = rng.integers(-(2**63), 2**63 - 1, 3000, dtype=np.int64)
    now = 0.0
    for step in range(60):
        now += float(rng.choice([0.5, 7.0, 61.0]))
        current = limits[step // 30]
        roots = rng.choice(pool[: 100 + 50 * step], 400)
        depths = rng.integers(1, 8, 400).astype(np.int32)
        result = ledger.admit(roots, depths, now, current)
        minute = int(now // 60)
        expected = []
        for root, depth in zip(roots.tolist(), depths.tolist(), strict=True):
            bound = pinned.get(root, current)
            if depth > bound.max_depth:
                expected.append(False)
                continue
            seen_minute, used = counts.get(root, (minute, 0))
            used = used if seen_minute == minute else 0
            ok = used < bound.per_root_per_minute
            if ok:
                pinned.setdefault(root, current)
                counts[root] = (minute, used + 1)
            expected.append(ok)
        assert result.accepted.tolist() == expected, step
        # Forgetting a root pinned with the limits in force changes nothing.
        for root in list(pinned):
            if pinned[root] == current and counts[root][0] < minute:
                del pinned[root], counts[root]
    assert len(ledger) == len(pinned) and len(ledger) > 0


def test_the_native_root_table_checks_its_arguments():
    from taproute.native import RootTable

    table = RootTable(4)
    one = np.array([1], np.int64)
    limits = np.array([32], np.int64), np.array([128], np.int64)
    with pytest.raises(ValueError, match="1 roots but 2 depths"):
        table.admit(one, np.array([1, 1], np.int32), 0, 0, *limits)
    with pytest.raises(ValueError, match="pin 1 outside the 1 limits given"):
        table.admit(one, np.array([1], np.int32), 0, 1, *limits)
    with pytest.raises(ValueError):
        table.admit(
            one, np.array([1], np.int32), 0, 0, np.array([32], np.int64), np.empty(0, np.int64)
        )
    verdicts, _, _ = table.admit(
        np.arange(100, dtype=np.int64), np.ones(100, np.int32), 0, 0, *limits
    )
    assert verdicts.tolist() == [0] * 100 and len(table) == 100  # grown past its capacity
    assert table.entry(5) == (0, 1, 0) and table.entry(1000) is None


# -- the ledger's bound (max_roots) ------------------------------------------------


def test_a_full_ledger_holds_at_most_max_roots_evicting_the_lowest_counts():
    """Memory is bounded by the table's size, whatever the derived-record rate:
    5000 roots deriving in one minute leave at most ``max_roots`` in a table
    that never grows past what ``max_roots`` needs; the roots with the most
    derived records stay, an evicted root's count restarts."""
    from taproute.native import RootTable

    limits = CausalLimits(max_roots=64, per_root_per_minute=4)
    bound = RootTable(64).nbytes  # the table sized for 64 roots
    ledger = RootLedger(capacity=16)
    hot = np.full(3, -7, np.int64)  # one root already 3 derived records deep into its minute
    assert ledger.admit(hot, np.ones(3, np.int32), 0.0, limits).accepted.all()
    for step in range(100):
        roots = np.arange(step * 50, step * 50 + 50, dtype=np.int64)
        result = ledger.admit(roots, np.ones(50, np.int32), 1.0, limits)
        assert result.accepted.all()  # new roots: never refused for want of room
        assert len(ledger) <= 64 and ledger.nbytes <= bound, step
    assert ledger.evicted == 5000 + 1 - len(ledger) and ledger.evicted > 4900
    assert ledger.used(-7, 1.0) == 3  # the highest count is the last evicted
    # An evicted root starts afresh: its minute's count restarts (errs toward admitting).
    evicted = next(r for r in range(5000) if ledger.pinned(r) is None)
    again = ledger.admit(np.full(5, evicted, np.int64), np.ones(5, np.int32), 2.0, limits)
    assert again.accepted.tolist() == [True, True, True, True, False]
    # One batch larger than the table is judged in chunks, still within the bound.
    big = ledger.admit(
        np.arange(10**6, 10**6 + 1000, dtype=np.int64), np.ones(1000, np.int32), 3.0, limits
    )
    assert big.accepted.all() and len(ledger) <= 64 and ledger.nbytes <= bound


def test_evicting_a_flood_of_one_record_roots_keeps_lookups_short():
    """A flood of new roots (one derived record each, so every count ties)
    evicts over and over; the survivors stay spread over the table, so a
    lookup walks a short run of slots.  Ties used to be broken by slot: the
    survivors packed into one end of the table and a probe walked thousands
    of slots (a 1024-root batch took 14 ms instead of 25 us)."""
    from taproute.native import RootTable

    table = RootTable()
    rng = np.random.default_rng(1)
    limits = np.array([8], np.int64), np.array([10**9], np.int64)
    longest = 0
    for _ in range(400):  # 25 evictions of a quarter of the table each
        roots = rng.integers(-(2**62), 2**62, 256, dtype=np.int64)
        verdicts, _, _ = table.admit(roots, np.ones(256, np.int32), 5, 0, *limits, 4096)
        assert not verdicts.any()
        longest = max(longest, table.longest_probe())
    assert table.evicted == 400 * 256 - len(table) and len(table) <= 4096
    # At most half full and spread at random, runs stay short: ~40 slots here
    # (a run of 256 is astronomically unlikely; the slot tie-break gave thousands).
    assert longest < 256, longest


def test_a_flood_after_a_reload_evicts_roots_of_the_current_limits_first():
    """A root pinned before a reload that tightened max_depth keeps its own
    limits through a flood of new roots that fills the ledger: roots pinned
    with the current limits (which only restart their counts) are evicted
    first, so its chain goes on at depth 5 as an unbounded ledger allows."""
    old = CausalLimits(max_depth=32, max_roots=64)
    new = CausalLimits(max_depth=2, max_roots=64)
    root = 12345
    verdicts = {}
    for name, limits in (("bounded", new), ("unbounded", attrs.evolve(new, max_roots=2**26))):
        ledger = RootLedger()
        assert ledger.admit(np.array([root]), np.array([1], np.int32), 600.0, old).accepted.all()
        flood = np.arange(1, 200, dtype=np.int64) * 7919 + 10**9
        ledger.admit(flood, np.ones(len(flood), np.int32), 600.0, limits)
        if name == "bounded":
            assert ledger.evicted > 0 and len(ledger) <= 64
        assert ledger.pinned(root) == old
        deeper = ledger.admit(np.array([root]), np.array([5], np.int32), 600.0, limits)
        verdicts[name] = bool(deeper.accepted[0])
    assert verdicts == {"bounded": True, "unbounded": True}


def test_a_bounded_ledger_never_refuses_what_an_unbounded_one_accepts():
    """Against the same ledger with room for every root: the bounded one
    admits a superset (its counts are never higher), and admits more once it
    has evicted; depth refusals are the same."""
    rng = np.random.default_rng(3)
    bounded = CausalLimits(max_roots=32, per_root_per_minute=3, max_depth=4)
    roomy = attrs.evolve(bounded, max_roots=2**26)
    small, large = RootLedger(capacity=16), RootLedger(capacity=16)
    extra = 0
    now = 0.0
    for _ in range(200):
        now += float(rng.choice([0.1, 1.0, 30.0]))
        roots = rng.integers(0, 200, 64).astype(np.int64)
        depths = rng.integers(1, 6, 64).astype(np.int32)
        a = small.admit(roots, depths, now, bounded)
        b = large.admit(roots, depths, now, roomy)
        assert not (b.accepted & ~a.accepted).any()
        assert a.too_deep.tolist() == b.too_deep.tolist()
        extra += int(np.count_nonzero(a.accepted & ~b.accepted))
        assert len(small) <= 32
    assert small.evicted > 0 and extra > 0
