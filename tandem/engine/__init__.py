"""The engine: requests, continuous batching and the unified speculative step.

`engine` composes the step from modules with one job each: `request` (a request's state and the
checks it passes), `scheduler` (admission and slots), `batching` (the verify and draft batches),
`masks` and `mask_pipeline` (the step's grammar masks), `sampling` (acceptance's per-row inputs),
`stop` (the commit's stop rules) and `output` (what a request returns and streams).
"""

from tandem.engine.engine import Engine, EngineConfig
from tandem.engine.output import GenerationStats, RequestOutput, StreamDelta
from tandem.engine.request import PromptTooLongError

__all__ = ["Engine", "EngineConfig", "GenerationStats", "PromptTooLongError", "RequestOutput", "StreamDelta"]
