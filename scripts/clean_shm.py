"""Remove DeepSpeed CPU all-reduce buffers in /dev/shm that no live process maps.

DeepSpeed's shared-memory comm op creates one (66 MB) per rank when LOCAL_SIZE equals the
world size and never unlinks it. `pretrain.distributed` keeps LOCAL_SIZE out of the
environment on CPU so that none is created; this clears what other tools or older runs left.
"""

import glob
import os

mapped: set[str] = set()
for maps in glob.glob("/proc/[0-9]*/maps"):
    try:
        with open(maps) as f:
            mapped.update(line.split()[5] for line in f if "/dev/shm/" in line and len(line.split()) > 5)
    except OSError:
        pass
removed = 0
for path in glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"):
    if path not in mapped:
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
if removed:
    print(f"removed {removed} stale DeepSpeed shared-memory buffers from /dev/shm")
