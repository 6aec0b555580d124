"""taproute's hot path: Cython and numpy pieces with no dependency on the rest.

- :data:`DESCRIPTOR_DTYPE`, :func:`make_descriptors`: the record descriptor.
- :class:`RouteTable`: output_id -> route set, one-pass grouping of a batch.
- :func:`partition_keys`: key -> owner partitioning of a stateful route.
- :func:`check_descriptors` (and its verdict codes): one-pass batch validation.
- :class:`BufferLease`: lease counting of shared read-only record buffers;
  :class:`PartsLease`: a merged batch's, each part holding only its own buffers.
- :class:`RootTable`: the causal limits' per-root table (pinned limits, count
  per minute), admitting a batch of derived records in one C loop.
- :class:`StateRegion`, :func:`scatter_add`: the K x N state array of a
  stateful route and its GIL-free batch update.
- :func:`capture_records`: a capture hook's packed payload (into a pooled
  buffer or a fresh one) and its stamped descriptors in one call;
  :func:`stamped_copy`, :func:`gather_ranges` / :func:`gather_address`: the
  two parts, one call each; :func:`untrack_acyclic`, :class:`GiveBack`: a
  hook's batch and its release kept out of the cyclic garbage collector;
  :func:`plan_records`: a capture's record plan and descriptor templates.
- :func:`router_stats`, :func:`path_codes`, :func:`two_nearest` (and
  :func:`two_nearest_f32`): the signal
  processors' one-pass kernels (router statistics, top-1 expert paths, the
  two nearest neighbours off a Gram matrix).
"""

from taproute.native._capture import (
    GiveBack,
    capture_records,
    gather_address,
    gather_ranges,
    plan_records,
    stamped_copy,
    untrack_acyclic,
)
from taproute.native._lease import BufferLease, LeaseError, PartsLease
from taproute.native._matcher import UNMATCHED, RouteTable
from taproute.native._partition import owner_of, partition_keys
from taproute.native._roots import RootTable
from taproute.native._roots import root_ids as native_root_ids
from taproute.native._signals import path_codes, router_stats, two_nearest, two_nearest_f32
from taproute.native._state import scatter_add
from taproute.native._validate import (
    NOT_A_PAYLOAD_LAYOUT,
    OK,
    RANGE_OUTSIDE_BUFFER,
    UNBOUND_OUTPUT_ID,
    UNKNOWN_LAYOUT,
    back_to_back,
    check_descriptors,
)
from taproute.native.descriptor import (
    DESCRIPTOR_DTYPE,
    FIELD_BOUNDS,
    DescriptorFieldError,
    check_field,
    check_int64,
    make_descriptors,
)
from taproute.native.state import StateRegion

__all__ = [
    "DESCRIPTOR_DTYPE",
    "FIELD_BOUNDS",
    "NOT_A_PAYLOAD_LAYOUT",
    "OK",
    "RANGE_OUTSIDE_BUFFER",
    "UNBOUND_OUTPUT_ID",
    "UNKNOWN_LAYOUT",
    "UNMATCHED",
    "BufferLease",
    "DescriptorFieldError",
    "GiveBack",
    "LeaseError",
    "PartsLease",
    "RootTable",
    "native_root_ids",
    "RouteTable",
    "StateRegion",
    "back_to_back",
    "capture_records",
    "check_descriptors",
    "check_field",
    "check_int64",
    "gather_address",
    "gather_ranges",
    "make_descriptors",
    "owner_of",
    "partition_keys",
    "path_codes",
    "plan_records",
    "router_stats",
    "scatter_add",
    "stamped_copy",
    "two_nearest",
    "untrack_acyclic",
    "two_nearest_f32",
]
