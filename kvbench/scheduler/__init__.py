"""Layer 4, the scheduler: continuous batching over a KV manager (scheduler), the requests and
sequences it schedules (request), and the batch it hands the executor each step (batch)."""
from kvbench.scheduler.batch import StepBatch, StepResult
from kvbench.scheduler.request import RequestState, Sequence
from kvbench.scheduler.scheduler import ADMISSIONS, Scheduler, SchedulerConfig, StepPlan

__all__ = ["ADMISSIONS", "Scheduler", "SchedulerConfig", "StepPlan", "RequestState", "Sequence", "StepBatch",
           "StepResult"]
