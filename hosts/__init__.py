"""The processes of a run: how they were launched, their agreement, a lost one, one run
per workdir.

launchers.py reads which launcher started a process (flags, SLURM, torchrun-style
variables) and which of its node's GPUs it trains on; host_sync.py agrees through
jax.distributed's key-value store and checks that every process sees one workdir;
peers.py makes a lost process one line and a restartable exit; workdir_lock.py keeps a
second run out of a workdir.
May import: store/ and errors.py (tests/test_layout.py).
"""
