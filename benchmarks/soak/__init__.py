"""The chaos soak (`python -m benchmarks.soak`): steady load on a deployment while its replicas are killed one after
another; see benchmarks/soak/chaos.py."""

from benchmarks.soak.chaos import EmbeddedReference, SoakConfig, SoakReport, arun_soak, run_soak

__all__ = ["EmbeddedReference", "SoakConfig", "SoakReport", "arun_soak", "run_soak"]
