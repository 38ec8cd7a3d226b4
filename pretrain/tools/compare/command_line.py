"""`grt compare`'s command line: its flags, the run config keys they set (a --set that disagrees
with a flag given is refused as `grt train` refuses it), and its --out (the one rule of an output
folder, data_pipeline/prepare_output.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from grt_common.errors import ConfigError
from grt_common.files import output_path
from pretrain import PROJECT_ROOT
from pretrain.runs.config_layers import SettingGivenTwice, same_setting
from pretrain.runs.data_spec import parse_data


# -- command line ------------------------------------------------------------------------------
def seed_list(text: str) -> list[int]:
    """--seeds: distinct whole numbers separated by commas (argparse says a refusal in one line)."""
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers separated by commas, e.g. 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more distinct seeds, e.g. 0,1,2")
    return seeds


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="grt compare", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--configs",
        action="append",
        required=True,
        help="comma-separated presets or JSON files, or controls of one (tiny-grt:dense-params, :dense-flops, "
        ":dense-train-flops, :r1, :fixed, :paper-start) (repeatable); the first is the reference",
    )
    p.add_argument("--data", required=True, help="manifest.json from `grt data prepare` (every run reads it)")
    p.add_argument("--out", required=True, type=output_path(is_dir=True), help="output directory")
    p.add_argument("--tokens", type=float, default=1e6, help="training tokens per run (default 1e6)")
    p.add_argument(
        "--time-budget",
        type=float,
        default=0,
        metavar="S",
        help="size the tokens per run by measurement (instead of --tokens) so that the whole command "
        "finishes within S seconds: each run's step is timed first; needs --nproc 1 --parallel 1",
    )
    p.add_argument(
        "--min-tokens",
        type=float,
        default=1e6,
        help="with --time-budget: warn when the budget affords fewer tokens per run (default 1e6)",
    )
    p.add_argument("--timing-steps", type=int, default=3, help="with --time-budget: timed steps per depth (default 3)")
    p.add_argument(
        "--exit-depth-factor",
        type=int,
        default=1,
        metavar="F",
        help="early exit at r = 0..F*R on each final checkpoint (default 1: the trainer's r = 0..R)",
    )
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (min = lr / 10, warmup 5%%)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--seeds",
        type=seed_list,
        metavar="S1,S2,...",
        help="train the comparison once per seed (<out>/seed-<s>/), then one table of mean ± spread per method "
        "and the paper's orderings against the seed spread (<out>/seeds.md; pretrain/tools/compare/seeds.py)",
    )
    p.add_argument(
        "--match",
        choices=("none", "flops", "params"),
        default="none",
        help="adjust layouts to the reference's forward FLOPs per token or parameter count",
    )
    p.add_argument("--reference", help="label of the reference config (default: the first)")
    p.add_argument("--ds-config", default=str(PROJECT_ROOT / "ds_configs" / "zero2.json"))
    p.add_argument("--nproc", type=int, default=1, help="ranks per run (local processes)")
    p.add_argument("--parallel", type=int, default=1, help="runs trained at the same time (default 1)")
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS per process (0: leave as is)")
    p.add_argument("--tag", default="", help="name suffix of the table/JSON/plot files (comparison-TAG.md ...)")
    p.add_argument("--evals", type=int, default=4, help="validation evaluations per run")
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--log-every", type=int, default=5, help="TensorBoard logging interval (tokens/s, memory)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override for every run, e.g. model.d_model=64 or train.lr=1e-3 (repeatable)",
    )
    p.add_argument("--retrain", action="store_true", help="train again runs that already finished")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the runs (layout, params, FLOPs), check each as `grt train --dry-run` does, and exit",
    )
    return p


# A compare flag and the run config key it sets in every run
FLAG_KEYS = (
    ("--micro-batch-size", "micro_batch_size", "train.micro_batch_size"),
    ("--grad-accum", "grad_accum", "train.grad_accum"),
    ("--lr", "lr", "train.lr"),
    ("--seed", "seed", "train.seed"),
    ("--eval-batches", "eval_batches", "train.eval_batches"),
    ("--log-every", "log_every", "train.log_every"),
)
NOT_GIVEN = object()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with `given`: the FLAG_KEYS flags it gave itself (a default is not given)."""
    p = build_parser()
    seen = argparse.Namespace(**{dest: NOT_GIVEN for _, dest, _ in FLAG_KEYS})  # argparse fills only what is unset
    args = p.parse_args(argv, namespace=seen)
    args.given = {dest for _, dest, _ in FLAG_KEYS if getattr(args, dest) is not NOT_GIVEN}
    for _, dest, _ in FLAG_KEYS:
        if dest not in args.given:
            setattr(args, dest, p.get_default(dest))
    return args


def check_flags_and_sets(args: argparse.Namespace) -> None:
    """A --set of a key that a flag of this command sets, to another value, is refused as `grt train`
    refuses it (`SettingGivenTwice`): before, the --set won without a word (`--seeds 0,1,2 --set
    train.seed=5` trained three copies of one seed and reported their spread). Each run's out is the
    comparison's own; a flag left at its default is not given, and a --set of its key is its value
    (what follows from it, as --lr's minimum and warm-up, follows the --set: it was refused)."""
    sets = {item.split("=", 1)[0]: item for item in args.overrides}
    for _, dest, key in FLAG_KEYS:
        if dest not in getattr(args, "given", ()) and key in sets:
            setattr(args, dest, coerce_like(getattr(args, dest), sets[key].partition("=")[2]))
    flags = [(flag, key, getattr(args, dest)) for flag, dest, key in FLAG_KEYS if dest in getattr(args, "given", ())]
    flags += [("--data", "data", args.data), ("--ds-config", "ds_config", args.ds_config)]
    if args.seeds:
        flags.append(("--seeds", "train.seed", ",".join(map(str, args.seeds))))
    for flag, key, value in flags:
        if key in sets:
            _, _, set_value = sets[key].partition("=")
            if flag == "--seeds" or not same_setting(key, value, coerce_like(value, set_value)):
                raise SettingGivenTwice(flag, value, sets[key])
    if "out" in sets:
        raise ConfigError(f"--set {sets['out']}: each run's directory is <--out>/<label>; give --out instead")


def coerce_like(value: Any, text: str) -> Any:
    """`text` (a --set's value) as the type of the flag's `value`, where it parses so."""
    try:
        return type(value)(text) if isinstance(value, (int, float)) else text
    except ValueError:
        return text


# What a comparison leaves in --out beside its run directories: each file's name starts so, or is a run's log
COMPARISON_FILES = ("comparison", "sizing", "seeds", "loss_curves", "startup-probe", "seed-")


def check_comparison_folder(out: Path, data: str) -> None:
    """The one rule of an output folder (data_pipeline/prepare_output.py) for `grt compare`: --out
    is new or empty, or holds a comparison (its files, its runs, their logs) and perhaps the data
    it reads; anything else is refused (a ConfigError), before any run is built. A comparison has
    no --overwrite: it deletes nothing (--retrain replaces its own runs)."""
    from data_pipeline.prepare_output import OutputOfSomethingElse, among_inputs, check_output_folder
    from pretrain.runs.checkpoint_files import is_run_folder

    def own(name: str) -> bool:
        if name.startswith(COMPARISON_FILES) or name.endswith(".log") or is_run_folder(out / name):
            return True
        return among_inputs(str(out), name, tuple(parse_data(data).paths))

    try:
        check_output_folder(str(out), lambda names: all(own(n) for n in names), None)
    except OutputOfSomethingElse as err:
        raise ConfigError(f"--out {err}") from None
