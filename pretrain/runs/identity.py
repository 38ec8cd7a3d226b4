"""Tokenizer identity: a model's data is its own tokenizer's. Shared by resume, `grt eval`,
`grt generate` and the other commands that read data with a model: data tokenised with
another tokenizer is refused, whatever the overrides."""

from __future__ import annotations

from grt_common.errors import ConfigError


def check_same_tokenizer(
    data_sha256: str | None,
    data_vocab: int,
    data_what: str,
    model_sha256: str | None,
    model_vocab: int,
    model_what: str,
) -> None:
    """Refuse data made with another tokenizer than the model's (sha256 of tokenizer.model,
    where both are known), or whose vocabulary does not fit the model."""
    if data_sha256 and model_sha256 and data_sha256 != model_sha256:
        raise ConfigError(
            f"{data_what} was tokenised with tokenizer sha256 {data_sha256[:16]} (vocab {data_vocab}), "
            f"but {model_what} was trained with tokenizer sha256 {model_sha256[:16]} "
            f"(vocab {model_vocab}): a model cannot switch tokenizer (no override allows it); use data "
            "prepared with the model's tokenizer.model"
        )
    if data_vocab > model_vocab:
        raise ConfigError(
            f"{data_what} has a vocabulary of {data_vocab} tokens, more than the {model_vocab} of "
            f"{model_what}: its token ids do not fit the model"
        )
