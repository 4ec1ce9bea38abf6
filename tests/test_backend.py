"""The backend, its options, the pass installation and the uuid (the FX-graph cache across processes: test_record.py)."""

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

import mla_inductor
from mla_inductor import isa, passes
from mla_inductor.backend import install_passes, split_options
from mla_inductor.config import Config


def run_python(code: str, env=None) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


class RecordingPass(CustomGraphPass):
    def __init__(self):
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return "recording-pass"


def test_backend_found_by_entry_point_without_import():
    """torch.compile(backend="mla_inductor") resolves the name as Dynamo does, through the package's
    entry point, in a process that never imported it (compiling with it: every other test)."""
    out = run_python(
        """
        import sys, torch
        assert "mla_inductor" not in sys.modules
        backend = torch._dynamo.lookup_backend("mla_inductor")
        print(backend.__module__, "mla_inductor" in sys.modules)
        """
    )
    assert out.split() == ["mla_inductor.backend", "True"]


def test_options_split_own_keys_from_inductor_keys():
    inductor, config = split_options({"mla_inductor.fusions": {"rope": False}, "freezing": False})
    assert inductor == {"freezing": False}
    assert not config.enabled("rope") and config.enabled("qkv_a_proj")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"mla_inductor.fusions": {"ropee": False}}, "unknown fusion 'ropee'"),
        ({"mla_inductor.fussions": {}}, "unknown option mla_inductor.fussions"),
        ({"mla_inductor.fusions": ["rope"]}, "must be a dict"),
    ],
)
def test_bad_own_options_name_the_key(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        split_options(options)


def test_passes_are_appended_to_user_passes_not_replacing_them():
    user = RecordingPass()
    patches = install_passes({"post_grad_custom_post_pass": user}, Config())
    post, joint = patches["post_grad_custom_post_pass"], patches["joint_custom_post_pass"]
    assert post[0] is user and isinstance(post[1], mla_inductor.MLAPass) and post[1].stage == "post_grad"
    assert len(joint) == 1 and joint[0].stage == "joint"


def test_backend_runs_user_pass_and_ours_with_mode_and_options(monkeypatch):
    seen = []
    monkeypatch.setattr(passes.MLAPass, "__call__", lambda self, graph: seen.append(self.stage))
    user = RecordingPass()
    f = torch.compile(
        lambda x: torch.relu(x) + 1,
        backend="mla_inductor",
        mode="max-autotune-no-cudagraphs",
        options=None,
    )
    x = torch.randn(4, 4)
    torch.testing.assert_close(f(x), torch.relu(x) + 1)
    assert sorted(seen) == ["joint", "post_grad", "pre_grad"]

    seen.clear()
    torch._dynamo.reset()
    g = torch.compile(
        lambda x: torch.relu(x) * 3,
        backend="mla_inductor",
        options={"post_grad_custom_post_pass": user, "mla_inductor.fusions": {"rope": False}},
    )
    torch.testing.assert_close(g(x), torch.relu(x) * 3)
    assert user.calls == 1 and sorted(seen) == ["joint", "post_grad", "pre_grad"]


def test_inductor_options_give_the_stock_backend_our_passes(monkeypatch):
    seen = []
    monkeypatch.setattr(passes.MLAPass, "__call__", lambda self, graph: seen.append(self.stage))
    options = mla_inductor.inductor_options(fusions={"rope": False})
    assert set(options) == {"pre_grad_custom_pass", "joint_custom_post_pass", "post_grad_custom_post_pass"}
    f = torch.compile(lambda x: torch.cos(x) - 1, options=options)
    x = torch.randn(5)
    torch.testing.assert_close(f(x), torch.cos(x) - 1)
    assert sorted(seen) == ["joint", "post_grad", "pre_grad"]


class TwoLinears(torch.nn.Module):
    """Two projections of one input, as Inductor's concat-linear folds them under freezing."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 48, bias=False), torch.nn.Linear(64, 80, bias=False)

    def forward(self, x):
        return self.a(x), self.b(x)


def test_concat_linear_kept_only_where_bf16_gemms_are_native():
    """Without a native bf16 GEMM the concatenated [K, N] bf16 weight runs ATen's scalar fallback
    (~80x slower), so the backend leaves those linears apart there; elsewhere the option holds. (With
    the linear fusion on, such linears are mla::linear there and no concatenation sees them.)"""
    module = TwoLinears().to(torch.bfloat16).eval()
    x = torch.randn(3, 64).to(torch.bfloat16)
    options = {"freezing": True, "cpp.enable_concat_linear": True}
    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(options):
        compiled = torch.compile(module, backend="mla_inductor",
                                 options={**options, "mla_inductor.fusions": {"linear": False}})
        (a, b), (code,) = run_and_get_code(compiled, x)
    # calls only: the generated code also names the mkldnn op in its output's assert_size_stride lines
    gemms = code.count("extern_kernels.mm(") + code.count("torch.ops.mkldnn._linear_pointwise.default(")
    assert gemms == (1 if isa.native_bf16_gemm() else 2)
    torch.testing.assert_close((a, b), module(x), atol=1e-2, rtol=1e-2)


def test_uuid_covers_sources_version_and_config(tmp_path, monkeypatch):
    copy = tmp_path / "mla_inductor"
    shutil.copytree(pathlib.Path(mla_inductor.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(passes, "_PACKAGE_DIR", copy)
    mla_pass = mla_inductor.MLAPass("post_grad")
    before = mla_pass.uuid()
    assert mla_pass.uuid() == before  # stable

    template = copy / "lowerings" / "templates" / "probe.h"
    template.write_text("// v1\n")
    with_template = mla_pass.uuid()
    template.write_text("// v2\n")
    assert len({before, with_template, mla_pass.uuid()}) == 3

    assert mla_inductor.MLAPass("post_grad", Config.from_options({"fusions": {"rope": False}})).uuid() != mla_pass.uuid()
    assert mla_inductor.MLAPass("joint").uuid() != mla_pass.uuid()
    monkeypatch.setattr(mla_inductor.config, "VERSION", "0.0.0-test")
    assert "0.0.0-test" in mla_pass.uuid()


class _InferenceModeForward(torch.nn.Module):
    """A forward decorated as DeepSeek's reference `Transformer.forward` is: it slices a buffer made
    outside inference mode, which stock torch.compile on torch 2.13 cannot trace."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("freqs", torch.randn(32, 8), persistent=False)

    @torch.inference_mode()
    def forward(self, x, start_pos: int):
        return self.proj(x) * self.freqs[start_pos : start_pos + x.shape[1]]


@pytest.mark.parametrize("grad_enabled", [True, False])
def test_inference_mode_forward_compiles_and_keeps_grad_mode(grad_enabled):
    torch._dynamo.reset()
    module, x = _InferenceModeForward(), torch.randn(2, 4, 8)
    with torch.set_grad_enabled(grad_enabled):
        out = torch.compile(module, backend="mla_inductor")(x, 3)
        assert torch.is_grad_enabled() == grad_enabled  # the region's end restores the caller's mode
    assert not out.requires_grad
    torch.testing.assert_close(out, module(x, 3))
