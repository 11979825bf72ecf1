"""``fsdp2.pipelining``: the public path of ``integrations/pipelining.py``."""

from .integrations.pipelining import PipelineStage

__all__ = ["PipelineStage"]
