"""Start `grt train` locally, with the deepspeed runner, under Slurm or under MPI."""
