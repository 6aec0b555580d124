"""/metrics, /status and /healthz over a real socket on 127.0.0.1."""

from __future__ import annotations

import errno
import json
import socket
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from taproute.actors import RoutingSink
from taproute.routing import Route, RoutingConfig, RoutingFailure
from taproute.service import HttpConfig, create_record_runtime
from tests.processors import SCHEMA
from tests.sinks import FailingSink, NullSink


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_metrics_status_and_health_over_http():
    sink = RoutingSink(
        RoutingConfig(
            [
                Route("raw", "layers.*", "cap"),
                Route("norms", "layers.*", "cap", mode="stateless", processor="test.norms"),
            ]
        ),
        SCHEMA,
        {"cap": NullSink()},
        unmatched="drop",
    )
    with create_record_runtime(record_sink=sink, http=HttpConfig(port=0)) as runtime:
        (url,) = runtime.http_urls
        assert url.startswith("http://127.0.0.1:")
        q = runtime.bind_hook("layers.0.q", layout="vec")
        for i in range(10):
            runtime.submit(q, np.full(4, i, np.float32))
        runtime.flush()

        status, body = get(f"{url}/metrics")
        assert status == 200
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body)
            for s in family.samples
        }
        labels = (("destination", "cap"), ("mode", "forward"), ("route", "raw"))
        assert samples[("taproute_route_processed_records_total", labels)] == 10
        assert samples[("taproute_destination_sent_records_total", (("destination", "cap"),))] == 20
        assert samples[("taproute_ingress_submitted_records_total", ())] == 10
        assert samples[("taproute_failure_latched", ())] == 0

        status, body = get(f"{url}/status")
        assert status == 200
        snapshot = json.loads(body)
        assert snapshot["routes"]["norms"]["processed"] == 10
        assert snapshot["ingress"]["submitted"] == 10 and snapshot["failure"] is None

        assert get(f"{url}/healthz") == (200, '{"status":"ok"}')
        assert get(f"{url}/nope")[0] == 404
    # The server stopped with the runtime.
    status = None
    try:
        urllib.request.urlopen(f"{url}/healthz", timeout=2)
    except OSError as error:
        status = error
    assert status is not None


def test_failures_are_exported_by_code():
    from taproute.routing import FailurePolicy

    sink = RoutingSink(
        RoutingConfig(
            [
                Route(
                    "boom",
                    "*",
                    "cap",
                    mode="stateless",
                    processor="test.raises",
                    failure_policy=FailurePolicy(max_failures=1, failure_window=0),
                )
            ]
        ),
        SCHEMA,
        {"cap": NullSink()},
        unmatched="drop",
    )
    with create_record_runtime(record_sink=sink, http=HttpConfig(port=0)) as runtime:
        (url,) = runtime.http_urls
        q = runtime.bind_hook("x", layout="vec")
        runtime.submit(q, np.zeros(4, np.float32))
        runtime.flush()
        _, body = get(f"{url}/metrics")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }
    labels = (
        ("code", "handler_panic"),
        ("destination", "cap"),
        ("mode", "stateless"),
        ("route", "boom"),
    )
    assert samples[("taproute_route_failures_total", labels)] == 1
    assert samples[("taproute_route_failed_records_total", labels[1:])] == 1


def test_healthz_reports_a_latched_failure():
    sink = RoutingSink(
        RoutingConfig([Route("raw", "*", "bad")]),
        SCHEMA,
        {"bad": FailingSink(fail_on=1, message="disk full")},
        unmatched="drop",
    )
    runtime = create_record_runtime(record_sink=sink, http=HttpConfig(port=0))
    (url,) = runtime.http_urls
    q = runtime.bind_hook("x", layout="vec")
    runtime.submit(q, np.zeros(4, np.float32))
    with pytest.raises(RoutingFailure):
        runtime.flush()
    status, body = get(f"{url}/healthz")
    assert status == 503
    assert json.loads(body)["failure"].endswith("OSError: disk full")
    with pytest.raises(RoutingFailure):
        runtime.close()


def test_an_address_in_use_is_an_error_naming_it():
    """Hypercorn's own error was a bare ``[Errno 98] Address already in use``."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = {t for t in threading.enumerate() if not t.name.startswith("Trio thread ")}
        with pytest.raises(OSError) as caught:
            create_record_runtime(record_sink=NullSink(), http=HttpConfig(port=port))
    assert caught.value.errno == errno.EADDRINUSE
    assert f"HTTP endpoint: cannot listen on 127.0.0.1:{port}: " in str(caught.value)
    after = {t for t in threading.enumerate() if not t.name.startswith("Trio thread ")}
    assert after <= before  # the runtime's loop thread is gone too


@pytest.mark.parametrize("host", ["", "  "])
def test_an_empty_http_host_is_refused_not_taken_as_every_interface(host):
    from taproute.routing import ConfigError

    with pytest.raises(ConfigError, match=r"must name an address .*0\.0\.0\.0.*got"):
        HttpConfig(host=host)
    assert HttpConfig(host="0.0.0.0").host == "0.0.0.0"  # every interface, said so


@pytest.mark.parametrize("token", ["", "two words", "caf\u00e9", "tab\there", 5])
def test_a_token_no_header_can_carry_is_refused_without_echoing_it(token):
    """An empty token was accepted in Python (the config file refused it):
    every mutating request then answered 401, as if the caller's were wrong."""
    from taproute.routing import ConfigError

    with pytest.raises(
        ConfigError, match="HttpConfig token: expected None or printable ASCII"
    ) as e:
        HttpConfig(token=token)
    assert not token or str(token) not in str(e.value)
    assert HttpConfig(token="s3cret-token").token == "s3cret-token"


@pytest.mark.parametrize(
    ("field", "value"),
    [("port", True), ("port", 1.5), ("port", "9464"), ("port", -1), ("max_body_bytes", 2.5)],
)
def test_an_http_number_of_the_wrong_kind_is_refused_naming_it(field, value):
    """HttpConfig(port=True) started and failed at the socket with "Name or
    service not known", port=1.5 with TypeError "'float' object cannot be
    interpreted as an integer", port="9464" with a bare comparison TypeError:
    none named the field. A config file already refused them when read."""
    from taproute.routing import ConfigError

    message = rf"HttpConfig {field} must be an int in \[.*got {value!r}"
    with pytest.raises(ConfigError, match=message):
        HttpConfig(**{field: value})
