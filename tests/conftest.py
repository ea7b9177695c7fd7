import os
import pathlib
import sys

import pytest
import torch

# Without a GPU, Triton kernels run through Triton's CPU interpreter. It must be chosen
# before any module defines or launches a kernel, so here, before the tests are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from tiny_models import save_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> pathlib.Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> pathlib.Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=1)


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind():
    """Fail the suite if it leaves a hetero-prefixed segment in /dev/shm.

    Segments that existed before the session, and live segments of other processes (a
    parallel run), are not this suite's leftovers.
    """
    import os

    from ipc.liveness import process_alive
    from ipc.segment import SHM_DIR, owner_pid_of

    def hetero_segments() -> set[str]:
        return {name for name in os.listdir(SHM_DIR) if name.startswith("hetero")}

    def left_by_this_run(name: str) -> bool:
        owner = owner_pid_of(name)
        return owner is None or owner == os.getpid() or not process_alive(owner)

    before = hetero_segments()
    yield
    left = sorted(name for name in hetero_segments() - before if left_by_this_run(name))
    assert not left, f"shared-memory segments left in {SHM_DIR}: {left}"
