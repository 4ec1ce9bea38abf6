"""Helpers for the fusion tests: graphs after MLAPass, a decode step of the serving model, and tiny
transformers GQA models."""

import functools

import torch
import transformers
from torch._inductor.custom_graph_pass import CustomGraphPass

import mla_inductor
from mla_inductor.passes import MLAPass


class GraphCaptured(Exception):
    """Raised by a Capture that ends the compile: a test that reads only the rewritten graph needs no
    lowering, scheduling or C++ build (8 kernel builds for a tiny transformers model)."""


class Capture(CustomGraphPass):
    """Records the graph it sees, as compact text: one call per line, placeholders by position; then
    ends the compile if `stop`."""

    def __init__(self, stop=False):
        self.graphs = []
        self.stop = stop

    def __call__(self, graph):
        self.graphs.append(format_graph(graph))
        if self.stop:
            raise GraphCaptured

    def uuid(self):
        return None  # never cached: tests must see the pass run


def format_graph(graph: torch.fx.Graph) -> str:
    lines = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        target = str(node.target).replace("aten.", "").replace(".default", "")
        args = ", ".join(_fmt(a) for a in node.args)
        # Our ops' optional arguments, and attention's mask and scale.
        if (str(node.target).startswith("mla.") or "scaled_dot_product" in str(node.target)) and node.kwargs:
            args += "".join(f", {k}={_fmt(v)}" for k, v in node.kwargs.items())
        lines.append(f"{node.name} = {target}({args})")
    return "\n".join(lines)


def _fmt(arg):
    if isinstance(arg, (list, tuple)):
        return "[" + ", ".join(_fmt(a) for a in arg) + "]"
    if isinstance(arg, float):
        return repr(arg)
    return str(arg)


def _compile_with_capture(fn, args, capture, stage, freezing, dynamic, own_options):
    slot = "joint_custom_post_pass" if stage == "joint" else "post_grad_custom_post_pass"
    options = {slot: [MLAPass(stage, mla_inductor.config.Config.from_options(own_options)), capture]}
    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(freezing=freezing, fx_graph_cache=False):
        return torch.compile(fn, options=options, dynamic=dynamic)(*args)


def rewritten_and_run(fn, *args, stage="joint", freezing=False, dynamic=False, **own_options):
    """Compile fn with MLAPass in `stage` followed by a capture and run it once: (the captured graph
    text, the compiled fn's result). One compile serves a test that checks both."""
    capture = Capture()
    result = _compile_with_capture(fn, args, capture, stage, freezing, dynamic, own_options)
    return capture.graphs[0], result


def rewritten(fn, *args, stage="joint", freezing=False, dynamic=False, **own_options):
    """The graph text of `rewritten_and_run`, from a compile that ends there: nothing is lowered or built."""
    capture = Capture(stop=True)
    try:
        _compile_with_capture(fn, args, capture, stage, freezing, dynamic, own_options)
    except torch._dynamo.exc.BackendCompilerFailed as failed:
        if not isinstance(failed.inner_exception, GraphCaptured):
            raise
    return capture.graphs[0]


def serving_model_decode(num_layers, seq_lens, dynamic=False, freezing=False):
    """One decode step of a tiny bf16 serving model (models/mla.py) whose paged caches hold noise, for
    requests of `seq_lens`, run eagerly and through the mla_inductor backend: (eager, compiled) logits."""
    from mla_inductor.models import build_model, get_config, make_block_tables

    model = build_model(get_config("tiny", num_layers=num_layers), dtype=torch.bfloat16).eval()
    block_tables, num_blocks = make_block_tables(len(seq_lens), 40, 16)
    caches = model.allocate_kv_cache(num_blocks, 16)
    for c in caches:
        c.normal_()
    ids, lens = torch.arange(5, 5 + 2 * len(seq_lens), 2), torch.tensor(seq_lens)
    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(freezing=freezing):
        expected = model.forward_decode(ids, [c.clone() for c in caches], block_tables, lens)
        compiled = torch.compile(model.forward_decode, backend="mla_inductor", dynamic=dynamic)
        return expected, compiled(ids, caches, block_tables, lens)


def greedy(model, cache, prompt, steps, step_fn=None):
    """Greedy decoding of a transformers model after an eager prefill into `cache`; `step_fn(ids, pos)`
    (default: the model, eagerly) runs each step. Returns the tokens and each step's logits."""
    step_fn = step_fn or (lambda ids, pos: model(input_ids=ids, past_key_values=cache, position_ids=pos).logits)
    with torch.no_grad():
        token = model(input_ids=prompt, past_key_values=cache).logits[:, -1:].argmax(-1)
        tokens, logits = [token], []
        for i in range(steps):
            out = step_fn(token, torch.full_like(token, prompt.shape[1] + i))
            token = out[:, -1:].argmax(-1)
            tokens.append(token)
            logits.append(out)
    return torch.cat(tokens, 1), torch.stack(logits)


def tiny_gqa_model(arch, dtype, layers=2):
    """A tiny transformers Llama, Qwen2 (q/k/v with bias) or Qwen3 (a norm per q and k head): 4 query heads
    over 2 key/value heads of 24."""
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    config = config_cls(vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=128)
    torch.manual_seed(0)
    return model_cls(config).to(dtype).eval()


@functools.cache
def static_cache_greedy_decode(arch, freezing, steps=16):
    """compiled_greedy_decode of a tiny fp32 `tiny_gqa_model`, compiled once per process and shared by the
    tests of every fusion that fires there."""
    return compiled_greedy_decode(tiny_gqa_model(arch, torch.float32), freezing, steps)


def compiled_greedy_decode(model, freezing, steps):
    """Greedy decoding of a transformers model with a StaticCache after an eager prefill of two prompts of
    6 tokens, eagerly and through the mla_inductor backend. Returns the compile's fusion counts and
    (eager, compiled) tokens and logits."""
    prompt = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    make_cache = lambda: transformers.StaticCache(config=model.config, max_cache_len=32)  # noqa: E731
    torch._dynamo.reset()
    mla_inductor.reset_counts()
    expected = greedy(model, make_cache(), prompt, steps)
    cache = make_cache()
    compiled = torch.compile(lambda ids, pos: model(input_ids=ids, past_key_values=cache, position_ids=pos).logits,
                             backend="mla_inductor")
    with torch._inductor.config.patch(freezing=freezing):  # read while tracing: the first call
        actual = greedy(model, cache, prompt, steps, compiled)
    return mla_inductor.fusion_counts(), expected, actual


def rewrite_and_run(fn, *args, dynamic=None):
    """Trace fn as Inductor does (AOTAutograd with Inductor's decompositions), run MLAPass's stages on
    Dynamo's graph and on the forward graph and run that graph eagerly (our ops' references): the output
    and the record of what fired and what was declined. No C++ is built, so a corpus of spellings stays
    cheap; the templates are tested on their own and by the compiled models. `dynamic` as torch.compile's."""
    from mla_inductor import record

    start = record.event_count()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fn, backend=_rewriting_backend(inductor_joint_passes=False), dynamic=dynamic)(*args)
    return out, record.events_since(start)


def _rewriting_backend(inductor_joint_passes: bool):
    """A torch.compile backend that runs MLAPass's stages where compile_fx runs them (pre-grad on Dynamo's
    graph, then joint and post-grad on AOT's forward graph) and the rewritten graph eagerly, on our ops'
    references; with `inductor_joint_passes`, after Inductor's own joint-graph passes (constant folding,
    no-op removal), which the traced decode patterns expect. The last forward graph is kept as
    rewrite_and_run.graph, for tests of what it held."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.fx_passes.post_grad import view_to_reshape

    def forward(gm, example_inputs):
        rewrite_and_run.graph = gm.graph
        if inductor_joint_passes:
            with torch._inductor.config.patch(joint_custom_post_pass=MLAPass("joint")):
                joint_graph_passes(gm)
        else:
            MLAPass("joint")(gm.graph)
        view_to_reshape(gm)
        MLAPass("post_grad")(gm.graph)
        gm.recompile()
        return gm

    def backend(gm, example_inputs):
        MLAPass("pre_grad")(gm.graph)
        gm.recompile()
        return aot_autograd(fw_compiler=forward, decompositions=select_decomp_table())(gm, example_inputs)

    return backend


def has_dynamic_sizes(graph: torch.fx.Graph) -> bool:
    return any(isinstance(n.meta.get("val"), torch.SymInt) for n in graph.nodes if n.op == "placeholder")


def fired(events, fusion):
    return sum(1 for e in events if e.fusion == fusion and e.fired)


def declined(events, fusion):
    return [e.reason for e in events if e.fusion == fusion and not e.fired]


# What fires in a real compile, without building any C++ (Inductor's joint-graph passes, then ours).
inductor_passes_backend = _rewriting_backend(inductor_joint_passes=True)
