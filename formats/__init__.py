"""Other formats of a checkpoint: HF safetensors and OLMo-core step directories <-> ours.

hf_ckpt.py (HF weights and config dialects); olmo_core_ckpt.py (weights, AdamW moments, step,
data position) over olmo_core_reader.py and olmo_core_config.py; ckpt_files.py (what both
share); init_from.py (a run's step-0 weights from an HF directory or one of our checkpoints).
convert.py is their command line.
May import: configs/ and the layers below it (tests/test_layout.py).
"""
