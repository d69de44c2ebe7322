"""Olmo 3 7B stage 1, exactly as Ai2 ran it with OLMo-core.

Sources: OLMo-core `src/scripts/official/OLMo-3-1025-7B-pretrain-1.py` / `-2.py`
(recipe), HF `allenai/Olmo-3-1025-7B` config.json (architecture). Every field
below names its source; docs/recipe.md and docs/architecture.md explain them.
"""

import ml_collections
from ml_collections import config_dict

# OLMo-core olmo_core/eval/task_groups.py TASK_GROUPS['fast'], sorted as with_recommended_evals
# sorts it: OLMES ARC/HellaSwag/MMLU as BPB and fast MC, basic skills RC, code and math BPB,
# and copycolors (an MC sanity check).
FAST_TASKS = (
    'arc_challenge_test_bpb_5shot', 'arc_challenge_test_mc_5shot_fast',
    'arc_easy_test_bpb_5shot', 'arc_easy_test_mc_5shot_fast',
    'basic_skills_arithmetic_rc_5shot', 'basic_skills_coding_rc_5shot',
    'basic_skills_common_knowledge_rc_5shot', 'basic_skills_logical_reasoning_rc_5shot',
    'basic_skills_pattern_rc_5shot', 'basic_skills_string_operations_rc_5shot',
    'codex_humaneval_gold_bpb_3shot', 'codex_mbpp_gold_bpb_3shot', 'copycolors_10way_fast',
    'hellaswag_bpb_5shot', 'minerva_math_500_gold_bpb_0shot',
    'mmlu_humanities_test_bpb_5shot', 'mmlu_humanities_test_mc_5shot_fast',
    'mmlu_other_test_bpb_5shot', 'mmlu_other_test_mc_5shot_fast',
    'mmlu_social_sciences_test_bpb_5shot', 'mmlu_social_sciences_test_mc_5shot_fast',
    'mmlu_stem_test_bpb_5shot', 'mmlu_stem_test_mc_5shot_fast',
    'mt_mbpp_cpp_gold_bpb_3shot', 'mt_mbpp_java_gold_bpb_3shot', 'mt_mbpp_rust_gold_bpb_3shot',
)


def model_config() -> ml_collections.ConfigDict:
  m = ml_collections.ConfigDict()
  m.vocab_size = 100352  # OLMo-core: tokenizer vocab 100278 padded to a multiple of 128
  m.num_layers = 32  # HF num_hidden_layers
  m.d_model = 4096  # HF hidden_size
  m.num_heads = 32  # HF num_attention_heads
  m.num_kv_heads = 32  # HF num_key_value_heads (MHA)
  m.head_dim = 128  # d_model / num_heads
  m.mlp_hidden = 11008  # HF intermediate_size (SwiGLU)
  m.norm_eps = 1e-6  # HF rms_norm_eps
  m.rope_theta = 500_000.0  # HF rope_theta
  # One scan group = one period of this pattern; 'S' sliding, 'F' full.
  m.layer_pattern = 'SSSF'  # HF layer_types: full when i % 4 == 3
  m.sliding_window = 4096  # HF sliding_window: query i sees keys (i-W, i]
  m.sliding_window_plus_one = False  # knob: OLMo-core before Aug-2025 let i see (i-W-1, i]
  m.yarn = ml_collections.ConfigDict()  # long-context checkpoints only; full layers only
  m.yarn.enabled = False  # stage 1/2: plain RoPE on every layer
  m.yarn.factor = 8.0  # HF rope_scaling.factor (Olmo-3 long-context)
  m.yarn.original_max_position = 8192  # HF rope_scaling.original_max_position_embeddings
  m.yarn.beta_fast = 32.0  # HF rope_scaling.beta_fast
  m.yarn.beta_slow = 1.0  # HF rope_scaling.beta_slow
  m.yarn.attention_factor = config_dict.placeholder(float)  # None: 0.1*ln(factor)+1
  # knob: RoPE positions restart per document (OLMo-core 3.0 without CP) or run
  # 0..T-1 (Ai2's 2025 code, and OLMo-core 3.0 under CP); docs/long_context.md.
  m.rope_document_positions = False
  m.context_head_stride = 1  # OLMo-core llama3 CP head_stride: kv heads all-gathered at a time
  m.init_std = 0.02  # OLMo-core InitMethod.normal: std 0.02 ...
  m.init_cutoff = 0.06  # ... truncated at +-3 std, no depth scaling
  m.param_dtype = 'float32'  # OLMo-core FSDP: fp32 master weights
  m.dtype = 'bfloat16'  # OLMo-core FSDP mixed precision: bf16 compute
  # Remat: 'full' fits every pod the 7B fits (a v5e-32 at the chip's limit). A v5e-256
  # fits 'mlp_out,attn' in 15 GB (7% faster on a v5e), a v5e-64 'mlp_out' (3.8%):
  # docs/recipe.md, plan.py --policies.
  m.remat = 'full'
  # Pallas on TPU; on GPU cuDNN, or the Pallas GPU kernel for documents and context
  # parallelism; xla on CPU: kernels.resolve
  m.attention_impl = 'auto'
  m.attention_block_q = config_dict.placeholder(int)  # kernel block sizes; None: kernels' table
  m.attention_block_kv = config_dict.placeholder(int)
  return m


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = model_config()

  c.data = ml_collections.ConfigDict()
  c.data.mix_file = ''  # OLMo-core DataMix.OLMo_mix_0925 list (label,path lines)
  c.data.base_dir = ''  # root the mix file's relative paths are resolved against
  c.data.paths = ()  # alternative to mix_file: explicit token files, in order
  c.data.path_remap = ()  # 'PREFIX=LOCAL' rewrites, e.g. 's3://ai2-llm/=/data/ai2-llm/'
  c.data.allow_data_change = False  # OLMo-core ignore_fingerprint_mismatch: resume on changed data
  c.data.tokenizer_id = 'allenai/dolma2-tokenizer'  # substituted for {TOKENIZER}
  # tokenizer.json that decodes the run's samples and names the export's tokenizer;
  # '' -> the mix's `# tokenizer` line's file (scripts/prepare_data.py writes it), if any.
  c.data.tokenizer = ''
  # The tokenizer's settings, stated for Ai2's mixes (which do not describe themselves).
  # A config may leave them None: then a mix's `# tokenizer` line fills them in, and a
  # stated value that contradicts that line is refused (config_checks.complete).
  c.data.vocab_size = 100278  # dolma2 tokenizer
  c.data.eos_token_id = 100257  # dolma2 tokenizer
  c.data.pad_token_id = 100277  # dolma2 tokenizer
  c.data.seq_len = 8192  # OLMo-core pretrain-1: sequence_length
  c.data.global_batch_size = 512  # OLMo-core pretrain-1: 512 x 8192 = 4,194,304 tokens
  c.data.seed = 34521  # OLMo-core pretrain-1: data seed (epoch 1 uses PCG64(seed+1))
  c.data.repetition_filter = False  # Ai2 did not filter for Olmo 3 7B (MaxText did)
  # Attention within documents (segment ids from the EOS positions): OLMo-core's
  # generate_doc_lengths, one switch here. Stages 1-2 attend across documents.
  c.data.document_masking = False
  # 'fsl': OLMo-core NumpyFSLDatasetConfig (stages 1-2, pretrain-1/-2 and midtrain);
  # 'packed': NumpyPackedFSLDatasetConfig (stage 3, OLMo-3-1025-7B-long-context.py).
  c.data.dataset = 'fsl'
  # OLMo-core NumpyDatasetConfig.source_permutation_seed: None keeps the mix order
  c.data.source_permutation_seed = config_dict.placeholder(int)
  c.data.source_group_size = 1  # OLMo-core NumpyPackedFSLDatasetConfig default: files per packing
  c.data.long_doc_strategy = 'truncate'  # OLMo-core NumpyPackedFSLDatasetConfig default
  c.data.bos_token_id = config_dict.placeholder(int)  # dolma2 tokenizer: no BOS
  # Ours: False sorts documents as OLMo-core does (np.argsort, unstable: ties land by
  # the CPU's sort kernel, so Ai2's packing depends on the machine); True sorts stably,
  # the same on every machine. docs/data.md#packed-long-context-dataset.
  c.data.stable_packing = False
  c.data.cache_dir = ''  # where the global permutation is cached; '' -> <workdir>/data_cache
  c.data.prefetch = 2  # batches prepared ahead by the background thread
  # gs://, s3://, http(s):// token files: a local folder keeping every byte range read, so a
  # second epoch or a restart reads them from disk ('' -> no cache). docs/data.md#remote-data.
  c.data.remote_cache_dir = ''
  c.data.validation_paths = ()  # held-out token files (e.g. C4-en validation)
  # More held-out sets, {name: (token files, ...)}: each logged as eval/lm/<name>/CE loss and
  # PPL, as OLMo-core's LMEvaluator labels its sets (its v3-small-ppl-validation mix:
  # 'c4_en-validation', 'pile-validation', ...); validation_paths keeps the name 'validation'.
  # --config.data.validation_sets="{'c4_en-validation': ('/data/c4_val.npy',)}"
  c.data.validation_sets = ml_collections.ConfigDict()
  # OLMo-core NumpyFSLDatasetConfig.max_target_sequence_length (part of the data
  # fingerprint); -1 means seq_len, as pretrain-1 sets it.
  c.data.max_target_sequence_length = -1
  c.data.validation_batches = 8  # fixed held-out batches per in-loop eval

  c.opt = ml_collections.ConfigDict()
  c.opt.lr = 3e-4  # OLMo-core pretrain-1
  c.opt.b1 = 0.9  # OLMo-core pretrain-1
  c.opt.b2 = 0.95  # OLMo-core pretrain-1
  c.opt.eps = 1e-8  # OLMo-core pretrain-1
  c.opt.weight_decay = 0.1  # OLMo-core pretrain-1, decoupled
  c.opt.no_decay = ('embed/.*',)  # OLMo-core: only embeddings excluded from decay
  c.opt.clip_grad_norm = 1.0  # OLMo-core pretrain-1: max_grad_norm
  c.opt.z_loss = 1e-5  # OLMo-core pretrain-1: z_loss_multiplier
  c.opt.loss_chunk = 1024  # tokens per logits chunk in the loss (memory, not math)
  c.opt.schedule = 'olmo3_stitched'  # olmo3_stitched | cosine | single_cosine | linear
  c.opt.warmup_steps = 2000  # OLMo-core pretrain-1: CosWithWarmup(warmup=2000)
  c.opt.final_lr = 3e-5  # OLMo-core pretrain-1: alpha_f = 0.1
  c.opt.t_max = 1_192_093  # OLMo-core pretrain-1: cosine horizon (part 1)
  c.opt.part2_start = 596_047  # OLMo-core pretrain-2: resumed from this step
  c.opt.part2_warmup = 597_046  # OLMo-core pretrain-2: HalfCosWithWarmup warmup
  c.opt.part2_t_max = 1_668_931  # OLMo-core pretrain-2: t_max
  c.opt.single_cosine_t_max = 1_413_814  # MaxText: one cosine over the whole epoch
  c.opt.skip_step = True  # OLMo-core SkipStepAdamW
  c.opt.skip_window = 128  # OLMo-core SkipStepOptimizer rolling_interval_length
  c.opt.skip_sigma = 6.0  # OLMo-core SkipStepOptimizer sigma_factor
  c.opt.skip_nonfinite = True  # ours: a NaN/inf loss or norm skips and stays out of the history

  c.train = ml_collections.ConfigDict()
  c.train.steps = 1_413_814  # one epoch of the stage-1 mix (N // 512)
  c.train.seed = 0  # parameter init (unused when starting from a converted checkpoint)
  c.train.init_from = ''  # checkpoint or HF directory for the step-0 weights
  c.train.micro_batch_size = 1  # instances per device per micro-batch (sets grad accumulation)
  c.train.mesh_data = 1  # data-parallel replicas (params replicated across them)
  c.train.mesh_fsdp = -1  # FSDP shards; -1 = all remaining devices
  c.train.mesh_tensor = 1  # tensor-parallel axis
  c.train.mesh_context = 1  # context-parallel axis: splits the sequence (stage 3: 8)
  # How the mesh meets the nodes (sharding.layout_for; docs/gpus.md#the-mesh). 'hsdp': the
  # state is sharded over mesh_fsdp devices (-1: one node) and replicated across the rest,
  # the shards inside a node, the replicas across nodes; 'fsdp': one mesh in device order.
  # 'auto' is OLMo-core pretrain-1's dp_config HSDP on GPUs (num_replicas = the nodes,
  # shard_degree = the 8 GPUs of a node: 64 replicas x 8 on 512 H100s) and 'fsdp' on TPUs,
  # whose slice is one interconnect (the settings above: every chip shards the state).
  c.train.mesh_layout = 'auto'
  c.train.log_every = 10  # OLMo-core: metrics every 10 steps
  c.train.ckpt_every = 1000  # OLMo-core pretrain-1: save_interval
  c.train.keep_last = 3  # committed checkpoints kept besides keep_every ones
  c.train.keep_every = 10_000  # permanently kept checkpoints (0 = none)
  c.train.eval_every = 1000  # held-out loss cadence (0 = never)
  # In-loop downstream evals (evaluation/in_loop.py; docs/evaluation.md): olmo_eval task
  # names, scored every downstream_eval_every steps and at the last step. OLMo-core's Olmo 3
  # scripts: with_recommended_evals(task_set='fast', eval_interval=1000), i.e. these 26
  # tasks (olmo_core/eval/task_groups.py FAST_TASKS, sorted) at the end of training too.
  # (The official pretrain-1 script runs the same 26 every 10,000 steps, and not at the end.)
  c.train.eval_tasks = FAST_TASKS
  c.train.downstream_eval_every = 1000  # OLMo-core with_recommended_evals: eval_interval
  # Rows of data.seq_len tokens per scoring forward, over all devices; 0: micro_batch_size
  # per batch shard (OLMo-core: eval_batch_spec = rank_microbatch_size tokens per rank).
  c.train.downstream_eval_batch_size = 0
  c.train.downstream_eval_limit = 0  # ours: only the first N documents per task (0: all)
  c.train.peak_flops = config_dict.placeholder(float)  # per-device peak override for MFU
  # JAX's persistent compilation cache (ours; goodput.compilation_cache, docs/goodput.md), so
  # a restart does not compile the train step, eval step and task scorer again. 'auto':
  # $JAX_COMPILATION_CACHE_DIR if set, else <workdir>/xla_cache for a local workdir and
  # $XDG_CACHE_HOME/olmo3_jax/<bucket tag>/xla_cache on each host for a bucket; a folder;
  # '' = off.
  c.train.compilation_cache_dir = 'auto'
  # A jax.profiler trace of the steps logged START..STOP, e.g. (5, 7), into <workdir>/profile
  # (ours, as OLMo-core's ProfilerCallback; monitor/profiler.py, docs/monitoring.md); () = off.
  c.train.profile_steps = ()
  c.train.profile_hosts = (0,)  # the processes that trace
  # Weights & Biases (monitor/tracking.py; pip install '.[wandb]'): the fields of
  # OLMo-core's WandBCallback.
  c.train.wandb = ml_collections.ConfigDict()
  c.train.wandb.project = ''  # WandBCallback.project; '' = W&B off
  c.train.wandb.entity = ''  # WandBCallback.entity (team); '' = the API key's default
  c.train.wandb.run_name = ''  # WandBCallback.name; '' = the workdir's basename
  c.train.wandb.group = ''  # WandBCallback.group
  c.train.wandb.tags = ()  # WandBCallback.tags
  c.train.wandb.mode = ''  # ours: wandb.init mode online | offline | disabled; '' = WANDB_MODE
  c.train.wandb.init_timeout = 60.0  # ours: seconds wandb.init may take (in the background)
  c.train.reset_step_on_init = False  # stage 2 sets True: keep moments, restart step and schedule
  c.train.allow_config_change = False  # ours: resume despite changed shapes/data/seeds (train.py)
  # The divergence guard (ours; train.DivergenceGuard). A run stops, keeping
  # its last healthy checkpoint, once its CE loss exceeds max_loss: ~2 ln(100352),
  # twice the loss of a uniform guess over the vocabulary (ln 8192 = 9.0 for
  # the small configs). The std-0.02 init starts near ln(V), and a healthy run
  # never climbs back to it, let alone twice it (its spikes are skipped or
  # recovered from well below), while destructive updates push the loss far past.
  c.train.max_loss = 23.0
  # ... or once this many steps in a row were skipped. A healthy run skips
  # isolated steps: a skipped spike enters the 128-step history and widens
  # its sigma, so the next steps pass; only a run that keeps producing NaNs or
  # ever-growing spikes skips 100 in a row.
  c.train.max_consecutive_skips = 100
  # Automatic rollback (ours; monitor/rollback.py, docs/rollback.md). When the guard trips, restore
  # the last healthy checkpoint, skip the global batches read since it (plus a margin) and
  # go on, at most this many times per run; 0 stops at the first trip (exit 4), as before.
  # On by default: a stopped 1,000-chip run costs more than a few skipped batches.
  c.train.rollback_attempts = 3
  # Global batches skipped after the trip step too. PaLM (Chowdhery et al. 2022, sec. 5.1)
  # restarted ~100 steps before a spike and skipped 200-500 batches; the restored
  # checkpoint here is up to ckpt_every steps back, so the window is already that long.
  c.train.rollback_margin = 100
  # States set aside by rollbacks (checkpoints/rolledback.step_N.<attempt>) kept for
  # inspection: the newest attempts' only. Each is a full train state (~84 GB at 7B),
  # and in a bucket setting one aside copies it, so 0 (delete them) is a sane choice there.
  c.train.keep_rolledback = 1
  # LR factor for the first rollback_lr_steps steps after a rollback (1.0: the schedule's).
  # Applied as a scale on the update, which for AdamW with decoupled decay is the LR's.
  c.train.rollback_lr_factor = 1.0
  c.train.rollback_lr_steps = 0
  # Global batches to skip from the start, as (start, stop) or (start, stop, lr_factor,
  # lr_steps): indices count batches across epochs ((epoch - 1) * batches_per_epoch + step),
  # [start, stop) is skipped, and lr_factor scales the LR of the lr_steps steps that first
  # read after the window. A rollback's windows (<workdir>/rollbacks.jsonl) add to these.
  c.train.skip_batches = ()
  # The data guards (ours; health.RepeatTracker, health.MemorizationWatch). The
  # seed's reproduction trained up to 0.22 nats below Ai2's loss with held-out
  # C4 tied: a loader bug repeated sequences and the model memorized them.
  c.train.track_repeats = True  # `data/repeated instances` per step: a bitmap of N bits (90 MB)
  c.train.memorization_threshold = 0.1  # nats the held-out minus train CE gap may widen ...
  c.train.memorization_evals = 3  # ... across this many evaluations before the warning fires
  return c
