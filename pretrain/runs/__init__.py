"""What a run is and leaves on disk, read alike by training, inference and the launcher: its
config (run_config.py; a `grt train` command line's in command_line.py), its checkpoints as
files (checkpoint_files.py), the DeepSpeed file it names (ds_file.py), the tokenizer that makes
a model's data its own (identity.py) and the zero-shot tasks and exit depths it names
(eval_tasks.py). Nothing here imports training or inference."""
