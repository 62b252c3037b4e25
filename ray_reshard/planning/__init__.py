"""Planning a refit (no Ray): per-tensor moves with replica choice and domain de-duplication
(`planner`), the lower bound and statistics (`plan`), buckets in one global order
(`schedule`), and each process's share of it (`share`)."""
from .plan import DEFAULT_BUCKET_BYTES, Plan, PlanStats, plan
from .schedule import Item, Schedule, Transfer
from .planner import DOMAIN, LOCAL, NETWORK, Endpoint, Move, PlanError, TensorPlan, Topology
