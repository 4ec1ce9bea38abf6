"""mla_inductor: TorchInductor fusions for CPU inference of DeepSeek-style (MLA) models.

    torch.compile(model, backend="mla_inductor")                      # no import needed
    torch.compile(model, options=mla_inductor.inductor_options())     # same passes, stock backend
"""

from . import ops  # noqa: F401  (registers the mla:: ops; cached artefacts call them)
from . import lowerings  # noqa: F401  (registers their Inductor lowerings)
from .backend import inductor_options, mla_inductor_backend as backend
from .config import FUSIONS, VERSION as __version__
from .explain import Explanation, explain
from .passes import MLAPass, key_fx_cache_on_sources
from .record import fusion_counts, reset_counts

# The lowerings above serve the stock `inductor` backend too: its FX-graph cache must see our sources.
key_fx_cache_on_sources()

__all__ = [
    "FUSIONS",
    "Explanation",
    "MLAPass",
    "backend",
    "explain",
    "fusion_counts",
    "inductor_options",
    "reset_counts",
]
