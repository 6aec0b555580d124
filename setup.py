"""Build script: maps the four top-level folders into the ``taproute`` namespace
and compiles the Cython hot path in ``native/``.

Nothing is importable as a bare ``routing`` or ``service``: every folder is
installed under ``taproute.``.  Subpackages are found by walking the folders
(every directory with an ``__init__.py``), so a new one needs no edit here.
"""

from pathlib import Path

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

TOP_LEVEL = ("routing", "native", "actors", "service")


def _packages() -> dict[str, str]:
    """``taproute.<dotted path>`` -> folder, for every package under the four folders."""
    found = {}
    for top in TOP_LEVEL:
        for init in sorted(Path(top).rglob("__init__.py")):
            folder = init.parent.as_posix()
            found["taproute." + folder.replace("/", ".")] = folder
    return found


PACKAGES = _packages()

extensions = [
    Extension(
        f"taproute.native.{name}",
        [f"native/{name}.pyx"],
        include_dirs=[np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O3"],
    )
    for name in (
        "_matcher",
        "_partition",
        "_lease",
        "_validate",
        "_state",
        "_capture",
        "_roots",
        "_signals",
    )
]

setup(
    packages=list(PACKAGES),
    package_dir=PACKAGES,
    package_data={name: ["py.typed", "*.pyi", "*.pxi"] for name in PACKAGES},
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    ),
)
