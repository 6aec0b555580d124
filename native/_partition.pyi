import numpy as np
import numpy.typing as npt

def owner_of(key: int, key_range: int, n_owners: int) -> int: ...
def partition_keys(
    keys: npt.NDArray[np.int64], key_range: int, n_owners: int
) -> tuple[list[npt.NDArray[np.intp] | None], npt.NDArray[np.intp] | None]: ...
