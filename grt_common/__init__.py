"""The bottom that pretrain/, data_pipeline/ and launcher/ share, importing none of them:
`errors.py` (the errors every command raises and says in one line) and `files.py` (files
written whole). The packages above import one way: launcher -> pretrain -> data_pipeline ->
grt_common (tests/test_layering.py)."""
