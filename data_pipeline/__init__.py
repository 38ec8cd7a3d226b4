"""Raw text -> SentencePiece tokens -> WebDataset shards -> resumable per-rank batches."""
