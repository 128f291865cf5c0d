"""What the role contract suites run against: one fixture per role, parametrised over
the backends that implement it. A backend joins a suite by adding its parameter here
(the SGLang adapter against its fake server, Megatron on CPU); the suites are the
definition of a backend.
"""

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator

import anyio
import msgspec
import pytest

torch = pytest.importorskip("torch")

from dynarl.api.config import InferenceConfig, ModelConfig, RolloutConfig  # noqa: E402
from dynarl.testing.sinks import RecordingSink  # noqa: E402
from dynarl.workers import backends  # noqa: E402
from dynarl.workers.inference import InferenceEngine  # noqa: E402
from dynarl.workers.protocol import InferenceRole, RolloutRole  # noqa: E402
from dynarl.workers.rollout import RolloutEngine  # noqa: E402

MODEL = ModelConfig(max_seq_len=128)
"""The tiny random-init policy every backend serves (seed 0)."""

ROLLOUT_BACKENDS = ["torch", "sglang"]
INFERENCE_BACKENDS = ["torch", "megatron"]


NOT_APPLICABLE: dict[tuple[str, str], str] = {}
"""Contract tests a backend cannot take as written, and where it is tested instead."""

__all__ = ["RecordingSink"]  # the suites' sink, shared with the backends' own tests


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        callspec = getattr(item, "callspec", None)
        backend = callspec.params.get("rollout_factory") if callspec else None
        reason = NOT_APPLICABLE.get((getattr(item, "originalname", ""), backend))
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session", autouse=True)
def one_thread() -> Iterator[None]:
    """Run like a CPU device slot (one torch thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


RolloutFactory = Callable[[], contextlib.AbstractAsyncContextManager[RolloutEngine]]
InferenceFactory = Callable[..., InferenceEngine]


@pytest.fixture(params=ROLLOUT_BACKENDS)
def rollout_factory(request: pytest.FixtureRequest) -> RolloutFactory:
    """Opens a running rollout engine of the backend (``async with factory() as e``)."""
    section = RolloutConfig(backend=request.param, max_running_requests=16)

    @contextlib.asynccontextmanager
    async def open_engine() -> AsyncIterator[RolloutEngine]:
        async with contextlib.AsyncExitStack() as stack:
            rollout = section
            if request.param == "sglang":  # the adapter on a fake server of its own
                from dynarl.testing.fake_sglang import FakeSGLang
                from dynarl.workers.sglang.config import SGLangConfig

                fake = stack.enter_context(FakeSGLang(MODEL, max_running_requests=16))
                rollout = msgspec.structs.replace(section, sglang=SGLangConfig(urls=(fake.url,)))
            role = RolloutRole(model=MODEL, rollout=rollout)
            backend = backends.rollout_backend(rollout)
            engine = await anyio.to_thread.run_sync(
                lambda: backend.build_rollout(role, name="contract", num_threads=1)
            )
            yield await stack.enter_async_context(_running(engine))

    return open_engine


@contextlib.asynccontextmanager
async def _running(engine: RolloutEngine) -> AsyncIterator[RolloutEngine]:
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        try:
            yield engine
        finally:
            tg.cancel_scope.cancel()


@pytest.fixture(params=INFERENCE_BACKENDS)
def inference_factory(request: pytest.FixtureRequest) -> InferenceFactory:
    """Builds an inference worker of the backend (``factory(compute_ref_logprobs=...)``)."""

    if request.param == "megatron":
        pytest.importorskip("megatron.core")

    def build(*, compute_ref_logprobs: bool = False) -> InferenceEngine:
        section = InferenceConfig(
            backend=request.param, micro_batch_size=4, compute_ref_logprobs=compute_ref_logprobs
        )
        role = InferenceRole(model=MODEL, inference=section)
        backend = backends.inference_backend(section)
        return backend.build_inference(role, name="contract", num_threads=1)

    return build
