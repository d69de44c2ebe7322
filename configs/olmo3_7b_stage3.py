"""Olmo 3 7B stage 3 (long-context extension to 65,536 tokens): stage 2 with what changes.

Source: OLMo-core `src/scripts/official/OLMo3/OLMo-3-1025-7B-long-context.py`
and the published checkpoint list `OLMo-3-1025-7B.csv`; the numbers are
explained in docs/long_context.md. Set `train.init_from` to the final stage-2
checkpoint (step 47,684) and `data.mix_file` to the long-context mix
(OLMo-core `DataMix.OLMo_longmino_mix_0625`).
"""

import ml_collections

from configs import olmo3_7b_stage2


def get_config() -> ml_collections.ConfigDict:
  c = olmo3_7b_stage2.get_config()
  m = c.model
  m.yarn.enabled = True  # long-context script: with_rope_scaling(YaRN), full-attention layers only
  m.yarn.factor = 8.0  # long-context script: YaRNRoPEScalingConfig(factor=8)
  m.yarn.beta_fast = 32.0  # long-context script: beta_fast=32
  m.yarn.beta_slow = 1.0  # long-context script: beta_slow=1
  m.yarn.original_max_position = 8192  # long-context script: old_context_len=8192
  # Ai2's 2025 OLMo-core kept RoPE positions 0..T-1 across packed documents
  # (and 3.0 still does under context parallelism): docs/long_context.md.
  m.rope_document_positions = False
  m.context_head_stride = 4  # long-context script: llama3(degree=8, head_stride=4)

  d = c.data
  d.dataset = 'packed'  # long-context script: NumpyPackedFSLDatasetConfig
  d.document_masking = True  # long-context script: generate_doc_lengths (intra-document masking)
  d.source_group_size = 8  # long-context script: source_group_size=8
  d.source_permutation_seed = 123  # long-context script: source_permutation_seed=123
  d.stable_packing = False  # True: machine-independent packing (docs/long_context.md)
  d.seq_len = 65_536  # long-context script: DEFAULT_SEQUENCE_LENGTH
  d.global_batch_size = 64  # long-context script: GLOBAL_BATCH_SIZE = 65536 * 64 tokens
  d.seed = 34521  # long-context script: NumpyDataLoaderConfig(seed=34521)

  o = c.opt
  o.lr = 2.0712352850360292e-4  # long-context script: LR
  o.schedule = 'linear'  # long-context script: LinearWithWarmup(warmup=200, alpha_f=0)
  o.warmup_steps = 200  # long-context script: warmup=200
  o.final_lr = 0.0  # long-context script: alpha_f=0
  # The horizon Ai2 ran: 50B tokens = ceil(5e10 / 4,194,304) = 11,921 steps, the
  # last published stage-3 checkpoint (OLMo-3-1025-7B.csv); the script's
  # max_duration (5e12 tokens) is a stage-1 leftover. docs/long_context.md.
  o.t_max = 11_921
  c.train.steps = 11_921  # OLMo-3-1025-7B.csv: stage3/step11921 is the last checkpoint

  t = c.train
  t.mesh_context = 8  # long-context script: llama3(degree=8): 8,192 tokens per device
  t.micro_batch_size = 1  # long-context script: rank_microbatch_size = one instance
  t.ckpt_every = 1000  # long-context script: save_interval=1000
  # long-context script: no downstream evaluator (OLMo-core's needs full logits, which
  # context parallelism does not give; evaluation/in_loop.py runs without CP too).
  t.eval_tasks = ()
  # long-context script: load_path stage2/step47684 with load_optim_state=True,
  # load_trainer_state=False: moments kept; step, schedule and data restart.
  t.reset_step_on_init = True
  return c
