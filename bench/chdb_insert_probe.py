"""What one insert into chDB costs, and what merging the parts costs, for raw
activation blocks shaped like the GPT-2 captures of ``inference_cost.py`` (a
probe, not part of the suite).

    python bench/chdb_insert_probe.py inserts   # CPU per insert, settings interleaved
    python bench/chdb_insert_probe.py merges    # merge CPU over a stream of inserts
    python bench/chdb_insert_probe.py gil       # GIL held per insert, Python() vs file

``inserts``: a 1-row block (the fixed cost of an insert) and a 10.6 MB block
(216 rows of 8-16k floats, what the sink seals at its 10 MiB default) inserted
through ``Python()`` as ``ChdbTransport`` does, into tables with merges
stopped, each variant (insert or table settings) interleaved round by round;
process CPU per insert (``time.process_time``: every thread, chDB's own).
``merges``: 60 inserts of 10.6 MB into one table per table setting, in turn,
then the CPU of chDB's ``MergeMutate`` threads until no merge runs, and the
parts left.  ``gil``: a pure-Python loop on the main thread while another
thread inserts 10.6 MB blocks (27 batches concatenated, as the sink's blocks
are) through ``ChdbTransport``, paced at one block per ``INTERVAL``, with its
Arrow table handed over through ``Python()`` (``scratch_inserts=False``) or
as an Arrow IPC stream in an in-memory file (``scratch_inserts=True``), beside
a GIL-free control (hashlib over 16 MB) and nothing (idle), windows
interleaved; per window the loop thread's time blocked (neither running nor
runnable, from its ``schedstat``: it does no I/O, so that is waiting for the
GIL) per insert, and its share of the window.  The output is printed; keep
it under ``bench/profiles/``.
"""

from __future__ import annotations

import hashlib
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
from chdb import session

from taproute.service.sinks.clickhouse import ChdbTransport

COLUMNS = (
    "hook LowCardinality(String), output_id UInt32, key Int64, step Int64, seq Int64, "
    "timestamp DateTime64(9), values Array(Float32){codec}, values_shape Array(UInt32)"
)
CREATE = (
    "CREATE TABLE `{name}` ({columns}) ENGINE = MergeTree ORDER BY (hook, key, step, seq) "
    "SETTINGS non_replicated_deduplication_window = 10000{settings}"
)


def block(rows: int, seed: int = 0) -> pa.Table:
    """``rows`` raw records as the sink's Arrow table: 12 hooks x 8 sequences
    per pass, half of them 64 tokens and half 32, 256 floats a token."""
    rng = np.random.default_rng(seed)
    tokens = np.resize(np.array([64] * 4 + [32] * 4), rows)
    lengths = tokens * 256
    offsets = np.zeros(rows + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    shapes = np.empty(2 * rows, np.uint32)
    shapes[0::2], shapes[1::2] = tokens, 256
    output_id = np.resize(np.repeat(np.arange(12, dtype=np.int32), 8), rows)
    names = pa.array([f"transformer.h.{i // 3}.{('attn', 'mlp', 'out')[i % 3]}" for i in range(12)])
    return pa.table(
        {
            "hook": pa.DictionaryArray.from_arrays(pa.array(output_id), names),
            "output_id": pa.array(output_id.astype(np.uint32)),
            "key": pa.array(np.resize(np.arange(8, dtype=np.int64), rows)),
            "step": pa.array(np.zeros(rows, np.int64)),
            "seq": pa.array(np.arange(rows, dtype=np.int64)),
            "timestamp": pa.array(np.arange(rows, dtype=np.int64)).cast(pa.timestamp("ns")),
            "values": pa.ListArray.from_arrays(
                pa.array(offsets), pa.array(rng.standard_normal(int(offsets[-1]), np.float32))
            ),
            "values_shape": pa.ListArray.from_arrays(
                pa.array(np.arange(0, 2 * rows + 1, 2, dtype=np.int32)), pa.array(shapes)
            ),
        }
    )


def inserter(sess: session.Session, table: str, settings: str) -> Callable[[pa.Table], None]:
    def insert(arrow_input: pa.Table) -> None:
        columns = ", ".join(f"`{c}`" for c in arrow_input.column_names)
        sess.query(
            f"INSERT INTO `{table}` ({columns}) SETTINGS insert_deduplicate = 1, "
            f"insert_deduplication_token = '{uuid.uuid4().hex}'{settings} "
            f"SELECT {columns} FROM Python(arrow_input)"
        )

    return insert


#: name -> (insert settings, table settings, codec of ``values``)
INSERT_VARIANTS = {
    "default": ("", "", ""),
    "max_threads=1": (", max_threads = 1", "", ""),
    "max_threads=1,max_insert_threads=1": (", max_threads = 1, max_insert_threads = 1", "", ""),
    "no auto statistics": ("", ", auto_statistics_types = ''", ""),
    "no sparse serialization": ("", ", ratio_of_defaults_for_sparse_serialization = 1", ""),
    "compact parts": ("", ", min_bytes_for_wide_part = 1073741824", ""),
    "values CODEC(NONE)": ("", "", " CODEC(NONE)"),
}
MERGE_VARIANTS = {
    "default": "",
    "merge_selector_base = 10": ", merge_selector_base = 10",
    "merge_selector_base = 20": ", merge_selector_base = 20",
    "min_parts_to_merge_at_once = 10": ", min_parts_to_merge_at_once = 10",
}


def inserts(sess: session.Session, rounds: int = 14) -> None:
    data = {"1 row": block(1), "10.6 MB": block(216)}
    calls = {}
    for name, (insert_settings, table_settings, codec) in INSERT_VARIANTS.items():
        table = "t" + uuid.uuid4().hex[:8]
        columns = COLUMNS.format(codec=codec)
        sess.query(CREATE.format(name=table, columns=columns, settings=table_settings))
        sess.query(f"SYSTEM STOP MERGES `{table}`")
        calls[name] = inserter(sess, table, insert_settings)
    cpu: dict[tuple[str, str], list[float]] = {(v, d): [] for v in calls for d in data}
    for _ in range(rounds):
        order = list(cpu)
        random.shuffle(order)
        for variant, size in order:
            began = time.process_time()
            calls[variant](data[size])
            cpu[variant, size].append(time.process_time() - began)
    for (variant, size), samples in cpu.items():
        kept = samples[2:]  # the first rounds warm caches up
        print(
            f"{size:>8} {variant:36s} CPU ms per insert: median "
            f"{statistics.median(kept) * 1e3:6.2f}, min {min(kept) * 1e3:6.2f}"
        )


def merge_cpu() -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for tid in os.listdir("/proc/self/task"):
        try:
            if Path(f"/proc/self/task/{tid}/comm").read_text().startswith("MergeMutate"):
                fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / ticks
        except OSError:
            pass
    return total


def merges(sess: session.Session, inserts_per_table: int = 60) -> None:
    data = block(216)
    for name, settings in MERGE_VARIANTS.items():
        table = "t" + uuid.uuid4().hex[:8]
        sess.query(CREATE.format(name=table, columns=COLUMNS.format(codec=""), settings=settings))
        insert = inserter(sess, table, ", max_threads = 1")
        merged_before, began = merge_cpu(), time.process_time()
        for _ in range(inserts_per_table):
            insert(data)
            time.sleep(0.08)  # the pace of a capture, roughly
        for _ in range(400):
            if sess.query("SELECT count() FROM system.merges", "CSV").bytes().strip() == b"0":
                break
            time.sleep(0.05)
        parts = sess.query(
            f"SELECT count() FROM system.parts WHERE table = '{table}' AND active", "CSV"
        )
        print(
            f"{name:34s} {inserts_per_table} x {data.nbytes / 1e6:.1f} MB: merge CPU "
            f"{merge_cpu() - merged_before:5.2f} s, all CPU {time.process_time() - began:5.2f} s, "
            f"active parts left {parts.bytes().decode().strip()}"
        )


#: Seconds between the starts of two inserts in ``gil`` (10.6 MB blocks: about
#: 100 MB/s, the rate of the GPT-2 capture of ``inference_cost.py``).
INTERVAL = 0.1
#: Seconds of one measured window in ``gil``.
WINDOW = 2.0


def blocked_clock() -> tuple[float, float, float]:
    """This thread's (wall, on-CPU, run-queue wait) seconds so far."""
    tid = threading.get_native_id()
    on, wait, _ = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
    return time.perf_counter(), int(on) / 1e9, int(wait) / 1e9


def gil(data_dir: str, rounds: int = 10) -> None:
    data = pa.concat_tables([block(8, seed) for seed in range(27)])
    transports = {
        "Python()": ChdbTransport(data_dir, scratch_inserts=False),
        "file (memfd)": ChdbTransport(data_dir, scratch_inserts=True),
    }
    table = "t" + uuid.uuid4().hex[:8]
    transports["Python()"].execute(
        CREATE.format(name=table, columns=COLUMNS.format(codec=""), settings="")
    )
    transports["Python()"].execute(f"SYSTEM STOP MERGES `{table}`")
    blob = np.random.default_rng(0).bytes(16 << 20)

    def control() -> None:
        hashlib.sha256(blob).digest()  # releases the GIL over large buffers

    work: dict[str, Callable[[], None] | None] = {
        name: (lambda t=t: t.insert(table, data, dedup_token=uuid.uuid4().hex))
        for name, t in transports.items()
    }
    work |= {"control (hashlib)": control, "idle": None}

    def window(body: Callable[[], None] | None) -> tuple[float, float, int]:
        stop, calls = threading.Event(), [0]

        def pace() -> None:
            due = time.perf_counter()
            while not stop.is_set():
                assert body is not None
                body()
                calls[0] += 1
                due += INTERVAL
                stop.wait(max(0.0, due - time.perf_counter()))

        thread = threading.Thread(target=pace) if body is not None else None
        if thread is not None:
            thread.start()
        wall, on, wait = blocked_clock()
        n, end = 0, wall + WINDOW
        while True:  # the pure-Python loop
            n += 1
            if n % 256 == 0 and time.perf_counter() > end:
                break
        wall_after, on_after, wait_after = blocked_clock()
        stop.set()
        if thread is not None:
            thread.join()
        elapsed = wall_after - wall
        blocked = elapsed - (on_after - on) - (wait_after - wait)
        return blocked, blocked / elapsed, calls[0]

    for body in work.values():  # warm up
        if body is not None:
            body()
    seen: dict[str, list[tuple[float, float, int]]] = {name: [] for name in work}
    for _ in range(rounds):
        order = list(work)
        random.shuffle(order)
        for name in order:
            seen[name].append(window(work[name]))
    print(
        f"{data.nbytes / 1e6:.1f} MB blocks ({data.num_rows} rows, "
        f"{data.column('values').num_chunks} chunks), one every {INTERVAL} s, "
        f"{rounds} windows of {WINDOW} s each, interleaved"
    )
    for name, windows in seen.items():
        per = [b * 1e3 / max(1, calls) for b, _, calls in windows]
        share = [s for _, s, _ in windows]
        print(
            f"{name:18s} loop blocked per insert: median {statistics.median(per):5.2f} ms "
            f"[{min(per):5.2f} .. {max(per):5.2f}]; share of the window: median "
            f"{statistics.median(share):6.2%}; inserts per window "
            f"{statistics.median(c for _, _, c in windows):.0f}"
        )
    for transport in transports.values():
        transport.close()


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "inserts"
    with tempfile.TemporaryDirectory() as data_dir:
        print(f"{what}: load average {os.getloadavg()[0]:.1f} at start")
        if what == "gil":
            gil(f"{data_dir}/probe", int(sys.argv[2]) if len(sys.argv) > 2 else 10)
        else:
            sess = session.Session(f"{data_dir}/probe")
            (inserts if what == "inserts" else merges)(sess)
            sess.close()
        print(f"load average {os.getloadavg()[0]:.1f} at end")


if __name__ == "__main__":
    main()
