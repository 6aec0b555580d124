from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

UNMATCHED: int
MAX_OUTPUT_IDS: int

class RouteTable:
    n_routes: int
    def __init__(self, n_routes: int) -> None: ...
    def assign(self, output_id: int, routes: Iterable[int]) -> None: ...
    def routes_of(self, output_id: int) -> tuple[int, ...]: ...
    def group(
        self, descriptors: npt.NDArray[np.void]
    ) -> list[tuple[int, npt.NDArray[np.intp] | None]]: ...
