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
