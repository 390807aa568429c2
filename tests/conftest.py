import importlib.util
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# scripts/gpu_check.sh runs the unit tests with EMAPG_TEST_DEVICE=cuda: every tensor a test makes
# without naming a device is then made on the GPU.
if os.environ.get("EMAPG_TEST_DEVICE"):
    import torch

    torch.set_default_device(os.environ["EMAPG_TEST_DEVICE"])


@pytest.fixture
def bench_module(monkeypatch):
    """Import a script of bench/ by name (bench/ is not a package): ``bench_module("study_records")``; bench/
    is on the path while the test runs, as it is for ``python bench/NAME.py`` (the scripts share _common)."""
    monkeypatch.syspath_prepend(str(BENCH))

    def load(name):
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # a dataclass looks its module up there
        spec.loader.exec_module(module)
        return module

    return load
