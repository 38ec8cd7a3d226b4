"""What a run is and leaves on disk, read alike by training, inference and the launcher: its
config and the files it names (run_config.py; a `grt train` command line's is read by the start,
pretrain/training/start/command_line.py),
its checkpoints as files (checkpoint_files.py), the tokenizer that makes a model's data its own
(identity.py) and the zero-shot tasks and exit depths it names (eval_tasks.py). Nothing here
imports training or inference."""
