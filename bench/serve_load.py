"""taproute inside a real inference server, under load: capture off vs on.

Starts ``bench/inference_server.py`` with ``--capture off`` (no taproute at
all) and ``--capture on`` (hooks, routes, chDB; by default in a writer
process) and drives them from asyncio clients (aiohttp, loopback only, in
this process, on the same 2 cores), phases interleaved round by round:

1. saturation: ``--clients`` closed-loop clients for ``--duration`` s; the
   capture-off throughput is the server's measured capacity (with
   ``--compare-thread 1``, a third server with chDB in its own threads,
   ``--writer thread``, is measured here too);
2. fixed offered loads (``--loads``, fractions of that capacity), open loop:
   request ``i`` is due at ``start + i / rate`` whatever happened before, and
   its latency is counted from then (so a stalled server cannot hide its
   queue: corrected for coordinated omission), at most ``--clients`` in flight.

The capture-on server writes through ``--writer`` (default ``process``:
chDB in a writer process, the choice the README gives for a serving process
whose model runs Python on its own thread), the batches of one wake-up
handed on merged into one (``--merge-batches 0``: each alone, as before
the merge), taproute's loop polling the hooks' queue every
``--wake-delay-ms``, its writer process at niceness ``--writer-nice``
(``--compare-merge 1``, ``--compare-wake-ms N``, ``--compare-nice N`` and
``--compare-judging 1`` add a capture-on server with the merge off, polling
every N ms, its writer N steps nicer, or worker-thread processor calls
judged by wall time as before THREAD_WAIT_S, to every phase).  Each capture-on phase ends with
a flush of the on-server (everything captured is in ClickHouse), and its
throughput is also given to that point.  Per phase: requests/s, tokens/s,
p50/p95/p99 (HdrHistogram), the server's CPU (its writer process included:
cores busy, and CPU per request) and RSS.  After the run: records captured,
rows in ClickHouse per table, checked exactly against what the clients sent,
and records shed.

All of that runs ``--sessions`` times, each session with fresh server
processes (and its fixed loads set from its own capacity); the figures are
pooled over the sessions.  Two processes of the same server differ by as
much as the effects measured (where their threads land, their allocators'
and chDB's state), so one process per variant cannot tell an A/B apart;
the per-session saturation table shows how far apart they were.

Every server calls ``gc.freeze()`` once its models are loaded
(``--gc-freeze 0``: not), capture off and on alike, as the README advises
a serving process to.  ``--switch-interval-ms N`` sets every server's
Python switch interval (``sys.setswitchinterval``; 0, the default: Python's
own 5 ms), capture off and on alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
from hdrh.histogram import HdrHistogram

HERE = Path(__file__).resolve().parent

MAX_LATENCY_US = 120_000_000


class Server:
    """One server process; ``url`` once it answers."""

    def __init__(
        self,
        capture: bool,
        data: Path,
        torch_threads: int,
        max_block_ms: float,
        log: Path,
        writer: str = "thread",
        merge_batches: bool = True,
        wake_delay_ms: float = 100.0,
        writer_nice: int = 0,
        judge_thread_calls: str = "cpu",
        gc_freeze: bool = True,
        switch_interval_ms: float = 0.0,
    ) -> None:
        self.capture = capture
        self._log = log.open("w")
        self.process = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "inference_server.py"),
                "--capture",
                "on" if capture else "off",
                "--data",
                str(data),
                "--torch-threads",
                str(torch_threads),
                "--max-block-ms",
                str(max_block_ms),
                "--writer",
                writer,
                "--merge-batches",
                "on" if merge_batches else "off",
                "--wake-delay-ms",
                str(wake_delay_ms),
                "--writer-nice",
                str(writer_nice),
                "--judge-thread-calls",
                judge_thread_calls,
                "--gc-freeze",
                "on" if gc_freeze else "off",
                "--switch-interval-ms",
                str(switch_interval_ms),
            ],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )

    def wait_ready(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"server exited ({self.process.wait()}); see {self._log.name}")
        self.url: str = json.loads(line)["url"]
        import psutil

        self.ps = psutil.Process(self.process.pid)
        return self.url

    def cpu_seconds(self) -> float:
        """CPU time of the server and of its live children (a writer process)."""
        total = sum(self.ps.cpu_times()[:2])
        for child in self.ps.children(recursive=True):
            with contextlib.suppress(Exception):  # exited between listing and reading
                total += sum(child.cpu_times()[:2])
        return float(total)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


class Workload:
    """Request bodies for one endpoint, and the work each implies."""

    def __init__(self, name: str, max_new_tokens: int) -> None:
        self.name = name
        self.max_new_tokens = max_new_tokens
        from taproute.service.demo.run import sentences

        self.texts = sentences(64)
        self.sent = 0

    def body(self, i: int) -> dict[str, Any]:
        if self.name == "embed":
            k = i % len(self.texts)
            return {"input": self.texts[k : k + 1 + i % 3]}
        return {"prompt": self.texts[i % len(self.texts)], "max_new_tokens": self.max_new_tokens}

    @staticmethod
    def tokens(answer: dict[str, Any]) -> int:
        usage = answer["usage"]
        return int(usage.get("completion_tokens", usage["prompt_tokens"]))


class Phase:
    """What one phase measured."""

    def __init__(self) -> None:
        self.histogram = HdrHistogram(1, MAX_LATENCY_US, 3)
        self.ok = 0
        self.errors = 0
        self.unfinished = 0
        self.tokens = 0
        self.inputs = 0  # embed: sentences; generate: forward rows (= new tokens)
        self.seconds = 0.0
        self.flush_seconds = 0.0
        self.cpu_seconds = 0.0
        self.rss = 0
        self.shed_total = 0  # capture on: records shed so far (cumulative, server-wide)
        self.shed = 0  # ... of which in this phase

    def record(self, latency_s: float, answer: dict[str, Any] | None, inputs: int) -> None:
        if answer is None:
            self.errors += 1
            return
        self.ok += 1
        self.inputs += inputs
        self.tokens += Workload.tokens(answer)
        self.histogram.record_value(min(max(1, int(latency_s * 1e6)), MAX_LATENCY_US))

    def figures(self) -> dict[str, Any]:
        h = self.histogram
        persisted = self.seconds + self.flush_seconds
        return {
            "requests": self.ok,
            "errors": self.errors,
            "unfinished": self.unfinished,
            "requests_per_s": self.ok / self.seconds if self.seconds else 0.0,
            "requests_per_s_persisted": self.ok / persisted if persisted else 0.0,
            "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
            "p50_ms": h.get_value_at_percentile(50) / 1000,
            "p95_ms": h.get_value_at_percentile(95) / 1000,
            "p99_ms": h.get_value_at_percentile(99) / 1000,
            "max_ms": h.get_max_value() / 1000,
            "seconds": self.seconds,
            "flush_seconds": self.flush_seconds,
            "server_cores_busy": self.cpu_seconds / persisted if persisted else 0.0,
            "server_cpu_ms_per_request": 1e3 * self.cpu_seconds / self.ok if self.ok else 0.0,
            "server_rss_mib": self.rss / 2**20,
            "shed": self.shed,
        }


async def _post(session: Any, url: str, body: dict[str, Any]) -> dict[str, Any] | None:
    async with session.post(url, json=body) as response:
        if response.status != 200:
            return None
        answer: dict[str, Any] = await response.json()
        return answer


async def closed_loop(
    session: Any, url: str, work: Workload, clients: int, duration: float, phase: Phase
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + duration

    async def client(c: int) -> None:
        i = c
        while loop.time() < deadline:
            body = work.body(i)
            started = loop.time()
            answer = await _post(session, url, body)
            phase.record(loop.time() - started, answer, _inputs(work, body))
            i += clients

    started = loop.time()
    await asyncio.wait_for(asyncio.gather(*(client(c) for c in range(clients))), duration + 60)
    phase.seconds = loop.time() - started


async def open_loop(
    session: Any, url: str, work: Workload, rate: float, duration: float, clients: int, phase: Phase
) -> None:
    loop = asyncio.get_running_loop()
    count = max(1, int(rate * duration))
    slots = asyncio.Semaphore(clients)
    start = loop.time() + 0.01

    async def one(i: int, due: float) -> None:
        body = work.body(i)
        async with slots:  # a request waiting for a client still ages from `due`
            answer = await _post(session, url, body)
        phase.record(loop.time() - due, answer, _inputs(work, body))

    tasks = []
    for i in range(count):
        due = start + i / rate
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, due)))
    _, pending = await asyncio.wait(tasks, timeout=duration + 60)
    for task in pending:
        task.cancel()
    phase.unfinished = len(pending)
    phase.seconds = loop.time() - start


def _inputs(work: Workload, body: dict[str, Any]) -> int:
    return len(body["input"]) if work.name == "embed" else int(body["max_new_tokens"])


async def run_phase(
    server: Server, work: Workload, *, rate: float | None, clients: int, duration: float
) -> Phase:
    import aiohttp

    phase = Phase()
    url = f"{server.url}/{work.name}"
    cpu = server.cpu_seconds()
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector) as session:
        if rate is None:
            await closed_loop(session, url, work, clients, duration, phase)
        else:
            await open_loop(session, url, work, rate, duration, clients, phase)
        if server.capture:  # the clock for "persisted" stops once ClickHouse has it all
            started = time.perf_counter()
            async with session.post(f"{server.url}/admin/flush") as response:
                response.raise_for_status()
                phase.shed_total = int((await response.json())["shed"])
            phase.flush_seconds = time.perf_counter() - started
    phase.cpu_seconds = server.cpu_seconds() - cpu
    phase.rss = server.ps.memory_info().rss
    return phase


def flush_report(server: Server) -> dict[str, Any]:
    import urllib.request

    request = urllib.request.Request(f"{server.url}/admin/flush", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=600) as response:
        report: dict[str, Any] = json.loads(response.read())
    return report


def _report_totals(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The flush reports of every capture-on server process, added up."""
    total: dict[str, Any] = {
        "submitted": 0,
        "shed": 0,
        "blocked_seconds": 0.0,
        "dropped": {},
        "clickhouse_rows": {},
        "failure": None,
    }
    for report in reports:
        total["submitted"] += report.get("submitted", 0) or 0
        total["shed"] += report.get("shed", 0) or 0
        total["blocked_seconds"] += report.get("blocked_seconds", 0.0) or 0.0
        for hook, why in report.get("dropped", {}).items():
            into = total["dropped"].setdefault(hook, {})
            for reason, n in why.items():
                into[reason] = into.get(reason, 0) + n
        for table, n in report.get("clickhouse_rows", {}).items():
            total["clickhouse_rows"][table] = total["clickhouse_rows"].get(table, 0) + n
        total["failure"] = total["failure"] or report.get("failure")
    total["per_process"] = reports
    return total


def main() -> None:
    args = harness.arguments(
        __doc__.splitlines()[0],
        duration=(8.0, 3.0),
        repeat=(2, 1),
        warmup=(1, 0),
        sessions=(2, 1),
        loads=([0.25, 0.5, 0.8], [0.5, 0.8]),
        workloads=(["embed", "generate"], ["embed"]),
        clients=(64, 32),
        max_new_tokens=(16, 8),
        torch_threads=(1, 1),
        max_block_ms=(50.0, 50.0),
        writer=("process", "process"),
        compare_thread=(1, 1),
        merge_batches=(1, 1),
        compare_merge=(0, 0),
        wake_delay_ms=(100.0, 100.0),
        compare_wake_ms=(0.0, 0.0),
        writer_nice=(0, 0),
        compare_nice=(0, 0),
        compare_judging=(0, 0),
        gc_freeze=(1, 1),
        switch_interval_ms=(0.0, 0.0),
    )
    params = {
        k: getattr(args, k)
        for k in ("duration", "repeat", "warmup", "sessions", "loads", "workloads")
    }
    params |= {
        k: getattr(args, k)
        for k in (
            "clients",
            "max_new_tokens",
            "torch_threads",
            "max_block_ms",
            "writer",
            "compare_thread",
            "merge_batches",
            "compare_merge",
            "wake_delay_ms",
            "compare_wake_ms",
            "writer_nice",
            "compare_nice",
            "compare_judging",
            "gc_freeze",
            "switch_interval_ms",
        )
    }
    if args.sessions < 1:
        raise SystemExit(f"--sessions must be at least 1, not {args.sessions}")
    gpt2 = {"layers": 4, "hidden": 192, "heads": 12}  # the server's default GPT-2
    params["gpt2"] = gpt2
    data = Path(tempfile.mkdtemp(prefix="serve-load-"))
    # "on": the capture measured against the targets, chDB's inserts where
    # --writer puts them; "on_thread" (--compare-thread 1): the other choice,
    # chDB in the server's own threads, at saturation only.
    saturation_modes = ["off", "on"]
    if args.compare_thread and args.writer != "thread":
        saturation_modes.append("on_thread")
    # "on_nomerge" (--compare-merge 1): "on" with each captured batch handed
    # on alone, in every phase (what the merge buys, interleaved).
    if args.compare_merge:
        saturation_modes.append("on_nomerge")
    # "on_wake" (--compare-wake-ms N): "on" with the loop polling every N ms.
    if args.compare_wake_ms:
        saturation_modes.append("on_wake")
    # "on_nice" (--compare-nice N): "on" with the writer process N steps nicer.
    if args.compare_nice:
        if args.writer != "process":
            raise SystemExit("--compare-nice needs --writer process (a writer to renice)")
        saturation_modes.append("on_nice")
    # "on_wall" (--compare-judging 1): "on" with processor calls in worker
    # threads judged by wall time whenever they waited (the judgement before
    # THREAD_WAIT_S), in every phase.
    if args.compare_judging:
        saturation_modes.append("on_wall")
    extra_labels = {
        "on_nomerge": "each captured batch alone (merge off)",
        "on_wake": f"loop polling every {args.compare_wake_ms:g} ms",
        "on_nice": f"writer process at nice {args.compare_nice}",
        "on_wall": "thread calls judged by wall time (before THREAD_WAIT_S)",
    }
    extra_modes = ("on_nomerge", "on_wake", "on_nice", "on_wall")
    load_modes = ["off", "on"] + [m for m in extra_modes if m in saturation_modes]

    def start_servers(session: int) -> dict[str, Server]:
        servers = {
            mode: Server(
                mode != "off",
                data / f"{mode}.{session}",
                args.torch_threads,
                args.max_block_ms,
                data / f"{mode}.{session}.log",
                writer="thread" if mode == "on_thread" else args.writer,
                merge_batches=bool(args.merge_batches) and mode != "on_nomerge",
                wake_delay_ms=args.compare_wake_ms if mode == "on_wake" else args.wake_delay_ms,
                writer_nice=args.compare_nice if mode == "on_nice" else args.writer_nice,
                judge_thread_calls="wall" if mode == "on_wall" else "cpu",
                gc_freeze=bool(args.gc_freeze),
                switch_interval_ms=args.switch_interval_ms,
            )
            for mode in saturation_modes
        }
        for server in servers.values():
            server.wait_ready()
        return servers

    # Every phase's figures, tagged with its server session and whether it was
    # a warm-up round (warm-ups are kept in the raw results, never summarised).
    phases: dict[str, list[dict[str, Any]]] = {}
    sent = {"embed_inputs": 0, "embed_requests": 0, "gpt2_rows": 0, "generate_requests": 0}
    comparisons, targets, tables, notes = [], [], [], []
    # Samples pooled over the sessions: {phase name: {mode: [samples]}}.
    pooled: dict[str, dict[str, list[float]]] = {}
    capacities: dict[str, list[float]] = {}
    reports: list[dict[str, Any]] = []
    state: dict[str, Any] = {"session": 0, "warm": False, "servers": {}, "shed": {}}

    def measure(name: str, mode: str, work: Workload, rate: float | None, key: str) -> float:
        server = state["servers"][mode]
        phase = asyncio.run(
            run_phase(server, work, rate=rate, clients=args.clients, duration=args.duration)
        )
        if mode != "off":
            phase.shed = phase.shed_total - state["shed"].get(mode, 0)
            state["shed"][mode] = phase.shed_total
        figures = phase.figures()
        figures["session"] = state["session"]
        figures["warmup"] = not state["warm"]
        phases.setdefault(f"{name}/{mode}", []).append(figures)
        if mode == "on":
            if work.name == "embed":
                sent["embed_inputs"] += phase.inputs
                sent["embed_requests"] += phase.ok
            else:
                sent["gpt2_rows"] += phase.inputs
                sent["generate_requests"] += phase.ok
        return float(figures[key])

    def warmed() -> None:
        state["warm"] = True

    def run_interleaved(
        name: str, modes: list[str], work: Workload, rate: float | None, key: str
    ) -> dict[str, dict[str, Any]]:
        state["warm"] = False
        result = harness.interleave(
            {mode: functools.partial(measure, name, mode, work, rate, key) for mode in modes},
            repeat=args.repeat,
            warmup=args.warmup,
            seed=state["session"],
            after_warmup=warmed,
        )
        into = pooled.setdefault(name, {})
        for mode, figures in result.items():
            into.setdefault(mode, []).extend(figures["samples"])
        return result

    # Each session starts fresh server processes and measures every phase in
    # them: one process's luck (where its threads land, its allocator, its
    # chDB) is as large as the effects measured, so the figures are pooled
    # over more than one process per variant.
    for session in range(args.sessions):
        state["session"] = session
        state["shed"] = {}
        state["servers"] = start_servers(session)
        try:
            for workload in args.workloads:
                work = Workload(workload, args.max_new_tokens)
                saturation = run_interleaved(
                    f"{workload}/saturation", saturation_modes, work, None, "requests_per_s"
                )
                # Each session's fixed loads are fractions of its own capacity.
                capacity = saturation["off"]["median"]
                capacities.setdefault(workload, []).append(capacity)
                for load in args.loads:
                    run_interleaved(
                        f"{workload}/load{int(load * 100)}",
                        load_modes,
                        work,
                        load * capacity,
                        "p99_ms",
                    )
            reports.append(flush_report(state["servers"]["on"]))
        finally:
            for server in state["servers"].values():
                server.stop()

    def kept(key: str, field: str) -> list[float]:
        return [p[field] for p in phases.get(key, []) if not p["warmup"]]

    for workload in args.workloads:
        saturation = {m: harness.summary(v) for m, v in pooled[f"{workload}/saturation"].items()}
        capacity = saturation["off"]["median"]
        persisted = harness.summary(kept(f"{workload}/saturation/on", "requests_per_s_persisted"))
        comparisons.append(
            harness.comparison(
                f"{workload}: throughput at saturation ({args.clients} clients)",
                persisted,
                saturation["off"],
                taproute_label=f"capture on (to ClickHouse, writer {args.writer})",
                peer_label="capture off",
                unit="requests/s",
            )
        )
        if "on_thread" in saturation:
            comparisons.append(
                harness.comparison(
                    f"{workload}: throughput at saturation, chDB in the server's threads "
                    "(writer = thread)",
                    harness.summary(
                        kept(f"{workload}/saturation/on_thread", "requests_per_s_persisted")
                    ),
                    saturation["off"],
                    taproute_label="capture on, writer thread",
                    peer_label="capture off",
                    unit="requests/s",
                )
            )
        for mode, label in extra_labels.items():
            if mode in saturation:
                comparisons.append(
                    harness.comparison(
                        f"{workload}: throughput at saturation, {label}",
                        harness.summary(
                            kept(f"{workload}/saturation/{mode}", "requests_per_s_persisted")
                        ),
                        saturation["off"],
                        taproute_label=f"capture on, {label}",
                        peer_label="capture off",
                        unit="requests/s",
                    )
                )
        # What capture costs in CPU, whatever the cores' sharing did to the
        # request rates: the server's CPU (its writer process included) per
        # request, at saturation and at half load.
        for phase, label in (("saturation", "at saturation"), ("load50", "at 50% load")):
            cpu = {
                mode: kept(f"{workload}/{phase}/{mode}", "server_cpu_ms_per_request")
                for mode in ("on", "off")
            }
            if cpu["on"] and cpu["off"]:
                comparisons.append(
                    harness.comparison(
                        f"{workload}: server CPU per request {label} (writer process included)",
                        harness.summary(cpu["on"]),
                        harness.summary(cpu["off"]),
                        taproute_label="capture on",
                        peer_label="capture off",
                        unit="ms of CPU per request",
                        higher_is_better=False,
                    )
                )
        ratio = persisted["median"] / capacity
        targets.append(
            harness.target(
                f"{workload}: throughput at saturation with capture >= 0.95x",
                ratio >= 0.95,
                f"{ratio:.3f}x ({harness.fmt(persisted['median'])} vs "
                f"{harness.fmt(capacity)} requests/s, on counted until flushed; "
                f"{args.sessions} server process(es) per variant)",
            )
        )
        for load in args.loads:
            name = f"{workload}/load{int(load * 100)}"
            p99 = {m: harness.summary(v) for m, v in pooled[name].items()}
            rates = ", ".join(harness.fmt(load * c) for c in capacities[workload])
            comparisons.append(
                harness.comparison(
                    f"{workload}: p99 latency at {int(load * 100)}% of capacity "
                    f"({rates} requests/s, open loop)",
                    p99["on"],
                    p99["off"],
                    taproute_label="capture on",
                    peer_label="capture off",
                    unit="ms",
                    higher_is_better=False,
                )
            )
            for mode, label in extra_labels.items():
                if mode in p99:
                    comparisons.append(
                        harness.comparison(
                            f"{workload}: p99 latency at {int(load * 100)}% of capacity, {label}",
                            p99[mode],
                            p99["off"],
                            taproute_label=f"capture on, {label}",
                            peer_label="capture off",
                            unit="ms",
                            higher_is_better=False,
                        )
                    )
            if load in (0.5, 0.8):
                r = p99["on"]["median"] / p99["off"]["median"]
                targets.append(
                    harness.target(
                        f"{workload}: p99 at {int(load * 100)}% load with capture <= 1.10x",
                        r <= 1.10,
                        f"{r:.3f}x ({p99['on']['median']:.1f} vs {p99['off']['median']:.1f} ms)",
                    )
                )
    report = _report_totals(reports)
    # Exact accounting: what the clients sent to the on-servers -> rows expected,
    # less what capture shed (by hook, counted by the servers) past max_block.
    layers = gpt2["layers"]
    dropped = report["dropped"]

    def lost(test: Any) -> int:
        return sum(n for hook, why in dropped.items() if test(hook) for n in why.values())

    queries = ("attention.self.query", "attn.c_attn")
    summary_hooks = ("minilm.encoder.layer.5.output", f"gpt2.transformer.h.{layers - 1}")
    expected = {
        "raw": 2 * sent["embed_inputs"]
        + layers * sent["gpt2_rows"]
        - lost(lambda h: not h.endswith(queries)),
        "head_norms": 2 * sent["embed_inputs"]
        + layers * sent["gpt2_rows"]
        - lost(lambda h: h.endswith(queries)),
        "summary": sent["embed_requests"] + sent["generate_requests"],
    }
    # A request's summary row comes when its id is completed, if any of its
    # summary-hook records got through: a shed record may take one row with it
    # (records are shed per hook, not per request), never more.
    summary_shed = lost(lambda h: h in summary_hooks)
    found = report["clickhouse_rows"]
    exact = {k: v for k, v in found.items() if k != "summary"} == {
        k: v for k, v in expected.items() if k != "summary"
    }
    summary_found = found.get("summary", -1)
    summary_ok = expected["summary"] - summary_shed <= summary_found <= expected["summary"]
    targets.append(
        harness.target(
            "every captured record in ClickHouse, counted exactly",
            exact and summary_ok and report["failure"] is None,
            f"rows {found} vs expected from the requests sent less records shed {expected}"
            + (
                f" (summary: at least {expected['summary'] - summary_shed})" if summary_shed else ""
            ),
        )
    )
    loaded = [
        (key, r["shed"])
        for key, runs in phases.items()
        if "/load" in key and key.endswith("/on")
        for r in runs
    ]
    targets.append(
        harness.target(
            "no record shed at <= 80% load",
            all(n == 0 for _, n in loaded),
            f"{sum(n for _, n in loaded)} shed in the fixed-load phases, "
            f"{report['shed']} in the whole run (max_block "
            f"{params['max_block_ms']} ms); model threads blocked "
            f"{report['blocked_seconds']:.3f} s in all",
        )
    )
    columns = [
        "phase",
        "mode",
        "req/s",
        "tokens/s",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "cores",
        "CPU ms/request",
        "RSS MiB",
        "shed",
    ]
    rows = []
    for key, runs in phases.items():
        name, mode = key.rsplit("/", 1)
        measured = [r for r in runs if not r["warmup"]] or runs
        med = {
            f: harness.summary([r[f] for r in measured])["median"]
            for f in measured[0]
            if f not in ("session", "warmup")
        }
        rows.append(
            [
                name,
                mode,
                round(med["requests_per_s"], 1),
                round(med["tokens_per_s"], 1),
                round(med["p50_ms"], 2),
                round(med["p95_ms"], 2),
                round(med["p99_ms"], 2),
                round(med["server_cores_busy"], 2),
                round(med["server_cpu_ms_per_request"], 2),
                round(med["server_rss_mib"], 1),
                sum(r["shed"] for r in measured),
            ]
        )
    tables.append(
        {
            "title": f"Per phase (medians over repetitions and {args.sessions} server session(s))",
            "columns": columns,
            "rows": rows,
        }
    )
    if args.sessions > 1:
        # What each server process measured on its own: how far apart the
        # processes are is the noise floor any A/B here has to clear.
        per_session = []
        for workload in args.workloads:
            for session in range(args.sessions):
                off = [
                    p["requests_per_s"]
                    for p in phases[f"{workload}/saturation/off"]
                    if p["session"] == session and not p["warmup"]
                ]
                on = [
                    p["requests_per_s_persisted"]
                    for p in phases[f"{workload}/saturation/on"]
                    if p["session"] == session and not p["warmup"]
                ]
                off_med = harness.summary(off)["median"]
                on_med = harness.summary(on)["median"]
                per_session.append(
                    [
                        workload,
                        session,
                        round(off_med, 1),
                        round(on_med, 1),
                        round(on_med / off_med, 3),
                    ]
                )
        tables.append(
            {
                "title": "Saturation per server session (fresh processes each session)",
                "columns": ["workload", "session", "off req/s", "on req/s (persisted)", "on / off"],
                "rows": per_session,
            }
        )
    notes.append(
        f"Records captured (taproute ingress, done markers included): {report['submitted']}; "
        f"ClickHouse rows after the run: {found}."
    )
    harness.write_result(
        "serve_load",
        title="taproute inside an inference server, under load",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
        params=params,
        quick=args.quick,
        comparisons=comparisons,
        tables=tables,
        targets=targets,
        notes=notes,
        raw={"phases": phases, "flush_report": report, "sent": sent, "expected_rows": expected},
    )


if __name__ == "__main__":
    main()
