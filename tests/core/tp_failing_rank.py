"""One rank of the process-group failure tests (tests/core/test_parallel.py runs it under torchrun, gloo, CPU).

    torchrun --standalone --nproc-per-node 2 tests/core/tp_failing_rank.py stall|crash

Rank 1 stalls (sleeps past the collective timeout) or crashes (exits at once) while rank 0 waits in an
all-reduce; rank 0 prints the one line its error becomes, and how long it waited, as JSON on stdout.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from llmstep.core import parallel

mode = sys.argv[1]
parallel.init_from_environment("cpu")
rank = dist.get_rank()
if rank == 1:
    if mode == "crash":
        os._exit(3)
    time.sleep(8)  # past rank 0's timeout (the test sets a few seconds); then rank 1's own all-reduce fails too
start = time.perf_counter()
try:
    with parallel.leaving():
        dist.all_reduce(torch.ones(1))
    line = "no error"
except Exception as e:  # what the command line would print: the error's type and its one line
    line = f"{type(e).__name__}: {e}"
if rank == 0:
    print(json.dumps({"line": line, "seconds": time.perf_counter() - start}), flush=True)
