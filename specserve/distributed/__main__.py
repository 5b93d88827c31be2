"""`python -m specserve.distributed RANK WORLD_SIZE INIT_METHOD PARENT_PID CONFIG`: a worker that rank 0 started on
this machine (group.start_group); CONFIG is the pickled EngineConfig, base64."""
import base64
import pickle
import sys

from specserve.distributed.worker import worker_main

rank, world_size, init_method, parent_pid, blob = sys.argv[1:]
worker_main(pickle.loads(base64.b64decode(blob)), int(rank), int(world_size), init_method, int(parent_pid))
