"""Test setup: 8 simulated CPU devices, the CPU platform and the run's XLA flags (set
before JAX is imported), one OpenBLAS thread, strict ranks, rarer cyclic collections, one
persistent compilation cache for the whole run, and the tests' Python children forked by
tests/zygote.py."""

import gc
import json
import os
import sys

from xla_flags import TEST_FLAGS

# Subprocesses inherit these; a caller's own XLA_FLAGS come last and win.
os.environ['XLA_FLAGS'] = (f"--xla_force_host_platform_device_count=8 {TEST_FLAGS} "
                           f"{os.environ.get('XLA_FLAGS', '')}").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Every process of the run on the CPU by name: unset, JAX in each child would also look for
# TPU chips (libtpu is in the test extra), and the children that name it (the trainers'
# environment) and those that do not could not share a zygote (tests/zygote.py).
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# One OpenBLAS thread per process (numpy's, read when numpy loads): the two xdist workers
# already fill the two cores, and idle BLAS threads spinning cost each JAX child ~6% of
# its CPU (paired runs of a tiny train.py; docs/results/tests.md).
os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')

import jax  # noqa: E402  (must follow the XLA_FLAGS line)
import pytest  # noqa: E402

import zygote  # noqa: E402
from kernels import xla  # noqa: E402

# The test extra installs libtpu (tests/test_tpu_compile.py); on this TPU-less machine it
# would print its metadata-server warnings in every process that starts a backend.
xla.quiet_libtpu()

jax.config.update('jax_numpy_rank_promotion', 'raise')
# Tracing makes objects by the hundred thousand and frees them by reference count; at
# Python's default (a young collection every 700 net allocations) the collector's passes
# cost the in-process tests ~8% of their time (tests/test_kernels.py and test_model.py:
# 133 s -> 123 s, one run each). Rarer young collections keep cycles bounded all the same.
gc.set_threshold(100_000, 50, 100)


@pytest.fixture(scope='session', autouse=True)
def compilation_cache(tmp_path_factory):
  """Many tests compile the same programs (the tiny model's step in-process and in every
  train.py subprocess): compile each once per run. The cache folder is new for each
  run and shared by the xdist workers and every subprocess (through the environment)."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    root = root.parent  # <run>/popen-gwN: the run's folder is common to the workers
  directory = root / 'jax_cache'
  directory.mkdir(exist_ok=True)
  names = ('jax_compilation_cache_dir', 'jax_persistent_cache_min_compile_time_secs')
  saved = {name: getattr(jax.config, name) for name in names}
  jax.config.update(names[0], str(directory))
  jax.config.update(names[1], 0.0)
  with pytest.MonkeyPatch.context() as env:
    env.setenv('JAX_COMPILATION_CACHE_DIR', str(directory))
    env.setenv('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
    yield directory
  for name, value in saved.items():
    jax.config.update(name, value)


# `-n 2 --dist loadfile` hands each xdist worker whole files, in collection
# order (pyproject's `--no-loadscope-reorder`; xdist would otherwise order them
# by test count, which put the few-but-long multi-process files last, where one
# worker ran them alone). Longest first, so both workers finish together: ordered by
# each file's setup + call + teardown seconds in a full `--durations=0` run (from 444 s
# for test_tpu_compile.py down; the machine was also running other tests, so only the
# order counts). Files not listed follow in their usual order.
LONGEST_FIRST = ('test_tpu_compile.py', 'test_storage_e2e.py', 'test_rollback.py',
                 'test_kernels.py', 'test_context_parallel.py', 'test_launch.py',
                 'test_eval.py', 'test_storage_faults_exit.py', 'test_own_text.py',
                 'test_multihost.py', 'test_olmo_core_ckpt.py', 'test_reproduce.py',
                 'test_train.py', 'test_model.py', 'test_rollback_multihost.py',
                 'test_in_loop_eval.py', 'test_faults.py', 'test_device_check.py',
                 'test_plan.py', 'test_gpu_cluster.py', 'test_kernels_gpu.py',
                 'test_goodput.py', 'test_location_flags.py', 'test_storage.py',
                 'test_tracking.py', 'test_held_out_multihost.py', 'test_long_context.py',
                 'test_deploy.py', 'test_remote_data.py', 'test_audit.py', 'test_loss.py',
                 'test_bench_gpu_step.py', 'test_bench_run.py', 'test_optim.py',
                 'test_checkpoint.py', 'test_prepare_data.py', 'test_fetch_data.py',
                 'test_stop_signals.py', 'test_convert.py', 'test_profile.py',
                 'test_run_messages.py', 'test_download.py', 'test_token_files.py',
                 'test_events.py', 'test_sample.py', 'test_data.py', 'test_offload.py')


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file


# Python children through a fork server (tests/zygote.py): each skips ~1.1 CPU-seconds of
# imports. Not in xdist's controller: it starts the workers themselves with `python -c`.
def pytest_configure(config):
  if hasattr(config, 'workerinput') or not config.getoption('numprocesses', None):
    zygote.install()


@pytest.fixture(autouse=True)
def _fresh_interpreter(request):
  """A test marked `fresh_interpreter` starts its children as new processes."""
  zygote.PAUSED[0] = request.node.get_closest_marker('fresh_interpreter') is not None
  yield
  zygote.PAUSED[0] = False


def pytest_sessionfinish(session):
  if hasattr(session.config, 'workerinput'):
    session.config.workeroutput['zygote'] = json.dumps(zygote.STATS)


@pytest.hookimpl(optionalhook=True)  # xdist's hook
def pytest_testnodedown(node, error):  # the controller: a worker's counts
  for key, value in json.loads(node.workeroutput.get('zygote', '{}')).items():
    zygote.STATS[key] += value


def pytest_terminal_summary(terminalreporter):
  if zygote.STATS['forked'] or zygote.STATS['afresh']:
    terminalreporter.write_line('Python children: {forked} forked by {zygotes} zygotes, '
                                '{afresh} started afresh (tests/zygote.py).'
                                .format(**zygote.STATS))
