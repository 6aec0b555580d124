"""Arguments a user easily gets wrong at construction are refused naming what
and where: a sink class or factory where the runtime takes a sink, a path and
a schema in the wrong order; one layout's name alone is that layout."""

from __future__ import annotations

import pytest

from taproute.routing import Layout, RecordSchema
from taproute.service import CaptureSink, create_record_runtime

SCHEMA = RecordSchema(
    [Layout("acts", [("values", "Array(Float32)")]), Layout("norm", [("key", "Int64")])]
)


@pytest.mark.parametrize(
    ("record_sink", "hint"),
    [
        (CaptureSink, r"the class itself; give an instance: CaptureSink\(\.\.\.\)"),
        (lambda: CaptureSink(), "a factory is taken only as a RoutingSink destination"),
        (object(), "found object"),
    ],
)
def test_the_runtime_takes_a_sink_instance_and_says_so(record_sink, hint):
    with pytest.raises(TypeError, match=f"record_sink: expected a RecordSink instance.*{hint}"):
        create_record_runtime(record_sink=record_sink, schema=SCHEMA)
