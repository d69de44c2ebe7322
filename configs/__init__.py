"""The recipes: one get_config() per file, every number naming its source.

train.py, plan.py and convert.py load them by path (--config=configs/olmo3_7b.py);
formats/ reads olmo3_7b.py's defaults.
May import: checkpoint.py (from_checkpoint.py) and the layers below it (tests/test_layout.py).
"""
