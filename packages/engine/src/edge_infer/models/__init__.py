"""Reference models, offline: built from registry packages or generated, into edge-infer's cache."""

from edge_infer.models.registry import REGISTRY, ModelSpec, get_spec
from edge_infer.models.store import PulledModel, model_path, verify

__all__ = ["REGISTRY", "ModelSpec", "PulledModel", "get_spec", "model_path", "verify"]
