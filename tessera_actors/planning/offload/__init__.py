"""Offload planning: a model bigger than the GPU's budget on a GPU beside a
CPU (:mod:`.model`: the units, homes and the step model; :mod:`.choose`:
Tessera's choice of homes and the ``offload`` planner; :mod:`.baselines`:
GPU-only, layer offload, streaming and the relaxed bound; :mod:`.rates`:
the kernel times the step model scores with; :mod:`.load`: a mixture of
experts' router statistics in those times; :mod:`.mixes`:
per-role mixes for the packed ring; :mod:`.staging`: the ring layout the
executor shares).  Pure Python; no torch."""
from tessera_actors.planning.offload.baselines import expert_offload, gpu_only, ideal, layer_offload, routed_experts, streaming
from tessera_actors.planning.offload.choose import GPU_RESERVE, POLICIES, OffloadPlanner, default_reserve, choose_homes, follow, homes_of, to_plan
from tessera_actors.planning.offload.mixes import class_chooser, unit_classes
from tessera_actors.planning.offload.model import Offload, Placement, StepTime
from tessera_actors.planning.offload.rates import CPU_GEMV_BPS, PCIE_BPS, estimate_rates, host_model

__all__ = ["CPU_GEMV_BPS", "GPU_RESERVE", "Offload", "OffloadPlanner", "PCIE_BPS", "POLICIES", "Placement", "StepTime",
           "choose_homes", "class_chooser", "default_reserve", "estimate_rates", "expert_offload", "follow", "gpu_only", "homes_of", "host_model",
           "ideal", "layer_offload", "routed_experts", "streaming", "to_plan", "unit_classes"]
