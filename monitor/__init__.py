"""How a run is watched and kept alive: metrics, health, rollback, goodput, W&B, traces.

metrics.py + events.py (metrics.jsonl, TensorBoard, MFU), health.py (the divergence guard,
repeats, preemption, the heartbeat), rollback.py (past a loss spike), goodput.py (wall time
across restarts, the compilation cache), tracking.py (W&B), profiler.py (jax.profiler traces).
May import: checkpoint.py, data.py, sharding.py and the layers below them (tests/test_layout.py).
"""
