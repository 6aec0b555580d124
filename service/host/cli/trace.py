"""``taproute trace``: where a record of a hook would go, and why (a dry run),
against a config file or a running service (``--url``: its ``POST /trace``,
which also returns the service's recent unmatched records of the hook).

A config file is traced as a *candidate*: built and checked, never applied,
nothing opened or created; ``--samples`` traces each sample record its
routes' processors and predicates offer.  Every trace says which
configuration it traced (a candidate, or the running generation's number)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import attrs

from taproute.routing.errors import RecordError, UnknownLayout
from taproute.routing.routes import DERIVED_PREFIX
from taproute.service.host.cli.errors import BAD_INPUT, CommandError
from taproute.service.host.config import load_config


def trace(path: Path, hook: str, fields: dict[str, int], *, layout: str | None = None) -> int:
    """Print where a record of ``hook`` would go, and why (a dry run).

    The hook is bound as the process running this config would bind it (with
    ``layout``, else the layout its ``[producer]`` entry gives); a record the
    router would refuse (with ``length``: a payload size the layout does not
    allow) is refused here too, with submission's own message.
    """
    config = load_config(path)
    if layout is None:
        layout = next((h.layout for h in config.producer.hooks if h.name == hook), None)
    sink = config.candidate_sink()
    try:
        if not hook.startswith(DERIVED_PREFIX):  # derived hooks are the router's own
            sink.bind_hook(hook, layout=layout)
        traced = sink.trace(hook, layout=layout, **fields)
    except (UnknownLayout, RecordError) as exc:
        # What the command line asked for (a --layout the file does not
        # have, a record the router would refuse): bad input, as the same
        # trace asked of a running service answers (HTTP 400, exit 2).
        raise CommandError(f"trace refused: {exc}", BAD_INPUT) from None
    result = attrs.evolve(traced, generation="candidate")
    _print(hook, fields, attrs.asdict(result), f"candidate configuration {path} (not applied)")
    return 0


def trace_samples(path: Path) -> int:
    """Trace every sample record the config's routes offer (their processors'
    and predicates' samplers), as a candidate; 1 if a sampler failed."""
    config = load_config(path)
    sink = config.candidate_sink()
    for hook in config.producer.hooks:
        sink.bind_hook(hook.name, layout=hook.layout)
    traced = sink.trace_samples(bind=True)
    for item in traced.samples:
        sample = item.sample
        fields = {"key": sample.key, "step": sample.step, "seq": sample.seq}
        print(
            f"sample {sample.name} (route {item.route}, {item.source}): {sample.hook} "
            + " ".join(
                f"{k}={v}" for k, v in {**fields, "timestamp_ns": sample.timestamp_ns}.items()
            )
        )
        if item.result is None:
            print(f"  refused: {item.refused}")
        else:
            _verdicts(sample.hook, attrs.asdict(item.result))
    for failed in traced.failed:
        print(f"sampler of route {failed.route} ({failed.source}) failed: {failed.error}")
    print(f"traced: candidate configuration {path} (not applied), {len(traced.samples)} sample(s)")
    return 1 if traced.failed else 0


def trace_remote(url: str, hook: str, fields: dict[str, int], *, layout: str | None = None) -> int:
    """The same, asked of a running service: its routes, its bound hooks, and the
    recent records of ``hook`` no route took, with each route's refusal."""
    body: dict[str, Any] = {"hook": hook, **fields}
    if layout is not None:
        body["layout"] = layout
    request = urllib.request.Request(
        f"{url.rstrip('/')}/trace",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            result = json.loads(response.read())
    except urllib.error.HTTPError as error:
        try:
            reason = json.loads(error.read())["error"]
        except (ValueError, KeyError, TypeError):
            reason = error.reason
        code = BAD_INPUT if error.code == 400 else 1  # the record itself would be refused
        raise CommandError(f"trace refused ({error.code}): {reason}", code) from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        raise CommandError(f"cannot reach {url}: {reason}") from None
    _print(hook, fields, result, f"generation {result.get('generation')} (running at {url})")
    return 0


def _print(hook: str, fields: dict[str, int], result: dict[str, Any], traced: str) -> None:
    print(f"trace {hook} {' '.join(f'{k}={v}' for k, v in fields.items())}".rstrip())
    _verdicts(hook, result)
    print(f"  traced: {traced}")


def _verdicts(hook: str, result: dict[str, Any]) -> None:
    for verdict in result["verdicts"]:
        reason = f"  ({verdict['reason']})" if verdict["reason"] else ""
        print(
            f"  {verdict['route']:<20} {verdict['verdict']:<12} -> {verdict['destination']}{reason}"
        )
    target = "dropped" if result["dropped"] else ", ".join(result["destinations"])
    print(f"  => {target}")
    if result.get("refusals"):
        print("  refused by: " + _refusals(result["refusals"]))
    recent = result.get("recent_unmatched") or []
    if recent:
        print(f"  recent unmatched records of {hook} ({len(recent)}, oldest first):")
        for sample in recent:
            why = _refusals(sample["refusals"]) or "no route's outputs match the hook"
            print(f"    key={sample['key']} step={sample['step']} seq={sample['seq']}: {why}")


def _refusals(refusals: list[dict[str, str]]) -> str:
    return "; ".join(f"{r['route']} ({r['reason']})" for r in refusals)
