"""moefold installs as one package, `moefold`, whose subpackages are this repository's folders.

The repository keeps the layout its users chose (`parallel/ dense/ moe/ ...` at the top); the
`package_dir` mapping below installs `parallel/` as `moefold.parallel`, `dense/` as
`moefold.dense`, and so on. `moefold` itself is a PEP 420 namespace package (no `__init__.py`),
so site-packages gains exactly one top-level name. The version is
`importlib.metadata.version("moefold")` (printed by `moefold env`).
"""

from setuptools import find_packages, setup

FOLDERS = ["parallel", "precision", "dense", "moe", "dispatch", "models", "execution", "pipeline", "training",
           "planner", "tools"]

# every package inside those folders: models/hf is installed as moefold.models.hf
_FOUND = find_packages(include=[f"{f}*" for f in FOLDERS])

setup(
    name="moefold",
    version="0.1.0",
    description="Mixture-of-experts training with tensor, sequence, context, pipeline, data, "
                "expert and expert-tensor parallelism, testable on a CPU laptop.",
    python_requires=">=3.10",
    packages=[f"moefold.{p}" for p in _FOUND],
    package_dir={f"moefold.{p}": p.replace(".", "/") for p in _FOUND},
    install_requires=[
        # 2.10: the first release with torch.nn.functional.grouped_mm; every torch name, keyword and ATen schema
        # moefold uses resolves in 2.10.0 and 2.11.0 (python -m moefold.tools.gpu.torch_api --torch-src DIR)
        "torch>=2.10",
        "numpy",
        "nvidia-ml-py",
        "safetensors",
        "tokenizers",
        "matplotlib",
        "tqdm",
        "pyyaml",  # moefold train --config FILE, and each run's RUN_DIR/config.yaml
    ],
    extras_require={
        # setuptools: tests/test_packaging.py builds the wheel without build isolation (>= 70.1 needs no `wheel`);
        # megatron-core: the tests compare data order, checkpoints, conventions and bf16 numerics with Megatron's
        # own code (its wheel needs only torch, numpy, packaging; psutil: its dist_checkpointing save path);
        # accelerate: transformers' FP8 loader, which reads moefold's FP8 HF export in tests/models/test_hf_fp8.py
        "test": ["pytest", "pytest-timeout", "ruff", "import-linter==2.17", "transformers", "tensorboard",
                 "torchao==0.18.0", "datasets==5.2.0", "setuptools==84.2.1", "megatron-core==0.16.1",
                 "psutil==7.2.2", "accelerate==1.15.0"],
        # prepare-data --hf-dataset: datasets saved with save_to_disk, local Parquet / JSON (imported only then)
        "datasets": ["datasets==5.2.0"],
        # FP8 training's default backend (--fp8-backend torchao): pure Python, no torch pin, CPU and CUDA
        "fp8": ["torchao==0.18.0"],
        # built against the installed torch: pip install --no-build-isolation -e ".[gpu]". DeepEP is not on
        # PyPI under its authors' name: it is built from source (docs/gpus.md, "On GPUs").
        "gpu": ["transformer-engine[pytorch]", "grouped-gemm"],
    },
    entry_points={"console_scripts": ["moefold=moefold.training.cli:main"]},
)
