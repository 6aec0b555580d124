import numpy as np
import numpy.typing as npt

class RootTable:
    def __init__(self, capacity: int = 1024) -> None: ...
    def __len__(self) -> int: ...
    def entry(self, root: int) -> tuple[int, int, int] | None: ...
    def admit(
        self,
        roots: npt.NDArray[np.int64],
        depths: npt.NDArray[np.int32],
        minute: int,
        current: int,
        max_depths: npt.NDArray[np.int64],
        per_minutes: npt.NDArray[np.int64],
    ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
    def sweep(self, minute: int, current: int, retention: npt.NDArray[np.int64]) -> None: ...
