"""The record of fusions: the package imports without cycles, and fusion_counts() says the same whether
Inductor compiled the graph or served it from its caches."""

import ast
import pathlib

import torch
import transformers
from torch._dynamo.utils import counters
from torch._inductor.codecache import PyCodeCache
from torch._inductor.utils import clear_caches, fresh_cache

import mla_inductor

PACKAGE_DIR = pathlib.Path(mla_inductor.__file__).parent


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports() -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its body (functions included, so that an
    import moved into a function to hide a cycle still counts)."""
    modules = {module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                for alias in node.names:
                    # `from pkg import mod` imports the submodule; `from pkg import name` runs pkg/__init__
                    target = f"{base}.{alias.name}"
                    edges.add(target if target in modules else base)
        graph[name] = {m for m in edges if m in modules and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for succ in sorted(graph[node]):
            if state.get(succ) == "open":
                return stack[stack.index(succ):] + [succ]
            if succ not in state and (cycle := visit(succ)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_imports_without_cycles():
    graph = package_imports()
    # A package's __init__ imports its modules; a module importing a name from its own package's
    # __init__ would close a loop, and so would any of the layers importing upwards.
    assert graph["mla_inductor.explain"] >= {"mla_inductor.backend", "mla_inductor.record"}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_layers_read_one_way():
    graph = package_imports()
    below = {"mla_inductor.record": {"mla_inductor.config"}}
    assert graph["mla_inductor.record"] <= below["mla_inductor.record"]
    upper = {"mla_inductor.backend", "mla_inductor.explain", "mla_inductor.report", "mla_inductor.passes"}
    for name, edges in graph.items():
        if name.startswith(("mla_inductor.patterns", "mla_inductor.lowerings", "mla_inductor.ops")):
            assert not edges & upper, f"{name} imports {edges & upper}"


def compile_and_count(model) -> dict:
    """Compiles one decode of `model` after a reset of Dynamo, of the counts and of Inductor's in-memory
    caches (the compiled modules and kernels among them), as in a new process: only Inductor's on-disk
    caches are left to serve it. Returns the fusion counts, the cache hits and whether the compiled
    modules hold our GEMM kernel."""
    torch._dynamo.reset()
    clear_caches()
    counters.clear()
    mla_inductor.reset_counts()
    with torch.no_grad():
        torch.compile(model, backend="mla_inductor")(torch.arange(4)[None])  # few rows: gqa_qkv fires on every CPU
    sources = [pathlib.Path(m.__file__).read_text() for m in PyCodeCache.modules]
    return {"fusions": mla_inductor.fusion_counts(),
            "cache_hits": counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"],
            "kernel": any("mi::nt_task" in s for s in sources)}


def test_fusion_counts_are_the_same_when_inductor_serves_the_compile_from_its_cache():
    """A compile served by the FX-graph cache: the pass does not run again, the cached module carries its
    rewrite (our GEMM kernel), and the counts are replayed with it. One decoder layer of transformers'
    Llama (fires rope and gqa_qkv), compiled twice over a fresh cache directory with the caches that
    conftest turns off turned on; nothing of the first compile but the on-disk caches is left for the
    second. (In this process: a new one would pay the imports and the patterns' registration again.)"""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with (fresh_cache(), torch._inductor.config.patch(fx_graph_cache=True, force_disable_caches=False),
          torch._functorch.config.patch(enable_autograd_cache=True)):
        compiled = compile_and_count(model)
        served = compile_and_count(model)
    assert compiled["cache_hits"] == 0 and served["cache_hits"] > 0, (compiled, served)
    assert compiled["fusions"]["rope"] > 0 and compiled["fusions"]["gqa_qkv"] > 0, compiled
    assert served["fusions"] == compiled["fusions"]
    assert compiled["kernel"] and served["kernel"]


def test_the_fx_graph_cache_key_follows_the_package_sources_under_the_stock_backend(monkeypatch):
    """A graph that calls mla:: ops under the stock `inductor` backend has no MLAPass in its compile, and
    Inductor's FX-graph cache does not key on registered lowerings: importing the package installs
    SourceKey, so an edited template (another source_hash) is another key, never the old C++."""
    import torch
    from torch._inductor.codecache import compiled_fx_graph_hash

    from mla_inductor import passes

    assert isinstance(torch._inductor.config.post_grad_custom_pre_pass, passes.SourceKey)
    graph = torch.fx.symbolic_trace(lambda x: x * 2)
    key = lambda: compiled_fx_graph_hash(graph, [torch.ones(4)], {}, [])[0]  # noqa: E731
    before = key()
    monkeypatch.setattr(passes, "source_hash", lambda: "an edited template")
    assert key() != before
    monkeypatch.undo()
    assert key() == before
