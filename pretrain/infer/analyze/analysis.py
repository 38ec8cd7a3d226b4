"""`grt analyze`: the paper's analyses of a trained GRT (spec section 5), as one Markdown
report with a JSON twin and plots (those two: pretrain/infer/analyze/report.py; the measures
on tensors: pretrain/infer/analyze/measures.py).

On held-out batches (the manifest's validation split), every loss and token count over the
targets the loss scores (a loss mask's others left out, as in training):
- loss at each exit depth 0..R;
- gate forcing: every gate set to 0 (s_r = o_r) or 1 (s_r = s_{r-1}: the prelude-only loss);
- anchor replacement: the loop fed zeros, the token embeddings, or the previous state
  as e instead of the fixed prelude output;
- mean gate per loop step;
- gate-input variance share: the gate's first layer reads [LN(s_{r-1}); LN(e)], so its
  pre-activation is W_s LN(s) + W_e LN(e) + b. The share of the state half is
  tr Var(W_s LN(s)) / (tr Var(W_s LN(s)) + tr Var(W_e LN(e))), variances over tokens
  (our definition: the paper's exact one is unknown);
- linear CKA between the loop states s_0..s_R (a heat-map), and with `--dense` against a
  dense model's layers (residual stream after the embedding and each block);
- easy vs hard tokens: target tokens bucketed as punctuation (the piece is punctuation
  and/or spaces) or, by frequency as a scored target in the training split, frequent (the most frequent
  tokens making up the first 50% of occurrences), medium (the next 40%) and rare (the
  last 10%); the share of the depth-0 loss recovered after each step, (L_0 - L_r) / L_0;
- cosine similarity between the state and anchor halves of W_proj (and of the gate's
  first layer): cos(vec W[:, :d], vec W[:, d:]) and the mean row-wise cosine; each half's
  Frobenius norm and its top singular values;
- early exit against compute: loss over forward FLOPs per token (the spec's formula,
  pretrain.model.flops) at each exit depth, with `--dense` the dense model cut after each
  of its layers on the same axis, and for each the share of the full-depth gain kept at half
  the compute (`half_compute_share`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from data_pipeline.manifest import Manifest
from data_pipeline.prepare_output import OutputOfSomethingElse, check_output_folder
from grt_common.errors import ConfigError
from grt_common.files import atomic_write_text, output_path
from pretrain.infer.analyze.measures import (
    BUCKETS,
    cka_matrix,
    cross_cka,
    exit_curve,
    frequency_buckets,
    half_cosines,
    is_punctuation,
    variance_share,
)
from pretrain.infer.analyze.report import markdown, plots
from pretrain.infer.evaluation.scoring import Batch, check_batches, jsonable, lm_sums, val_batches
from pretrain.infer.loop_health import run_settings
from pretrain.model import GPT, LoopStep
from pretrain.model.layers import AttentionContext
from pretrain.model.loss import IGNORE_INDEX, is_scored, scored_tokens
from pretrain.runs.data_spec import parse_data

if TYPE_CHECKING:
    from data_pipeline.tokenizer import Tokenizer

ANCHORS = ("prelude", "zeros", "embeddings", "previous")
REPORT_FILES = ("report.md", "analysis.json")  # beside its plots (*.png): what --out holds after a run


def _grt_loop(model: GPT) -> LoopStep:
    """The GRT's loop step, whose projection and gate the analyses read; refused, in one line, for a
    model whose loop is not the GRT's (the analyses force its gates and replace its anchor)."""
    if not isinstance(model.loop, LoopStep) or not model.runs_grt_loop():
        raise ConfigError(
            f"grt analyze needs a GRT (a looped model whose gates can be forced and anchor replaced), got "
            f"variant {model.cfg.variant!r} with layout {model.cfg.layout!r}"
        )
    return model.loop


def check_models(model: GPT, dense: GPT | None, dense_path: str = "") -> LoopStep:
    """Refuse a pair the analyses cannot use (the model's structure suffices: the meta device
    serves); the GRT's loop step."""
    loop = _grt_loop(model)
    if dense is not None and dense.loop is not None:
        raise ConfigError(f"--dense {dense_path}: expected a dense model, got layout {dense.cfg.layout!r}")
    if dense is not None and dense.cfg.vocab_size != model.cfg.vocab_size:
        raise ConfigError(
            f"--dense: vocabulary {dense.cfg.vocab_size} differs from the GRT's "
            f"{model.cfg.vocab_size}; CKA and the early-exit comparison need the same tokens"
        )
    return loop


# -- one pass over the data -----------------------------------------------------------------
@torch.no_grad()
def collect(
    model: GPT,
    batches: Iterable[Batch],
    device: torch.device,
    bucket_of: torch.Tensor | None,
    cka_tokens: int = 2048,
) -> dict[str, Any]:
    """Per-depth losses (overall and by bucket) over the scored targets alone (a loss mask's others
    neither add to a loss nor count), mean gates, gate-input variance sums, and a sample of the
    states for CKA, from one forward per batch at the trained depth. The sums stay on the device
    until the last batch (no host sync per batch)."""
    R = model.max_loops
    loop = _grt_loop(model)
    nb = len(BUCKETS)
    f64 = torch.float64
    loss = torch.zeros(R + 1, nb + 1, dtype=f64, device=device)  # last column: every scored target
    count = torch.zeros(nb + 1, dtype=f64, device=device)
    gate_sum = torch.zeros(R, dtype=f64, device=device)
    gate_n = 0
    d = model.cfg.d_model
    var = torch.zeros(R, 4, d, dtype=f64, device=device) if loop.has_gate else None  # a_sum, a_sq, b_sum, b_sq
    n_tok = 0
    kept: list[list[torch.Tensor]] = [[] for _ in range(R + 1)]
    kept_n = 0
    buckets = bucket_of.to(device) if bucket_of is not None else None
    for batch in batches:
        idx, targets = batch["input_ids"].to(device), batch["targets"].to(device)
        out = model(idx, n_loops=R, return_states=True, return_gates=True)
        ctx = AttentionContext()
        flat_t = targets.flatten()
        b = buckets[flat_t.clamp(min=0)] if buckets is not None else None  # an unscored target adds 0 to its bucket
        for r in range(R + 1):
            logits = model.decode(out.states[r], ctx).float()
            nll = F.cross_entropy(logits.flatten(0, 1), flat_t, ignore_index=IGNORE_INDEX, reduction="none").double()
            loss[r, nb] += nll.sum()
            if b is not None:
                loss[r, :nb].index_add_(0, b, nll)
        count[nb] += scored_tokens(flat_t)
        if b is not None:
            count[:nb].index_add_(0, b, is_scored(flat_t).double())
        for r, g in enumerate(out.gates):  # a property of the model at every position, scored or not
            gate_sum[r] += g.double().mean() * idx.numel()
        gate_n += idx.numel()
        if var is not None:
            dtype = loop.weight_dtype()  # the states may be fp32 under bf16 weights (ModelConfig.state_dtype)
            e = out.states[0].to(dtype)  # the prelude output, the anchor
            be = loop.anchor.gate_fc(loop.anchor.gate_norm(e)).flatten(0, 1).double()
            w_s = loop.gate_fc_state.weight.double()
            for r in range(R):
                a = loop.gate_norm_state(out.states[r].to(dtype)).flatten(0, 1).double() @ w_s.T
                var[r, 0] += a.sum(0)
                var[r, 1] += (a * a).sum(0)
                var[r, 2] += be.sum(0)
                var[r, 3] += (be * be).sum(0)
        n_tok += idx.numel()
        if kept_n < cka_tokens:
            take = min(cka_tokens - kept_n, idx.numel())
            for r in range(R + 1):
                kept[r].append(out.states[r].flatten(0, 1)[:take].float().cpu())
            kept_n += take
    loss, count, gate_sum = loss.cpu(), count.cpu(), gate_sum.cpu()
    var = var.cpu() if var is not None else None
    res: dict[str, Any] = {
        "loss": loss,
        "count": count,
        "gate_mean": (gate_sum / max(gate_n, 1)).tolist(),
        "states": [torch.cat(k) for k in kept] if kept_n else None,
    }
    if var is not None and n_tok:
        res["state_share"] = [variance_share(var[r, 0], var[r, 1], var[r, 2], var[r, 3], n_tok) for r in range(R)]
    return res


@torch.no_grad()
def dense_layer_states(dense: GPT, batches: Iterable[Batch], device: torch.device, n_tokens: int) -> list[torch.Tensor]:
    """A dense model's residual stream after the embedding and after each block, on the first
    n_tokens tokens of the batches (the same tokens `collect` keeps for CKA)."""
    kept: list[torch.Tensor] | None = None
    got = 0
    for batch in batches:
        if got >= n_tokens:
            break
        idx = batch["input_ids"].to(device)
        x, ctx = dense.embed(idx), AttentionContext()
        layers = [x]
        for block in list(dense.prelude) + list(dense.coda):
            x = block(x, ctx)
            layers.append(x)
        take = min(n_tokens - got, idx.numel())
        flat = [h.flatten(0, 1)[:take].float().cpu() for h in layers]
        kept = flat if kept is None else [torch.cat([a, b]) for a, b in zip(kept, flat)]
        got += take
    return kept or []


def token_counts(manifest: str, max_batches: int, seed: int = 1234) -> Counter[int]:
    """How often each token is a scored target in the training split's first max_batches batches (of 16)."""
    from data_pipeline.loader import TokenBatchLoader

    counts: Counter[int] = Counter()
    loader = TokenBatchLoader(
        manifest, split="train", micro_batch_size=16, num_workers=0, seed=seed, shuffle_buffer=0, loop=False
    )
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        targets = batch["targets"]
        counts.update(targets[is_scored(targets)].tolist())  # the tokens the loss scores, as collect's buckets
    return counts


def punctuation_ids(tok: Tokenizer, vocab_size: int) -> set[int]:
    out: set[int] = set()
    for t in range(vocab_size):
        if t == tok.sep_id:
            continue
        if is_punctuation(tok.decode([t])):
            out.add(t)
    return out


# -- report --------------------------------------------------------------------------------------
def analyze(
    model: GPT,
    manifest: str,
    tok: Tokenizer,
    device: torch.device,
    batch_size: int = 8,
    max_batches: int = 8,
    freq_batches: int = 200,
    cka_tokens: int = 2048,
    seed: int = 1234,
    dense: GPT | None = None,
) -> dict[str, Any]:
    loop = check_models(model, dense)
    R = model.max_loops
    batches = list(val_batches(manifest, batch_size, None, max_batches, seed))
    if not batches:
        raise ConfigError(f"{manifest}: no validation batches")
    vocab = model.cfg.vocab_size
    punct = punctuation_ids(tok, vocab)
    bucket_of = frequency_buckets(token_counts(manifest, freq_batches, seed), vocab, punct)
    c = collect(model, batches, device, bucket_of, cka_tokens)
    loss, count = c["loss"], c["count"]
    by_depth = {r: loss[r, -1].item() / count[-1].item() for r in range(R + 1)}
    buckets: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(BUCKETS):
        if count[i] == 0:
            continue
        l0 = loss[0, i].item() / count[i].item()
        per = [loss[r, i].item() / count[i].item() for r in range(R + 1)]
        buckets[name] = {
            "tokens": int(count[i].item()),
            "loss_by_depth": per,
            "recovered_by_step": [(l0 - lr) / l0 for lr in per[1:]],
            "vocab_tokens": int((bucket_of == i).sum().item()),
        }

    def at_full(**fwd: Any) -> float:
        s = lm_sums(model, batches, [R], device, **fwd)
        return (s[0, 0] / s[0, 1]).item()

    res: dict[str, Any] = {
        "layout": model.cfg.layout,
        "trained_loops": R,
        "tokens": int(count[-1].item()),
        "loss_by_depth": by_depth,
        "gate_forcing": (
            {"trained": by_depth[R], "gate=0": at_full(gate_override=0.0), "gate=1": at_full(gate_override=1.0)}
            if loop.has_gate
            else {}
        ),
        "anchor": {a: (by_depth[R] if a == "prelude" else at_full(anchor=a)) for a in ANCHORS},
        "gate_mean_by_step": c["gate_mean"],
        "gate_state_share_by_step": c.get("state_share", []),
        "buckets": buckets,
        "cka": cka_matrix(c["states"]) if c["states"] is not None else None,
        "cka_tokens": int(c["states"][0].shape[0]) if c["states"] is not None else 0,
    }
    seq_len = batches[0]["input_ids"].shape[1]
    res["early_exit"] = {"seq_len": seq_len, "grt": exit_curve(model.cfg, seq_len, by_depth)}
    if dense is not None:
        dense_depths = list(range(1, len(dense.prelude) + 1))
        s = lm_sums(dense, batches, dense_depths, device)
        dense_loss = {k: (s[i, 0] / s[i, 1]).item() for i, k in enumerate(dense_depths)}
        res["early_exit"]["dense"] = exit_curve(dense.cfg, seq_len, dense_loss)
    if dense is not None and c["states"] is not None:
        layers = dense_layer_states(dense, batches, device, res["cka_tokens"])
        m = cross_cka(c["states"], layers)
        res["cka_dense"] = {
            "layout": dense.cfg.layout,
            "matrix": m,
            "best_layer_by_state": [max(range(len(row)), key=row.__getitem__) for row in m],
        }
    cos: dict[str, dict[str, float]] = {}
    if loop.proj_state is not None and loop.anchor.proj is not None:  # both or neither (cfg.reinject_anchor)
        cos["W_proj"] = half_cosines(loop.proj_state.weight, loop.anchor.proj.weight)
    if loop.has_gate:
        cos["gate_fc"] = half_cosines(loop.gate_fc_state.weight, loop.anchor.gate_fc.weight)
    res["half_cosines"] = cos
    return res


def main(argv: list[str] | None = None) -> int:
    from pretrain.infer.load import load_model, pick_device, pick_dtype

    p = argparse.ArgumentParser(
        prog="grt analyze",
        description="The paper's analyses of a trained GRT: "
        "early exit against compute, gate forcing, anchor replacement, gate statistics, CKA, token buckets, "
        "the norms and singular values of the gate's and the projection's two halves.",
    )
    p.add_argument("model", help="exported dir (grt export), run dir, <out>/checkpoints or a step dir")
    p.add_argument(
        "--out", required=True, type=output_path(is_dir=True), help="report directory (report.md, analysis.json, PNGs)"
    )
    p.add_argument("--data", help="manifest.json (default: the run config's data)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-batches", type=int, default=16, help="validation batches to analyse")
    p.add_argument("--freq-batches", type=int, default=200, help="training batches (of 16) for token frequencies")
    p.add_argument("--cka-tokens", type=int, default=2048)
    p.add_argument(
        "--dense",
        help="a dense model (same tokenizer): CKA of the loop states against its layers, and its early exit "
        "(cut after each layer) against the GRT's over FLOPs per token",
    )
    p.add_argument("--tokenizer")
    p.add_argument("--overwrite", action="store_true", help="write into an --out that holds something else")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on a CUDA GPU, else the stored dtype), fp32, bf16, fp16")
    args = p.parse_args(argv)
    try:
        counts = (
            ("--batch-size", args.batch_size, 1),
            ("--max-batches", args.max_batches, 1),
            ("--freq-batches", args.freq_batches, 1),
            ("--cka-tokens", args.cka_tokens, 0),
        )
        for flag, value, least in counts:
            if value < least:
                raise ConfigError(f"{flag} {value}: must be >= {least}")
        try:  # the one rule of an output folder: an earlier report is this command's own
            check_output_folder(
                args.out, lambda names: all(n in REPORT_FILES or n.endswith(".png") for n in names), args.overwrite
            )
        except OutputOfSomethingElse as err:
            raise ConfigError(f"--out {err}") from None
        device = pick_device(args.device)
        dtype = pick_dtype(args.dtype, device)
        # every refusal before a weight is read: the models' structures (on the meta device), the data
        plan = load_model(args.model, tokenizer=args.tokenizer, weights=False)
        check_models(plan.model, load_model(args.dense, weights=False).model if args.dense else None, args.dense)
        manifest = args.data or plan.run_config.get("data")
        if manifest and parse_data(manifest).sources is not None:
            raise ConfigError(
                f"data={manifest!r} is a mixture: the analyses read one manifest, pass --data <manifest.json>"
            )
        if not manifest or not Path(manifest).is_file():
            raise ConfigError(f"no manifest ({manifest!r}): pass --data <manifest.json>")
        data = plan.check_data(manifest)  # the model's tokenizer, a readable manifest
        assert isinstance(data, Manifest)  # a mixture was refused above
        check_batches(data, "val", args.batch_size)  # before the loader, which would warn and give none
        tok = plan.tokenizer()
        loaded = load_model(args.model, device=device, dtype=dtype, tokenizer=args.tokenizer)
        dense = load_model(args.dense, device=device, dtype=dtype).model if args.dense else None
        res = analyze(
            loaded.model,
            manifest,
            tok,
            device,
            args.batch_size,
            args.max_batches,
            args.freq_batches,
            args.cka_tokens,
            loaded.run_config.get("train", {}).get("seed", 1234),
            dense=dense,
        )
    except (ConfigError, FileNotFoundError) as err:
        print(f"grt analyze: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    res["model"] = str(args.model)
    train = loaded.run_config.get("train", {})  # the loop verdict's trained depths and its advice
    res["loop_settings"] = run_settings(loaded.cfg, train.get("depth_sampling"), train.get("max_train_depth", 0))
    title = f"Analysis of {loaded.cfg.name} ({loaded.cfg.layout})"
    try:
        out.mkdir(parents=True, exist_ok=True)
        files = plots(res, out)
        atomic_write_text(out / "analysis.json", json.dumps(jsonable(res), indent=2) + "\n")
        atomic_write_text(out / "report.md", markdown(res, files, title))
    except OSError as err:  # a full disk, a folder that went away or became a file: one line
        print(f"grt analyze: error: --out {str(out)!r}: {err.strerror or err}", file=sys.stderr)
        return 2
    print(markdown(res, {}, title))
    print(f"report: {out / 'report.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
