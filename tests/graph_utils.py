"""Helpers to look at graphs after MLAPass, for expecttest."""

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import mla_inductor
from mla_inductor.passes import MLAPass


class Capture(CustomGraphPass):
    """Records the graph it sees, as compact text: one call per line, placeholders by position."""

    def __init__(self):
        self.graphs = []

    def __call__(self, graph):
        self.graphs.append(format_graph(graph))

    def uuid(self):
        return None  # never cached: tests must see the pass run


def format_graph(graph: torch.fx.Graph) -> str:
    lines = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        target = str(node.target).replace("aten.", "").replace(".default", "")
        args = ", ".join(_fmt(a) for a in node.args)
        lines.append(f"{node.name} = {target}({args})")
    return "\n".join(lines)


def _fmt(arg):
    if isinstance(arg, (list, tuple)):
        return "[" + ", ".join(_fmt(a) for a in arg) + "]"
    if isinstance(arg, float):
        return repr(arg)
    return str(arg)


def rewritten(fn, *args, stage="joint", freezing=False, dynamic=False, **own_options):
    """Compile fn with MLAPass in `stage` followed by a capture; return the captured graph text."""
    capture = Capture()
    slot = "joint_custom_post_pass" if stage == "joint" else "post_grad_custom_post_pass"
    options = {slot: [MLAPass(stage, mla_inductor.config.Config.from_options(own_options)), capture]}
    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(freezing=freezing, fx_graph_cache=False):
        torch.compile(fn, options=options, dynamic=dynamic)(*args)
    return capture.graphs[0]
