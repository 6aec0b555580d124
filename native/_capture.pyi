from typing import Any

import numpy as np
import numpy.typing as npt

def stamped_copy(
    template: npt.NDArray[np.void],
    output_id: int,
    timestamp_ns: int,
    keys: npt.NDArray[np.int64] | None = None,
    step: int = 0,
) -> npt.NDArray[np.void]: ...
def gather_ranges(
    source: npt.NDArray[np.uint8],
    offsets: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    total: int,
) -> npt.NDArray[np.uint8]: ...
def gather_address(
    address: int,
    size: int,
    offsets: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    total: int,
) -> npt.NDArray[np.uint8]: ...
def plan_records(
    rows: int,
    row_bytes: int,
    per_token: int,
    positions: int,
    counts: npt.NDArray[np.int64] | None,
    starts: npt.NDArray[np.int64] | None,
    runs: bool,
    layout_id: int,
) -> tuple[
    npt.NDArray[np.int64],
    npt.NDArray[np.int64],
    int,
    npt.NDArray[np.void],
    npt.NDArray[np.void],
]: ...
def capture_records(
    address: int,
    size: int,
    offsets: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    total: int,
    into: npt.NDArray[np.uint8] | None,
    template: npt.NDArray[np.void],
    output_id: int,
    keys: npt.NDArray[np.int64],
    step: int,
) -> tuple[npt.NDArray[np.void], npt.NDArray[np.uint8]]: ...
def untrack_acyclic(*objects: object) -> None: ...

class GiveBack:
    def __init__(self, pool: Any, buffer: Any) -> None: ...
    def __call__(self) -> object: ...
