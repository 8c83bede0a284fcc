"""The logsumexp of a vocabulary projection, behind ingest's surprisal: ``reference`` (torch,
vocabulary tiles, any device and dtype) and ``cpu`` (fp32 on the host: numpy's BLAS on the
process's torch threads)."""
