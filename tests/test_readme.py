"""The README's "In one screen" example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_one_screen_example_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = blocks[0]
    assert "create_record_runtime" in example
    script = tmp_path / "example.py"
    script.write_text(example)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["8", "buffer back to the pool"]


def test_every_name_the_readme_imports_or_catches_is_public():
    """What the README imports from ``taproute.service`` exists there, and so do
    the errors it tells an embedding program to expect (they were only in
    ``taproute.routing.errors`` and the spool's own modules; ``KeyNotHeld``,
    which a key control's future raises, and ``InsertAbandoned``, the cause of
    a bounded close's ``RoutingFailure``, were not re-exported at all)."""
    import taproute.service as service

    text = README.read_text()
    imported: set[str] = set()
    for grouped, inline in re.findall(r"from taproute\.service import (?:\(([^)]*)\)|(.*))", text):
        names = (grouped or inline).split("#")[0] if inline else grouped
        imported |= {n.strip().strip("`") for n in names.split(",") if n.strip()}
    caught = {
        "ConfigError",
        "ConfigFileError",
        "PlanErrors",
        "RerouteRefused",
        "RoutingFailure",
        "SinkClosed",
        "SpoolLocked",
        "UnboundOutputId",
        "PayloadSizeMismatch",
        "DeadLetterNotFound",
        "BuiltService",
        "KeyNotHeld",
        "InsertAbandoned",
        "load_config",
    }
    assert imported >= {"create_record_runtime", "ClickHouseSink", "Spool"}
    missing = sorted(n for n in imported | caught if n.isidentifier() and not hasattr(service, n))
    assert missing == []
    assert caught <= set(service.__all__)


async def test_the_trio_programs_submit_gives_the_buffer_back_as_the_readme_says():
    """The README's Trio line showed only ``await sink.submit(batch)``: a
    program written from it never got its buffer back (the release callback
    waits for the submitter's own hold, which the runtime gives back for its
    producers). Done as the README now says, the callback runs once, after
    the destination is done with the batch."""
    import numpy as np

    from taproute.native import make_descriptors
    from taproute.service import (
        CaptureSink,
        Layout,
        RecordBatch,
        RecordSchema,
        Route,
        RoutingConfig,
        open_routing_sink,
    )

    assert "batch.lease.release()" in README.read_text()
    schema = RecordSchema([Layout("q", [("values", "Array(Float32)", (4,))])])
    released: list[int] = []
    kept = CaptureSink()  # holds the batch until cleared
    config = RoutingConfig([Route("raw", "layers.*", "kept")])
    async with open_routing_sink(config, schema, {"kept": kept}, unmatched="drop") as sink:
        hook = sink.bind_hook("layers.0.q", layout="q")
        descriptors = make_descriptors(hook, 16, count=2, layout_ids=0)
        batch = RecordBatch.from_buffer(
            descriptors, np.ones((2, 4), np.float32), release=lambda: released.append(1)
        )
        await sink.submit(batch)
        batch.lease.release()  # the submitter's hold, as the README says
        await sink.flush()
        assert released == []  # the destination still holds it
        kept.clear()  # gives the destination's hold back: the callback runs now
        assert released == [1]
    assert released == [1]  # once


def test_how_long_flush_waits_for_an_unreachable_server_is_the_default_retry_budget():
    """The README did not say that a flush without a timeout, while a server
    destination without a spool is down, returns only when the sink's Retry
    budget is spent. The figure it gives now is computed here from the
    defaults, so the two cannot drift apart."""
    from taproute.service.sinks.clickhouse.batching import Retry

    retry = Retry()
    waits = [retry.backoff(failures) for failures in range(1, retry.attempts)]
    text = " ".join(README.read_text().split())
    expected = (
        f"`Retry.attempts = {retry.attempts}`, `initial_backoff = {retry.initial_backoff}`, "
        f"`multiplier = {retry.multiplier}`, `max_backoff = {retry.max_backoff}`"
    )
    assert expected in text
    sums = " + ".join(f"{w:g}" for w in waits[:2]) + f" + ... + {waits[-1]:g}"
    assert f"{len(waits)} waits between them, {sums} = {sum(waits):.1f} s" in text


def test_what_a_stuck_destination_absorbs_is_computed_from_the_defaults():
    """The README did not say how much a stuck destination's mailbox takes
    before a capture blocks or sheds (max_block), nor how to lower it.  The
    figures it gives now are computed here from the defaults, so the two
    cannot drift apart, and the arguments it names exist."""
    import inspect

    from taproute.actors import RoutingSink
    from taproute.routing import Route
    from taproute.routing.limits import (
        DESTINATION_QUEUE_BYTES,
        DESTINATION_QUEUE_RECORDS,
        QUEUE_BYTES,
        QUEUE_RECORDS,
    )
    from taproute.service.host.config_sections import IngressOptions

    text = " ".join(README.read_text().split())
    ingress = IngressOptions()
    assert (ingress.capacity_records, ingress.capacity_bytes) == (QUEUE_RECORDS, QUEUE_BYTES)
    parameters = inspect.signature(RoutingSink).parameters
    assert parameters["destination_capacity"].default == DESTINATION_QUEUE_RECORDS
    assert parameters["destination_capacity_bytes"].default == DESTINATION_QUEUE_BYTES
    mib = 2**20
    row = 768 * 4
    expected = [
        f"By default it holds {DESTINATION_QUEUE_RECORDS:,} records or "
        f"{DESTINATION_QUEUE_BYTES // mib} MiB of payload, whichever fills first",
        f"{DESTINATION_QUEUE_RECORDS // 16:,} batches of 16 records)",
        f"once records carry more than {DESTINATION_QUEUE_BYTES // DESTINATION_QUEUE_RECORDS:,} "
        "bytes each",
        f"({row:,} bytes) fills it at {DESTINATION_QUEUE_BYTES // row:,} records",
        f"ingress fills ({QUEUE_RECORDS:,} records or {QUEUE_BYTES // mib} MiB by default",
        f"{DESTINATION_QUEUE_RECORDS + QUEUE_RECORDS:,} records of a forward route in all",
        f"{Route('r', 'h', 'd').capacity:,} records by default, `Route(capacity=...)`",
        "`RoutingSink(..., destination_capacity=RECORDS, destination_capacity_bytes=BYTES)`",
    ]
    missing = [phrase for phrase in expected if phrase not in text]
    assert missing == []


def test_the_readmes_globs_over_gpt2_blocks_name_the_leaf():
    """The README warns that ``transformer.h.*`` binds every submodule of the
    blocks (fnmatch's ``*`` matches dots), yet its writer-process example
    bound exactly that: run on GPT-2 it bound 26 modules of a 2-block model
    (dropouts, c_attn, ...) instead of one per block. Every bind in the README
    names the leaf or the index."""
    binds = re.findall(r"bind_modules\([^)]*?\"([^\"]+)\"", README.read_text())
    assert binds
    assert [glob for glob in binds if glob.endswith(".h.*")] == []


def test_every_metric_the_readme_names_is_exported():
    """Operators copy metric names from the README into alerts and dashboards:
    each ``taproute_*`` name it gives is a family ``SnapshotCollector`` exports
    (declared even before it has a sample). Left out: the bench's sink names
    (``taproute_chdb``...) and the replay ledger's ``metrics.prom``."""
    import prometheus_client

    from taproute.service import (
        CaptureSink,
        Layout,
        RecordSchema,
        Route,
        RoutingConfig,
        RoutingSink,
        SnapshotCollector,
        create_record_runtime,
    )

    named = {
        name
        for name in re.findall(r"taproute_[a-z_]+", README.read_text())
        if not name.startswith(("taproute_chdb", "taproute_replay_"))
    }
    assert {"taproute_ingress_shed_records_total", "taproute_failure_latched"} <= named
    schema = RecordSchema([Layout("q", [("values", "Array(Float32)")])])
    config = RoutingConfig([Route("raw", "*", "kept")])
    sink = RoutingSink(config, schema, {"kept": CaptureSink()}, unmatched="drop")
    with create_record_runtime(record_sink=sink) as runtime:
        registry = prometheus_client.CollectorRegistry()
        registry.register(SnapshotCollector(runtime.counters))
        text = prometheus_client.generate_latest(registry).decode()
    exported = set(re.findall(r"^# TYPE (\S+)", text, flags=re.M))
    assert sorted(named - exported) == []
