import numpy as np
import numpy.typing as npt

def scatter_add(
    slots: npt.NDArray[np.float64],
    keys: npt.NDArray[np.int64],
    values: npt.NDArray[np.float32] | npt.NDArray[np.float64],
) -> None: ...
