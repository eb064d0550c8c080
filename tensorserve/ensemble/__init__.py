"""Ensembles: a ``platform = "ensemble"`` model whose steps run other
models of the repository, as Triton's ensembles do (docs/model-repository.md,
"Ensembles").

    graph.py    the steps as a graph of tensors, checked at load (pure)
    runner.py   ``Ensemble``: runs a request's steps through their models'
                ``infer_many`` as their tensors appear (I/O: the event loop)
    stats.py    the whole ensemble's and each step's counters
    tracer.py   the span contract a step needs (tracing/ensemble.py)

The schema of ``[[ensemble_scheduling.step]]`` is the repository's
(``repository/ensemble_config.py``); the registry builds an ``Ensemble``
for such a model (``serving/registry.py``).
"""

from tensorserve.ensemble.graph import Candidate, EnsemblePlan, plan_ensemble
from tensorserve.ensemble.runner import Ensemble, StepModel

__all__ = ["Candidate", "Ensemble", "EnsemblePlan", "StepModel", "plan_ensemble"]
