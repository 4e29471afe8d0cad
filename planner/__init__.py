"""``moefold plan``: which parallel layout fits a model on a cluster and runs fastest. Exact static memory
from the trainer's own buffers built on the meta device, an activation model per schedule, a step-time model
with its collectives, the search over valid layouts, the report and the train commands it prints.

Holds: cluster, grid, static, activations(_ffn), profile, collective (one call and its bytes), comm (the calls each
part of the model makes), deepep, step_time, pipeline_clock (the simulated pipeline of a planned step), candidates
(the layouts considered), search, report, plot, cli.
May import: everything else in moefold (it builds the trainer's buffers and checks its commands parse:
training.cli.train); nothing imports it but the ``moefold`` command table.
"""

from moefold.planner.cluster import Cluster, load_cluster
from moefold.planner.search import Plan, SearchResult, search

__all__ = ["Cluster", "load_cluster", "Plan", "SearchResult", "search"]
