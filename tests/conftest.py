import os

# One compile at a time per worker, in the worker: the two workers of `make test` already fill the two
# cores, and a compile pool per worker only adds its start-up and hand-offs (12% of a compile-bound
# module's time). Set before torch is imported, so that the subprocesses some tests start inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


def _link_with_gold():
    """Kernels link with gold where it is installed. A cold run builds about 560 kernels, each linked
    against libtorch, libtorch_cpu and libtorch_python: GNU ld (bfd) takes 0.45-0.5 s to read those, gold
    0.13-0.16 s, which is a fifth of a small kernel's build (docs/testing.md). gcc's collect2 looks for
    `ld` in COMPILER_PATH before its own; the subprocesses some tests start inherit it. Tests only: what
    a kernel does does not depend on its linker, and a user's machine may not have gold."""
    gold = shutil.which("ld.gold")
    if gold is None or "COMPILER_PATH" in os.environ:
        return
    linker_dir = tempfile.mkdtemp(prefix="mla-inductor-ld-")
    atexit.register(shutil.rmtree, linker_dir, ignore_errors=True)
    os.symlink(gold, os.path.join(linker_dir, "ld"))
    os.environ["COMPILER_PATH"] = linker_dir


_link_with_gold()

# Tests compare numerics, not speed: keep compiles deterministic and the thread count fixed. Under
# pytest-xdist (make test) the workers share the cores; one thread each keeps OpenMP from spinning on a
# core another worker needs. test_mla_decode compiles its template on two threads once.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // WORKERS)))
# Hermetic compiles: a cache hit from an earlier run would replay code without running MLAPass,
# and tests that count fusions would see none. test_record turns them on over a fresh cache directory
# to check what they serve.
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False


@pytest.fixture(autouse=True)
def _fresh_counts():
    import mla_inductor

    mla_inductor.reset_counts()
    yield


@pytest.fixture(autouse=True)
def _projection_rows_as_on_every_cpu(request, monkeypatch):
    """The pattern tests match prefill-sized graphs (8-64 rows), which fire on every CPU but one with
    AMX, where the cost model leaves plain projections above MAX_ROWS_AMX rows (quantized ones on our
    AMX tiles above MAX_ROWS_AMX_TILES) to oneDNN's AMX GEMMs (lowerings/segment_gemm.py). Lifted here
    so that they test the same matching on every CPU; tests marked amx_row_limit test the limits."""
    if request.node.get_closest_marker("amx_row_limit") is None:
        from mla_inductor.lowerings import segment_gemm

        monkeypatch.setattr(segment_gemm, "MAX_ROWS_AMX", 2**31)
        monkeypatch.setattr(segment_gemm, "MAX_ROWS_AMX_TILES", 2**31)


@pytest.fixture(autouse=True)
def _fp8_weight_routes_as_on_every_cpu(monkeypatch):
    """Frozen e4m3fn weights widen into fp32's bits unless they hold a NaN or, on a CPU whose FMAs are
    slow on subnormal operands (Intel's), a subnormal (segment_gemm.widens_to_fp32_bits). Tests assume
    AMD's rule, so that they compile the same kernels on every CPU; those that test Intel's say so."""
    from mla_inductor import isa

    monkeypatch.setattr(isa, "slow_subnormal_inputs", lambda: False)


def pytest_sessionstart(session):
    """Stops before any test where `torch._int_mm` multiplies wrongly: oneDNN held to plain AVX2 on an
    AVX-512 CPU does (docs/testing.md), and the W8A8 tests would fail by the dozen for oneDNN's reason,
    not ours. The process that schedules (or, without xdist, runs) the tests checks once."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    generator = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (8, 64), dtype=torch.int8, generator=generator)
    b = torch.randint(-127, 128, (64, 48), dtype=torch.int8, generator=generator)
    if not torch.equal(torch._int_mm(a, b), a.int() @ b.int()):
        held = os.environ.get("ONEDNN_MAX_CPU_ISA", "unset")
        pytest.exit(f"torch._int_mm returns wrong products here (ONEDNN_MAX_CPU_ISA={held}): to play an AVX2 "
                    "CPU, hold oneDNN at AVX2_VNNI where the CPU has AVX-VNNI, else at AVX512_CORE_VNNI "
                    "(docs/testing.md)", returncode=4)
