import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """One tiny random HF model per architecture, built once per test session."""
    from hf_models import ARCHS, build_model

    root = tmp_path_factory.mktemp("models")
    return {arch: (root / arch, build_model(arch, root / arch)) for arch in ARCHS}
