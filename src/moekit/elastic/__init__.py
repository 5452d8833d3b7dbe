"""Elastic expert parallelism: grow and shrink the expert-parallel world while serving.

A controller (controller.py) in the driver process runs worker processes (pool.py,
worker.py), each one expert-parallel rank, serves submitted batches on them (batches.py)
and changes their world through explicit stages (prepare, redistribute, switch, cleanup)
over generation groups built from one rendezvous store (groups.py). Experts move by EPLB's
rearrangement along a transition plan (plan.py); experts whose holders died are read back
from the checkpoint (model.py). Settings and records: config.py.
"""

from .config import BatchFailed, ElasticConfig, ElasticError, StageEvent, TransitionReport
from .controller import ElasticController
from .model import ModelSpec, ReferenceModel, read_experts, write_checkpoint
from .plan import (TransitionPlan, WorkerPlan, apply_plan, assign_packs, check_world, num_slots, place,
                   plan_transition, smallest_world, validate_request, world_problem)

__all__ = [
    "BatchFailed",
    "ElasticConfig",
    "ElasticController",
    "ElasticError",
    "StageEvent",
    "TransitionReport",
    "ModelSpec",
    "ReferenceModel",
    "read_experts",
    "write_checkpoint",
    "TransitionPlan",
    "WorkerPlan",
    "apply_plan",
    "assign_packs",
    "check_world",
    "num_slots",
    "place",
    "plan_transition",
    "smallest_world",
    "validate_request",
    "world_problem",
]
