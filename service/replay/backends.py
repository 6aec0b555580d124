"""Where units are processed: in this process, in a process pool, or on Ray.

Every backend runs the same :class:`~taproute.service.replay.jobs.UnitJob`;
the driver reads units, hands them over, and gets
:class:`~taproute.service.replay.jobs.UnitOutcome` back.  The driver alone
reads the corpus and writes the lanes, so chDB's one-process-per-directory
rule holds whatever the backend, and the driver alone owns the ledger.

``submit(worker, unit_id, table)`` hands a unit to one worker (``static``
schedule: the driver keeps each worker's fixed bag) or, with ``worker=None``,
to whichever worker takes it first (``pull``: a shared queue).
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import queue
from typing import Any, Literal, Protocol

import pyarrow as pa

from taproute.service.replay.errors import ReplayConfigError, WorkerLost
from taproute.service.replay.jobs import JobSpec, UnitJob, UnitOutcome

BackendName = Literal["inprocess", "processes", "ray"]
Schedule = Literal["static", "pull"]


class Backend(Protocol):
    """A place where units run."""

    workers: int

    def submit(self, worker: int | None, unit_id: str, table: pa.Table) -> None: ...

    def next_outcome(self) -> tuple[int, UnitOutcome]:
        """Block until a unit finishes: (worker, outcome)."""
        ...

    def close(self) -> None: ...


class InProcess:
    """One worker: this process, units run as they are submitted."""

    workers = 1

    def __init__(self, job: JobSpec) -> None:
        self.job = UnitJob(job)
        self._done: list[UnitOutcome] = []

    def submit(self, worker: int | None, unit_id: str, table: pa.Table) -> None:
        self._done.append(self.job.run(unit_id, table))

    def next_outcome(self) -> tuple[int, UnitOutcome]:
        return 0, self._done.pop(0)

    def close(self) -> None:
        pass


#: How often an idle pool worker checks that its driver still lives.
_DRIVER_CHECK_SECONDS = 1.0


def _worker_main(job: JobSpec, worker: int, inbox: Any, outbox: Any) -> None:
    """A pool process: build the job, then run units until told to stop."""
    try:
        unit_job = UnitJob(job, worker=worker)
    except BaseException as exc:
        outbox.put((worker, None, f"worker {worker} could not start: {type(exc).__name__}: {exc}"))
        return
    driver = mp.parent_process()
    while True:
        try:
            item = inbox.get(timeout=_DRIVER_CHECK_SECONDS)
        except queue.Empty:
            # A driver killed (SIGKILL, OOM) never sends the stop: without this a
            # worker waited on its inbox forever, orphaned, holding its processor.
            if driver is not None and not driver.is_alive():
                return
            continue
        if item is None:
            return
        unit_id, table = item
        outbox.put((worker, unit_job.run(unit_id, table), None))


class Processes:
    """``workers`` processes (spawned: fresh interpreters, nothing inherited
    but the job spec), each with its own inbox (static) or one shared inbox
    (pull); results come back on one queue."""

    def __init__(self, job: JobSpec, workers: int, schedule: Schedule) -> None:
        self.workers = workers
        context = mp.get_context("spawn")
        self._outbox: Any = context.Queue()
        shared = context.Queue() if schedule == "pull" else None
        self._inboxes: list[Any] = [shared or context.Queue() for _ in range(workers)]
        self._shared = shared
        self._procs = [
            context.Process(
                target=_worker_main,
                args=(job, w, self._inboxes[w], self._outbox),
                name=f"taproute-replay-{w}",
                daemon=True,
            )
            for w in range(workers)
        ]
        for proc in self._procs:
            proc.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def submit(self, worker: int | None, unit_id: str, table: pa.Table) -> None:
        inbox = self._shared if worker is None else self._inboxes[worker]
        assert inbox is not None
        inbox.put((unit_id, table))

    def next_outcome(self) -> tuple[int, UnitOutcome]:
        while True:
            try:
                worker, outcome, error = self._outbox.get(timeout=0.5)
            except queue.Empty:
                for w, proc in enumerate(self._procs):
                    if not proc.is_alive():
                        raise WorkerLost(
                            f"replay worker {w} (pid {proc.pid}) exited with code "
                            f"{proc.exitcode}; finished units are in the ledger, resume the run"
                        ) from None
                continue
            if error is not None:
                raise ReplayConfigError(error)
            return worker, outcome

    def close(self) -> None:
        for inbox in {id(i): i for i in self._inboxes}.values():
            for _ in range(self.workers):
                inbox.put(None)
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()


class RayWorkers:
    """``workers`` Ray actors; units travel through Ray's object store as
    Arrow tables.  Uses the running Ray (``ray.init`` done by the caller) or
    starts a local one with ``workers`` CPUs."""

    def __init__(self, job: JobSpec, workers: int, schedule: Schedule) -> None:
        try:
            ray: Any = importlib.import_module("ray")  # an optional extra: taproute[ray]
        except ImportError:
            raise ReplayConfigError(
                "backend 'ray' needs Ray: pip install 'taproute[ray]'"
            ) from None
        self._ray = ray
        self._started = False
        if not ray.is_initialized():
            ray.init(
                num_cpus=workers,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
            self._started = True
        self.workers = workers
        remote = ray.remote(num_cpus=1)(_RayWorker)
        self._actors = [remote.remote(job, w) for w in range(workers)]
        self._refs: dict[Any, int] = {}
        self._next = 0
        self._busy = [0] * workers
        self._pull = schedule == "pull"

    def submit(self, worker: int | None, unit_id: str, table: pa.Table) -> None:
        if worker is None:  # pull: the least busy actor takes it
            worker = min(range(self.workers), key=lambda w: self._busy[w])
        ref = self._actors[worker].run.remote(unit_id, self._ray.put(table))
        self._refs[ref] = worker
        self._busy[worker] += 1

    def next_outcome(self) -> tuple[int, UnitOutcome]:
        ready, _ = self._ray.wait(list(self._refs), num_returns=1)
        worker = self._refs.pop(ready[0])
        self._busy[worker] -= 1
        try:
            outcome: UnitOutcome = self._ray.get(ready[0])
        except self._ray.exceptions.RayActorError as exc:
            raise WorkerLost(f"Ray replay worker {worker} died: {exc}") from None
        return worker, outcome

    def close(self) -> None:
        for actor in self._actors:
            self._ray.kill(actor)
        if self._started:
            self._ray.shutdown()


class _RayWorker:
    """The actor body: one UnitJob."""

    def __init__(self, job: JobSpec, worker: int) -> None:
        self.job = UnitJob(job, worker=worker)

    def run(self, unit_id: str, table: pa.Table) -> UnitOutcome:
        return self.job.run(unit_id, table)


def open_backend(name: BackendName, job: JobSpec, workers: int, schedule: Schedule) -> Backend:
    """The backend ``name`` with ``workers`` workers."""
    if name == "inprocess":
        if workers != 1:
            raise ReplayConfigError(f"backend 'inprocess' has one worker, got workers={workers}")
        return InProcess(job)
    if name == "processes":
        return Processes(job, workers, schedule)
    if name == "ray":
        return RayWorkers(job, workers, schedule)
    raise ReplayConfigError(f"unknown backend {name!r}; expected one of inprocess, processes, ray")
