"""Planning a refit (no Ray): what a plan is made of (`moves`), per-tensor moves with replica
choice and domain de-duplication (`planner`), one tensor's plan as a value (`tensor_plan`),
planned once per canonical problem (`canonical`), its cost and lower bound (`bound`), the Plan
and its statistics (`plan`), buckets in one global order (`schedule`), and each process's share
of it (`share`)."""
from .plan import DEFAULT_BUCKET_BYTES, Plan, PlanStats, plan
from .schedule import Item, Schedule, Transfer
from .moves import DOMAIN, LOCAL, NETWORK, Endpoint, Move, PlanError, Topology
from .tensor_plan import TensorPlan
