import os

import pytest
import torch

# The Triton kernel runs on CPU tensors through the interpreter; it must be switched on before triton.jit runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The longest files first: pytest-xdist hands each worker whole files in the order collected, and the suite ends when
# the last one does (a long file started last would run alone on one worker at the end).
LONGEST_FIRST = (
    "test_integrations.py",
    "test_packaging.py",
    "test_repartition.py",
    "test_checkpoint.py",
    "test_examples.py",
    "test_release.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["vector", "portable"])
def loops(request):
    """The explicit vector loops (where this CPU and build have them), then the portable loops, on the same CPU."""
    import lightning_pure_bf16.ops.update_cpu as update_cpu  # here: the Triton interpreter is switched on above first

    assert update_cpu.fused_cpu_available()
    has_vector = update_cpu._extension.use_vector_loops(request.param == "vector")
    if request.param == "vector" and not has_vector:
        pytest.skip("this build has no explicit vector loops for this CPU (the portable loops are tested)")
    yield request.param
    update_cpu._extension.use_vector_loops(True)
