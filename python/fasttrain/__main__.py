"""`python -m fasttrain ...` (what torchrun starts: `torchrun --nproc-per-node N -m fasttrain run RECIPE`).

torch's `record` writes a rank's uncaught error where torchrun reads it, so torchrun's failure
summary names the rank that failed and why."""
from torch.distributed.elastic.multiprocessing.errors import record

from fasttrain.cli import main

record(main)()
