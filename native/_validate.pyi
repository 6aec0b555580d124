import numpy as np
import numpy.typing as npt

OK: int
UNBOUND_OUTPUT_ID: int
RANGE_OUTSIDE_BUFFER: int
UNKNOWN_LAYOUT: int
LENGTH_MISMATCH: int
NOT_A_PAYLOAD_LAYOUT: int

def check_descriptors(
    descriptors: npt.NDArray[np.void],
    payload_size: int,
    bound_ids: int,
    fixed_size: npt.NDArray[np.int64],
    tail_prefix: npt.NDArray[np.int64],
    tail_element: npt.NDArray[np.int64],
) -> tuple[int, int, int]: ...
def back_to_back(descriptors: npt.NDArray[np.void], stride: int) -> bool: ...
