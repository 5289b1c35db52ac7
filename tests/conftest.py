import os

# Before anything imports Triton: triton.language's own helpers are made for the interpreter only
# if it is on when Triton is first imported, and importing torch._dynamo (as transformers' modeling
# modules do) imports Triton. The kernel tests run on the CPU under the interpreter; the choice of
# kernels on CPU tensors does not depend on it (Triton is chosen automatically on CUDA only).
os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from hf_pairs import make_pair  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# ZOO_TEST_THREADS=N runs every test on N threads (the one_thread fixture included), so that the
# float tolerances are seen to hold at more than one thread count: the README's test command runs
# the suite under pytest-xdist at one thread per worker, then the parity tests again at 2 threads.
# Without it, under pytest-xdist each worker gets one thread: more oversubscribes the 2-core CI
# machine (tiny-model tests run ~10x slower with 2 threads per worker on 2 cores).
FORCED_THREADS = int(os.environ["ZOO_TEST_THREADS"]) if os.environ.get("ZOO_TEST_THREADS") else None
torch.set_num_threads(FORCED_THREADS or (1 if os.environ.get("PYTEST_XDIST_WORKER")
                                         else max(1, min(2, os.cpu_count() or 1))))


def pytest_report_header(config):
    return f"torch threads: {torch.get_num_threads()}" + (" (ZOO_TEST_THREADS)" if FORCED_THREADS else "")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread (and CI runs two workers on two cores); under
    ZOO_TEST_THREADS the count it names."""
    n = torch.get_num_threads()
    torch.set_num_threads(FORCED_THREADS or 1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """``hf_pair(model_type, std=0.25, **overrides) -> HfPair(hf, zoo, path)``: a tiny transformers
    checkpoint of ``model_type`` (its format's tiny config with ``overrides``, weights moved by
    N(0, ``std``)), saved by transformers and loaded by zoo (tests/hf_pairs.py ``make_pair``); made
    the first time a module asks for it and shared by that module's tests."""
    made = {}

    def get(model_type: str, *, std: float = 0.25, **overrides):
        key = (model_type, std, json.dumps(overrides, sort_keys=True))
        if key not in made:
            made[key] = make_pair(tmp_path_factory.mktemp(model_type), model_type, std=std, **overrides)
        return made[key]

    return get
