"""`grt export`: consolidate a (ZeRO-sharded) DeepSpeed checkpoint into one directory.

    DIR/config.json        the ModelConfig (pretrain.model_config.ModelConfig.load)
    DIR/model.safetensors  the weights; tied lm_head/wte stored once (wte.weight), re-tied on load
    DIR/tokenizer.model    the SentencePiece tokenizer the model was trained with
    DIR/run_config.json    the full training run config
    DIR/hf/                a Hugging Face directory: transformers.GPT2LMHeadModel for a dense model,
                           remote code (AutoModelForCausalLM, trust_remote_code=True) for a looped
                           one, and the tokenizer for AutoTokenizer (pretrain/infer/hf_export.py)

Works on CPU without a process group (DeepSpeed's zero_to_fp32 reader, any ZeRO stage).
Load the result with `pretrain.infer.load.load_model(DIR)` or pass DIR to eval/generate/analyze.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from data_pipeline.prepare_output import OutputOfSomethingElse, check_output_folder
from grt_common.errors import ConfigError
from grt_common.files import output_path
from pretrain.infer.load import (
    WEIGHTS,
    consolidate,
    model_from_state,
    parse_dtype,
    resolve_checkpoint,
)
from pretrain.model import GPT
from pretrain.model.weights import state_for_saving
from pretrain.runs.checkpoint_files import read_config


def export(
    checkpoint: str | Path, out: str | Path, dtype: str = "fp32", hf: bool = True, overwrite: bool = False
) -> dict[str, Any]:
    """Write the export to a temporary directory beside `out`, then rename it into place:
    `out` is a complete export or is left as it was, whatever fails or kills the process."""
    from safetensors.torch import save_file

    from pretrain.model_config import ModelConfig

    step_dir = resolve_checkpoint(checkpoint)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    try:  # the one rule of a command's output folder: an export replaces only with --overwrite, even another
        check_output_folder(str(out), lambda names: False, overwrite)
    except OutputOfSomethingElse as err:
        raise ConfigError(str(err)) from None
    run_cfg = read_config(step_dir)
    cfg = ModelConfig.from_dict(run_cfg["model"])
    save_hf = _hf_writer() if hf else None  # before anything is written
    model = model_from_state(cfg, consolidate(step_dir), parse_dtype(dtype))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        cfg.save(tmp / "config.json")
        (tmp / "run_config.json").write_text(json.dumps(run_cfg, indent=2) + "\n")
        save_file(state_for_saving(model), str(tmp / WEIGHTS), metadata={"format": "pt", "source": step_dir.name})
        written = ["config.json", "run_config.json", WEIGHTS]
        if (step_dir / "tokenizer.model").is_file():
            shutil.copyfile(step_dir / "tokenizer.model", tmp / "tokenizer.model")
            written.append("tokenizer.model")
        if save_hf is not None:
            save_hf(model, tmp / "hf", tmp / "tokenizer.model" if "tokenizer.model" in written else None)
            written.append("hf/")
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "checkpoint": str(step_dir),
        "out": str(out),
        "files": written,
        "params": n_params,
        "model": cfg.name,
        "layout": cfg.layout,
        "variant": cfg.variant,
    }


def _hf_writer() -> Callable[[GPT, Path, Path | None], None]:
    """pretrain.infer.hf_export.save_hf, or one line naming the pip extra when transformers is missing."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError(
            "the Hugging Face copy of the model (hf/) needs transformers: pip install 'grt-pretrain[hf]' "
            "(or pass --no-hf)"
        ) from None
    from pretrain.infer.hf_export import save_hf

    return save_hf


def _replace_dir(new: Path, out: Path) -> None:
    """Move the finished directory `new` to `out`; an existing `out` is renamed aside first and
    removed only once the new one is in place."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(new, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="grt export", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--checkpoint",
        required=True,
        help="<out>, <out>/checkpoints (newest complete) or <out>/checkpoints/stepNNNNNNNN",
    )
    p.add_argument("--out", required=True, type=output_path(is_dir=True), help="directory to write")
    p.add_argument("--dtype", default="fp32", help="weights dtype: fp32 (default), bf16, fp16")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face directory hf/")
    p.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty --out (once the new export is complete)"
    )
    args = p.parse_args(argv)
    try:
        info = export(args.checkpoint, args.out, dtype=args.dtype, hf=not args.no_hf, overwrite=args.overwrite)
    except (ConfigError, FileNotFoundError) as err:
        print(f"grt export: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
