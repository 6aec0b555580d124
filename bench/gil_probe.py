"""Who holds the GIL while a model runs with taproute capturing into chDB.

Run it under py-spy and count samples per thread::

    py-spy record --gil --threads --rate 200 --format raw -o gil.txt -- \
        .venv/bin/python bench/gil_probe.py

It drives GPT-2 (4 layers x 256, batch 8 x 64, 12 hooks, torch on 1 thread)
through 60 forward passes with every hook's output routed raw to chDB, after
3 warm-up passes.  A profile summary is kept in ``bench/profiles/``: the share
of GIL-held samples in the ClickHouse insert threads (chDB's ``query`` holds
the GIL while it inserts) is time the model's own thread cannot run.

``--writer process`` writes through a ``WriterProcessSink`` instead (chDB in
a writer process, hooks copying into its shared-memory pool); profile the
model process alone (no ``--subprocesses``): what is left on its GIL.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from inference_cost import SCHEMA, gpt2

from taproute.service import ClickHouseSink, create_record_runtime
from taproute.service.capture import bind_modules, capture_context
from taproute.service.sinks.writer import WriterProcessSink


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writer", choices=["thread", "process"], default="thread")
    args = parser.parse_args()
    torch.set_num_threads(1)
    threading.current_thread().name = "model"
    model, patterns, forward = gpt2(4, 256)
    ids = torch.randint(3, 1000, (8, 64))
    mask = torch.ones(8, 64, dtype=torch.long)
    keys = list(range(8))
    with tempfile.TemporaryDirectory() as data:
        if args.writer == "process":
            sink: Any = WriterProcessSink.embedded(SCHEMA, f"{data}/gpt2", raw=["acts"])
            pool = sink.buffer_pool
        else:
            sink, pool = ClickHouseSink.embedded(SCHEMA, f"{data}/gpt2", raw=["acts"]), None
        with create_record_runtime(record_sink=sink) as runtime:
            for pattern in patterns:
                bind_modules(runtime, model, pattern, layout="acts", pool=pool)
            for passes in (3, 60):  # warm-up, then the profiled passes
                started = time.perf_counter()
                with torch.inference_mode(), capture_context(keys, attention_mask=mask):
                    for _ in range(passes):
                        forward(ids, mask)
                runtime.flush()
            print(f"60 passes in {time.perf_counter() - started:.2f} s (flush included)")


if __name__ == "__main__":
    main()
