"""Planning a refit (no Ray): per-tensor moves with replica choice and domain de-duplication
(`planner`), the lower bound and statistics, buckets and the global schedule, and each
process's share of it (`plan`)."""
from .plan import DEFAULT_BUCKET_BYTES, Item, Plan, PlanStats, Schedule, Transfer, plan
from .planner import DOMAIN, LOCAL, NETWORK, Endpoint, Move, PlanError, TensorPlan, Topology
