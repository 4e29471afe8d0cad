from setuptools import find_packages, setup

PACKAGES = ["parallel", "dense", "moe", "dispatch", "pipeline", "models", "training"]

setup(
    name="moefold",
    version="0.1.0",
    description="Mixture-of-experts training with tensor, sequence, context, pipeline, data, "
                "expert and expert-tensor parallelism, testable on a CPU laptop.",
    python_requires=">=3.10",
    packages=find_packages(include=[f"{p}*" for p in PACKAGES]),
    install_requires=[
        "torch>=2.10",  # first release with torch.nn.functional.grouped_mm
        "numpy",
        "nvidia-ml-py",
        "safetensors",
        "tokenizers",
        "matplotlib",
        "tqdm",
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "ruff", "transformers", "tensorboard"],
        "gpu": ["transformer-engine[pytorch]", "grouped-gemm", "deep-ep"],
    },
    entry_points={"console_scripts": ["moefold=training.cli:main"]},
)
