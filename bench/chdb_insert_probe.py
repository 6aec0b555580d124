"""What one insert into chDB costs, and what merging the parts costs, for raw
activation blocks shaped like the GPT-2 captures of ``inference_cost.py`` (a
probe, not part of the suite).

    python bench/chdb_insert_probe.py inserts   # CPU per insert, settings interleaved
    python bench/chdb_insert_probe.py merges    # merge CPU over a stream of inserts

``inserts``: a 1-row block (the fixed cost of an insert) and a 10.6 MB block
(216 rows of 8-16k floats, what the sink seals at its 10 MiB default) inserted
through ``Python()`` as ``ChdbTransport`` does, into tables with merges
stopped, each variant (insert or table settings) interleaved round by round;
process CPU per insert (``time.process_time``: every thread, chDB's own).
``merges``: 60 inserts of 10.6 MB into one table per table setting, in turn,
then the CPU of chDB's ``MergeMutate`` threads until no merge runs, and the
parts left.  The output is printed; keep it under ``bench/profiles/``.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
from chdb import session

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


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "inserts"
    with tempfile.TemporaryDirectory() as data_dir:
        sess = session.Session(f"{data_dir}/probe")
        print(f"{what}: load average {os.getloadavg()[0]:.1f} at start")
        (inserts if what == "inserts" else merges)(sess)
        print(f"load average {os.getloadavg()[0]:.1f} at end")
        sess.close()


if __name__ == "__main__":
    main()
