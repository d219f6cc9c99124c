"""Placement: cost tables, the memory-aware MILP planner, the baseline
policies, plan prediction by simulation and online plan switching.

Pure Python + numpy + scipy (no torch): graphs captured elsewhere are planned
and compared here without hardware.
"""
from tessera_actors.planning.baselines import (BaselineResult, af_plan, homo_plan, layer_split_plan, pd_throughput,
                        request_distribution, single_graph_baselines, workload_throughput)
from tessera_actors.planning.costs import PRESETS, CostTable, DeviceModel, costs_path_for, device_model
from tessera_actors.planning.monitor import Monitor, PlanSwitcher, StepTicket
from tessera_actors.planning.planner import MilpPlanner, PlannerConfig, plan_both
from tessera_actors.planning.simulate import Prediction, simulate

__all__ = ["BaselineResult", "CostTable", "DeviceModel", "MilpPlanner", "Monitor", "PRESETS",
           "PlanSwitcher", "PlannerConfig", "Prediction", "StepTicket", "af_plan", "costs_path_for",
           "device_model", "homo_plan", "layer_split_plan", "pd_throughput", "plan_both",
           "request_distribution", "simulate", "single_graph_baselines", "workload_throughput"]
