"""The C view of DESCRIPTOR_DTYPE (native/descriptor.py); keep the two in step."""

from libc.stdint cimport int64_t, uint16_t, uint32_t


cdef packed struct Descriptor:
    uint32_t output_id
    uint16_t layout_id
    uint16_t flags
    int64_t key
    int64_t step
    int64_t seq
    int64_t timestamp_ns
    int64_t offset
    int64_t length
