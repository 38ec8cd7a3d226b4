"""`grt train`: build the run config (preset or model JSON + overrides), check it, train."""
from __future__ import annotations

import argparse
import json
import sys

from pretrain.config import ConfigError, ModelConfig
from pretrain.presets import PRESETS, get_preset
from pretrain.training.run_config import RunConfig, apply_overrides


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grt train", description="Train a GRT or dense model with DeepSpeed.")
    p.add_argument("--config-json", help="a complete run config (as saved in <out>/config.json); flags below override it")
    p.add_argument("--preset", help=f"model preset: {', '.join(PRESETS)}")
    p.add_argument("--model-config", help="model config JSON (instead of --preset)")
    p.add_argument("--data", help="manifest.json written by `grt data prepare`")
    p.add_argument("--ds-config", help="DeepSpeed JSON (default ds_configs/zero3.json)")
    p.add_argument("--out", help="run directory: config, logs, TensorBoard, checkpoints")
    p.add_argument("--steps", type=int)
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--grad-accum", type=int)
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out, if any")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. train.lr=3e-4, model.layout=2+4x4+2 (repeatable)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return p


def config_from_args(args) -> RunConfig:
    cfg = RunConfig.load(args.config_json) if args.config_json else RunConfig()
    if args.preset and args.model_config:
        raise ConfigError("give --preset or --model-config, not both")
    if args.preset:
        cfg.model = get_preset(args.preset)
    if args.model_config:
        cfg.model = ModelConfig.load(args.model_config)
    for flag, key in (("data", "data"), ("ds_config", "ds_config"), ("out", "out")):
        if getattr(args, flag):
            setattr(cfg, key, getattr(args, flag))
    for flag in ("steps", "micro_batch_size", "grad_accum"):
        if getattr(args, flag) is not None:
            setattr(cfg.train, flag, getattr(args, flag))
    apply_overrides(cfg, args.overrides)
    cfg.validate()
    return cfg


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        if args.print_config:
            print(json.dumps(cfg.to_dict(), indent=2))
            return 0
        from pretrain.training.trainer import TrainingStopped, train

        summary = train(cfg, resume=args.resume)
    except ConfigError as err:
        print(f"grt train: error: {err}", file=sys.stderr)
        return 2
    except TrainingStopped as err:
        print(f"grt train: stopped: {err}", file=sys.stderr)
        return 3
    if summary:
        print(json.dumps(summary, indent=2))
    return 0
