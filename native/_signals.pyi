import numpy as np
import numpy.typing as npt

def router_stats(
    logits: npt.NDArray[np.float32] | npt.NDArray[np.float64],
    tokens: npt.NDArray[np.int64],
    top_k: int,
    capacity_factor: float,
) -> tuple[
    npt.NDArray[np.int64],
    npt.NDArray[np.float64],
    npt.NDArray[np.float64],
    npt.NDArray[np.float64],
    npt.NDArray[np.int64],
]: ...
def path_codes(
    logits: npt.NDArray[np.float32] | npt.NDArray[np.float64],
    tokens: npt.NDArray[np.int64],
    layers: int,
    experts: int,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
def two_nearest(
    gram: npt.NDArray[np.float64], sq: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]: ...
def two_nearest_f32(
    x: npt.NDArray[np.float32], gram: npt.NDArray[np.float32], slack: float
) -> npt.NDArray[np.float64]: ...
