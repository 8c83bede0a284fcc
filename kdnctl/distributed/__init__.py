"""Scale-out on a Ray cluster (optional extra: ``pip install 'kdnctl[ray]'``).

Model-holding actors (one per GPU, or per CPU slot) run prefill / scoring / compression and
write objects straight into the store's shared ``objects/`` directory; the driver is the only
process that opens the LMDB catalog, and it commits the workers' records in batches under the
store's writer lock. Nothing here imports ray until a job runs (``cluster.require_ray``).

- ``cluster``: connect to (or start) Ray, place workers on GPUs or CPU slots
- ``pool``: the driver loop (bounded in-flight tasks, batched commits, error mapping)
- ``workers``: the actor classes (plain classes; ray.remote is applied at run time)
- ``ingest`` / ``compress``: the two distributed jobs
"""
