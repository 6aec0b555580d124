"""Build script: maps the four top-level folders into the ``taproute`` namespace
and compiles the Cython hot path in ``native/``.

Nothing is importable as a bare ``routing`` or ``service``: every folder is
installed under ``taproute.``.
"""

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

PACKAGES = {
    "taproute.routing": "routing",
    "taproute.native": "native",
    "taproute.actors": "actors",
    "taproute.service": "service",
    "taproute.service.clickhouse": "service/clickhouse",
}

extensions = [
    Extension(
        f"taproute.native.{name}",
        [f"native/{name}.pyx"],
        include_dirs=[np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O3"],
    )
    for name in ("_matcher", "_partition", "_lease", "_validate", "_state")
]

setup(
    packages=list(PACKAGES),
    package_dir=PACKAGES,
    package_data={
        "taproute.native": ["*.pyi", "*.pxi", "py.typed"],
        "taproute.routing": ["py.typed"],
        "taproute.actors": ["py.typed"],
        "taproute.service": ["py.typed"],
        "taproute.service.clickhouse": ["py.typed"],
    },
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    ),
)
