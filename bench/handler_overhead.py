"""Item 1: raw streaming jobs through ``handler()`` against ``AsyncLLM.generate`` on the same engine.

The direct path is how vLLM is used without the worker: ``generate`` on the engine's own loop with
the prompt as text (vLLM tokenizes it). The worker path is what the runpod SDK runs: ``handler(job)``
consumed on another event loop, with the worker's default stream batching. Both render the same chat
messages with the model's template and generate the same tokens (temperature 0, ignore_eos).
"""

from __future__ import annotations

import asyncio
import uuid

from bench.common import (HANDLER, PROMPTS, RAW_ENGINE, WARM_UP_TOKENS, Load, Plan, Results, Stream, ab,
                          messages, model_env, run_load)


class EnginePaths:
    def __init__(self, engine) -> None:
        import handler
        from worker.routes.serving import OpenAIvLLMEngine

        # Start-up as the worker's main() does it: the OpenAI app too (which also freezes the heap).
        handler.vllm_engine, handler.openai_engine = engine, OpenAIvLLMEngine(engine)
        self.handler, self.engine = handler.handler, engine
        tokenizer = engine.llm.get_tokenizer()
        self.prompts = [tokenizer.apply_chat_template(messages(i), tokenize=False, add_generation_prompt=True)
                        for i in range(len(PROMPTS))]

    async def _direct_stream(self, i: int, max_tokens: int) -> Stream:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # DELTA outputs, as the worker asks for when streaming.
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0,
                                output_kind=RequestOutputKind.DELTA)
        stream = Stream()
        tokens = 0
        async for output in self.engine.llm.generate(self.prompts[i], params, f"direct-{uuid.uuid4()}"):
            tokens += len(output.outputs[0].token_ids)
            stream.got(tokens)
        return stream.done(tokens)

    async def _handler_stream(self, i: int, max_tokens: int) -> Stream:
        job = {"id": f"bench-{uuid.uuid4()}", "input": {
            "messages": messages(i), "stream": True,
            "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}}}
        stream = Stream()
        tokens = 0
        async for item in self.handler(job):
            if "error" in item:
                raise RuntimeError(f"handler() failed: {item}")
            tokens = item["usage"]["output"]
            stream.got(tokens)
        return stream.done(tokens)

    def direct(self, n: int, max_tokens: int) -> Load:
        return self.engine.loop.run(run_load(n, self._direct_stream, max_tokens))

    def worker(self, n: int, max_tokens: int) -> Load:
        return asyncio.run(run_load(n, self._handler_stream, max_tokens))


def run(model: str, plan: Plan, results: Results) -> None:
    from handler import start_engine
    from worker.config.worker_config import load_config

    engine, _ = start_engine(load_config(model_env(model, plan)))  # as the worker runs it
    try:
        paths = EnginePaths(engine)
        for n in plan.concurrency:  # first-use costs of each batch size, on both paths
            paths.direct(n, WARM_UP_TOKENS), paths.worker(n, WARM_UP_TOKENS)
        for rep in range(plan.load_reps(model)):
            for n in plan.concurrency:
                direct, worker = ab(rep, lambda n=n: paths.direct(n, plan.max_tokens),
                                    lambda n=n: paths.worker(n, plan.max_tokens))
                results.add_load(model, RAW_ENGINE, n, direct)
                results.add_load(model, HANDLER, n, worker)
                results.figure("1 handler overhead", model, f"tokens/s handler() ÷ engine @{n}",
                               goal=("≥", 0.99)).values.append(worker.tokens_per_s / direct.tokens_per_s)
    finally:
        engine.shutdown()
