"""The `grt` model for EleutherAI's lm-evaluation-harness, and `grt lm-eval`.

    grt lm-eval --model grt --model_args path=<export>,depth=4,kv_cache=average --tasks piqa

`grt lm-eval` is the harness' own command line (`lm_eval ...`, every flag as documented
there) with the `grt` model registered first: the harness has no plugin hook through which
plain `lm_eval` could find a model that lives outside its package. From Python,
`import pretrain.infer.evaluation.lm_eval_model` registers it for `lm_eval.simple_evaluate(model="grt")`.
Plain `lm_eval` runs an export instead through the harness' own Hugging Face model, on the
remote-code directory `grt export` writes (pretrain/model/hf.py):

    lm_eval --model hf --model_args pretrained=<export>/hf,trust_remote_code=True,depth=4 --tasks piqa

Model arguments: `path` (an export or a checkpoint, as for `grt eval`), `depth` (the exit
depth, default the trained R), `kv_cache` (none = one forward per request, exact; full,
first, last or average decode the continuation token by token through that cache
strategy), `device` (auto), `dtype` (bf16 on CUDA, fp32 on CPU), `batch_size`, `tokenizer`.
Requests are scored exactly as `grt eval` scores its zero-shot tasks (the same encoding and
the same functions), so the two agree on the same examples.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

import torch

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError:  # the harness is optional: `grt lm-eval` says how to get it
    LM = None

from grt_common.errors import ConfigError
from pretrain.infer.evaluation.zero_shot import encode_request, score_requests, score_requests_cached
from pretrain.infer.generate import generate
from pretrain.infer.kv_cache import STRATEGIES
from pretrain.infer.load import load_model, parse_dtype, pick_device

if TYPE_CHECKING:
    from lm_eval.api.instance import Instance

log = logging.getLogger(__name__)
MISSING = "lm-evaluation-harness is not installed: pip install 'grt-pretrain[lm-eval]'"


def _strategy(kv_cache: str | None) -> str | None:
    if kv_cache in (None, "", "none"):
        return None
    if kv_cache not in STRATEGIES:
        raise ConfigError(f"kv_cache={kv_cache!r}: choose none or one of {', '.join(STRATEGIES)}")
    return kv_cache


if LM is not None:

    @register_model("grt")
    class GRTLM(LM):
        def __init__(
            self,
            path: str,
            depth: int | None = None,
            kv_cache: str | None = None,
            device: str = "auto",
            dtype: str | None = None,
            batch_size: int | str = 8,
            tokenizer: str | None = None,
            **_: Any,
        ) -> None:
            super().__init__()
            if str(device).startswith("cuda") and not torch.cuda.is_available():
                # the harness passes its own default (cuda) whether or not the user asked
                log.warning("grt: no CUDA device here; evaluating on the CPU")
                device = "cpu"
            self._device = pick_device(device)
            loaded = load_model(path, self._device, parse_dtype(dtype) if dtype else None, tokenizer=tokenizer)
            self.model, self.tok = loaded.model, loaded.tokenizer()
            looped = self.model.loop is not None
            self.depth = (int(depth) if depth is not None else loaded.cfg.parsed_layout.loops) if looped else None
            self.strategy = _strategy(kv_cache)
            self.batch = int(batch_size) if str(batch_size).isdigit() else 8
            self.max_len = self.model.cfg.max_seq_len

        def _score(self, encoded: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
            depths = [self.depth if self.depth is not None else 0]
            if self.strategy is None:
                ll, greedy = score_requests(self.model, encoded, depths, self.device, self.batch)
            else:
                ll, greedy = score_requests_cached(self.model, encoded, depths, self.device, self.strategy)
            return [(float(a), bool(b)) for a, b in zip(ll[:, 0].tolist(), greedy[:, 0].tolist())]

        def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            encoded = []
            for req in requests:
                context, continuation = req.args
                encoded.append(encode_request(self.tok, context, continuation, self.max_len))
            return self._score(encoded)

        def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
            """Each string's total log-likelihood in windows of the model's context, the
            separator playing BOS before the first token (the harness' rolling scheme)."""
            out: list[float] = []
            for req in requests:
                windows = [
                    make_disjoint_window(w)
                    for w in get_rolling_token_windows(
                        token_list=self.tok.encode(req.args[0]),
                        prefix_token=self.tok.sep_id,
                        max_seq_len=self.max_len,
                        context_len=1,
                    )
                ]
                out.append(sum(ll for ll, _ in self._score([(ctx + cont, len(cont)) for ctx, cont in windows])))
            return out

        def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
            results: list[str] = []
            for req in requests:
                context, kwargs = req.args
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                ids = ([self.tok.sep_id] + self.tok.encode(context))[-(self.max_len - 1) :]
                budget = min(int(kwargs.get("max_gen_toks", 256)), self.max_len - len(ids))
                sample = bool(kwargs.get("do_sample", False)) and float(kwargs.get("temperature", 1.0)) > 0
                new = generate(
                    self.model,
                    torch.tensor([ids], device=self.device),
                    budget,
                    strategy=self.strategy or "full",
                    n_loops=self.depth,
                    use_cache=self.strategy is not None,
                    greedy=not sample,
                    temperature=float(kwargs.get("temperature", 1.0)),
                    stop_id=self.tok.sep_id,
                )
                text = self.tok.decode([t for t in new[0].tolist() if t != self.tok.sep_id])
                for stop in until:
                    text = text.split(stop, 1)[0]
                results.append(text)
            return results


def main(argv: list[str] | None = None) -> int:
    if LM is None:
        print(f"grt lm-eval: {MISSING}", file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["grt lm-eval", *(sys.argv[1:] if argv is None else argv)]
    try:
        cli_evaluate()
    except ConfigError as err:
        print(f"grt lm-eval: error: {err}", file=sys.stderr)
        return 2
    return 0
