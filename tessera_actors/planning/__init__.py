"""Placement: cost tables, the memory-aware MILP planner, the baseline
policies, plan prediction by simulation (the one step-time model,
:mod:`.timing`) and the online monitor the engine switches plans by.

Pure Python + numpy + scipy (no torch): graphs captured elsewhere are planned
and compared here without hardware.
"""
from tessera_actors.planning.baselines import (BaselineResult, af_plan, homo_plan, layer_split_plan,
                                               request_distribution, single_graph_baselines)
from tessera_actors.planning.costs import PRESETS, CostModel, CostTable, DeviceModel, Roofline, costs_path_for, device_model
from tessera_actors.planning.monitor import Monitor
from tessera_actors.planning.planner import MilpPlanner, PlannerConfig
from tessera_actors.planning.simulate import Prediction, simulate

__all__ = ["BaselineResult", "CostModel", "CostTable", "DeviceModel", "MilpPlanner", "Monitor", "PRESETS",
           "PlannerConfig", "Prediction", "Roofline", "af_plan", "costs_path_for",
           "device_model", "homo_plan", "layer_split_plan",
           "request_distribution", "simulate", "single_graph_baselines"]
